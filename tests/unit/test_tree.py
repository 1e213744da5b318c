from __future__ import annotations

import random

import pytest
import torch

from specserve.speculative.tree import DraftTree, pack_trees


def _random_tree(rng: random.Random, n: int, vocab: int = 50, with_q: bool = False) -> DraftTree:
    parents = [-1] + [rng.randrange(i) for i in range(1, n)]
    tokens = [rng.randrange(vocab) for _ in range(n)]
    q = torch.softmax(torch.randn(n, vocab), -1) if with_q else None
    return DraftTree.from_parents(tokens, parents, q)


def _brute_ancestors(parents: list[int], i: int) -> set[int]:
    out = {i}
    while parents[i] >= 0:
        i = parents[i]
        out.add(i)
    return out


@pytest.mark.parametrize("seed", range(20))
def test_ancestor_mask_and_depth_match_a_brute_force_parent_walk(seed: int) -> None:
    rng = random.Random(seed)
    tree = _random_tree(rng, rng.randint(1, 40))
    parents = tree.parents.tolist()
    mask = tree.ancestor_mask
    assert mask.dtype == torch.bool and mask.shape == (tree.num_nodes, tree.num_nodes)
    for i in range(tree.num_nodes):
        anc = _brute_ancestors(parents, i)
        assert {j for j in range(tree.num_nodes) if mask[i, j]} == anc
        assert int(tree.depth[i]) == len(anc) - 1


@pytest.mark.parametrize("seed", range(20))
def test_first_child_next_sibling_enumerate_exactly_each_nodes_children(seed: int) -> None:
    rng = random.Random(100 + seed)
    tree = _random_tree(rng, rng.randint(1, 40))
    parents = tree.parents.tolist()
    first, nxt = tree.first_child.tolist(), tree.next_sibling.tolist()
    for u in range(tree.num_nodes):
        expected = [c for c in range(tree.num_nodes) if parents[c] == u]  # ascending index
        walked, c = [], first[u]
        while c >= 0:
            walked.append(c)
            c = nxt[c]
        assert walked == expected
        assert tree.children(u) == expected
    assert nxt[0] == -1


def test_positions_put_the_root_at_prefix_len() -> None:
    # root(0) -> 1 -> 3, root -> 2: depths 0, 1, 1, 2.
    tree = DraftTree.from_parents([7, 8, 9, 10], [-1, 0, 0, 1])
    seq_len = 12  # 11 tokens in KV + the root, whose KV is computed by this verify forward
    assert tree.positions(seq_len).tolist() == [11, 12, 12, 13]
    assert tree.depth.tolist() == [0, 1, 1, 2]
    assert tree.positions(1).tolist() == [0, 1, 1, 2]  # an empty cache: root at position 0


def test_chain_is_a_tree_with_one_child_per_node() -> None:
    tree = DraftTree.chain(5, [6, 7, 8])
    assert tree.tokens.tolist() == [5, 6, 7, 8]
    assert tree.parents.tolist() == [-1, 0, 1, 2]
    assert tree.first_child.tolist() == [1, 2, 3, -1]
    assert tree.next_sibling.tolist() == [-1, -1, -1, -1]
    assert torch.equal(tree.ancestor_mask, torch.tril(torch.ones(4, 4, dtype=torch.bool)))
    only_root = DraftTree.chain(5, [])
    assert only_root.num_nodes == 1 and only_root.first_child.tolist() == [-1]


@pytest.mark.parametrize(
    ("tokens", "parents", "q_shape", "message"),
    [
        ([1, 2], [0, 0], None, "root"),
        ([1, 2, 3], [-1, 0, 2], None, "topological"),
        ([1, 2, 3], [-1, 0, -1], None, "topological"),
        ([1, 2], [-1, 0, 1], None, "differ in length"),
        ([1, 2], [-1, 0], (3, 5), "draft_probs"),
        ([], [], None, "at least the root"),
    ],
)
@pytest.mark.parametrize("as_tensors", [False, True])  # drafters' lists, and tensors
def test_from_parents_rejects_malformed_trees(
    tokens: list[int], parents: list[int], q_shape: tuple[int, int] | None, message: str,
    as_tensors: bool,
) -> None:
    q = torch.full(q_shape, 0.2) if q_shape else None
    if as_tensors:
        tokens, parents = torch.tensor(tokens), torch.tensor(parents)
    with pytest.raises(AssertionError, match=message):
        DraftTree.from_parents(tokens, parents, q)


def test_trees_from_lists_and_from_tensors_are_the_same_tree() -> None:
    tokens, parents = [7, 8, 9, 10, 11], [-1, 0, 0, 1, 3]
    a = DraftTree.from_parents(tokens, parents)
    b = DraftTree.from_parents(torch.tensor(tokens), torch.tensor(parents))
    for t in (a, b):
        assert t.token_list == tokens and t.tokens.dtype == torch.int64
        assert t.parents.tolist() == parents and t.depth.tolist() == [0, 1, 1, 2, 3]
    assert torch.equal(a.ancestor_mask, b.ancestor_mask)
    tokens.append(12)  # the caller's list is not the tree's
    assert a.num_nodes == 5 and a.token_list == [7, 8, 9, 10, 11]


def test_a_one_node_tree_from_lists_is_the_root_tree_with_the_same_views() -> None:
    """`from_parents([t], [-1])` takes `root`'s shortcut (shared read-only parents and mask):
    every view equals the general construction's, and the tensors are not shared with the
    caller."""
    fast = DraftTree.from_parents([7], [-1])
    general = DraftTree(torch.tensor([7]), torch.tensor([-1]))
    for t in (fast, DraftTree.root(7)):
        assert t.token_list == [7] and t.num_nodes == 1 and t.depth_list == [0]
        for name in ("tokens", "parents", "depth", "first_child", "next_sibling",
                     "ancestor_mask"):
            assert torch.equal(getattr(t, name), getattr(general, name)), name
        assert t.children(0) == []
    assert DraftTree.from_parents([7, 8], [-1, 0]).depth_list == [0, 1]


def test_pack_trees_flattens_a_batch_of_different_sizes() -> None:
    rng = random.Random(7)
    trees = [_random_tree(rng, n, with_q=True) for n in (5, 1, 9, 3)]
    seq_lens = [10, 3, 40, 7]
    packed = pack_trees(trees, seq_lens)
    assert packed.qo_indptr.tolist() == [0, 5, 6, 15, 18]
    assert packed.num_nodes == [5, 1, 9, 3] and packed.batch_size == 4
    assert packed.candidates.shape == (4, 9)
    for b, tree in enumerate(trees):
        lo, hi = int(packed.qo_indptr[b]), int(packed.qo_indptr[b + 1])
        n = tree.num_nodes
        assert torch.equal(packed.tokens[lo:hi], tree.tokens)
        assert torch.equal(packed.positions[lo:hi], tree.positions(seq_lens[b]))
        assert int(packed.positions[lo]) == seq_lens[b] - 1
        assert torch.equal(packed.mask(b), tree.ancestor_mask)
        assert torch.equal(packed.draft_probs[lo:hi], tree.draft_probs)
        # flat parents point inside the same request
        flat_par = packed.parents[lo:hi].tolist()
        assert flat_par[0] == -1 and all(lo <= p < hi for p in flat_par[1:])
        assert [p - lo for p in flat_par[1:]] == tree.parents[1:].tolist()
        assert packed.retrive_index[b, :n].tolist() == list(range(lo, hi))
        assert packed.retrive_next_token[b, :n].tolist() == tree.first_child.tolist()
        assert packed.retrive_next_sibling[b, :n].tolist() == tree.next_sibling.tolist()
        assert packed.candidates[b, n:].eq(-1).all() and packed.retrive_index[b, n:].eq(-1).all()
    assert int(packed.mask_indptr[-1]) == packed.tree_mask.numel() == 25 + 1 + 81 + 9


def test_pack_trees_refuses_mixing_trees_with_and_without_draft_probs() -> None:
    with_q = DraftTree.chain(1, [2], torch.full((2, 4), 0.25))
    without = DraftTree.chain(1, [2])
    assert pack_trees([without, without], [3, 4]).draft_probs is None
    with pytest.raises(AssertionError, match="draft_probs"):
        pack_trees([with_q, without], [3, 4])
