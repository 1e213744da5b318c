"""EAGLE draft-tree builders on hand-built head outputs: the EAGLE-2 top-k tree keeps the best
cumulative scores as a connected tree in topological order; the sampled tree draws children
from q without replacement with a shape fixed before the draws."""

from __future__ import annotations

import math

import pytest
import torch

from specserve.speculative.eagle_tree import SampledTree, TopKTree, level_widths, topk_children

V = 6


def log_row(probs: dict[int, float]) -> torch.Tensor:
    """A head output row whose softmax puts `probs` on those tokens, the rest spread evenly."""
    rest = (1.0 - sum(probs.values())) / (V - len(probs))
    p = torch.full((V,), rest, dtype=torch.float64)
    for t, v in probs.items():
        p[t] = v
    return p.log()


def grow(rows_of, topk: int, depth: int) -> TopKTree:
    """Drive a TopKTree like the drafter does; `rows_of(tree, node)` is the head row of node."""
    tree = TopKTree(root_token=99, topk=topk, max_depth=depth)
    frontier = [0]
    while frontier:
        logq, toks = topk_children(torch.stack([rows_of(tree, u) for u in frontier]), topk)
        frontier = tree.expand(frontier, logq, toks)
    return tree


def path_of(tree, node: int) -> tuple[int, ...]:
    out = []
    while node > 0:
        out.append(int(tree.tokens[node]))
        node = int(tree.parents[node])
    return tuple(out[::-1])


HAND = {(): {0: 0.6, 1: 0.3}, (0,): {2: 0.7, 3: 0.2}, (1,): {4: 0.8, 5: 0.1},
        (0, 2): {5: 0.9}, (1, 4): {3: 0.6}}


def hand_rows(tree, u):
    return log_row(HAND.get(path_of(tree, u), {0: 0.5}))


@pytest.mark.parametrize("keep,expected", [
    # scores a .6, b .3, a2 .42, a3 .12, b4 .24, a25 .378, b43 .144 (step 2 expands a2, b4)
    (6, [(0,), (1,), (0, 2), (1, 4), (0, 2, 5), (1, 4, 3)]),
    (5, [(0,), (1,), (0, 2), (1, 4), (0, 2, 5)]),
    (4, [(0,), (1,), (0, 2), (0, 2, 5)]),
    (3, [(0,), (0, 2), (0, 2, 5)]),
])
def test_topk_tree_keeps_the_best_cumulative_scores_on_a_hand_built_head(keep, expected):
    tree = grow(hand_rows, topk=2, depth=3).finalize(keep + 1)
    got = [path_of(tree, i) for i in range(1, tree.num_nodes)]
    assert got == expected  # creation order: level by level, so topological


def test_topk_tree_k1_is_the_greedy_chain_of_num_steps():
    tree = grow(hand_rows, topk=1, depth=4).finalize(5)
    assert tree.parents.tolist() == [-1, 0, 1, 2, 3]
    assert path_of(tree, 4)[:3] == (0, 2, 5)  # the head's argmax path


@pytest.mark.parametrize("seed,topk,depth,keep", [(0, 3, 4, 10), (1, 4, 3, 7), (2, 2, 5, 9),
                                                  (3, 4, 5, 20)])
def test_topk_tree_is_connected_topological_and_best_scored_on_random_heads(seed, topk, depth,
                                                                             keep):
    gen = torch.Generator().manual_seed(seed)
    rows: dict[tuple, torch.Tensor] = {}

    def random_rows(tree, u):  # one fixed random row per path: a deterministic head
        key = path_of(tree, u)
        if key not in rows:
            rows[key] = torch.randn(V, generator=gen) * 2
        return rows[key]

    builder = grow(random_rows, topk, depth)
    tree = builder.finalize(keep + 1)
    assert tree.num_nodes == keep + 1
    kept = {path_of(tree, i) for i in range(1, tree.num_nodes)}
    assert all(p[:-1] in kept or len(p) == 1 for p in kept), "a kept node lost its parent"
    assert int(tree.depth.max()) <= depth
    # every candidate the builder made, by its recomputed score (sum of log q along the path)
    def score(path):
        return sum(float(torch.log_softmax(rows[path[:i]].double(), -1)[path[i]])
                   for i in range(len(path)))
    cands = {path_of(builder, i) for i in range(1, builder.num_nodes)}
    worst_kept = min(score(p) for p in kept)
    assert all(score(p) <= worst_kept + 1e-6 for p in cands - kept)
    # each expanded node has exactly its top-k children among the candidates
    for parent in {p[:-1] for p in cands}:
        kids = sorted(p[-1] for p in cands if p[:-1] == parent)
        assert kids == sorted(rows[parent].topk(topk).indices.tolist())


def test_topk_children_maps_reduced_vocabulary_ids_to_target_ids():
    logits = torch.tensor([[0.0, 3.0, 1.0, 2.0]])
    to_target = torch.tensor([10, 40, 70, 90])
    logq, toks = topk_children(logits, 2, to_target)
    assert toks.tolist() == [[40, 90]]
    torch.testing.assert_close(logq, torch.log_softmax(logits, -1)[:, [1, 3]])


@pytest.mark.parametrize("n,steps,topk,expected", [
    (7, 3, 4, [4, 2, 1]), (7, 4, 4, [4, 1, 1, 1]), (3, 3, 1, [1, 1, 1]), (2, 5, 4, [1, 1]),
    (20, 3, 4, [4, 4, 4]),
])
def test_level_widths_fit_the_budget_reach_the_depth_and_respect_topk(n, steps, topk, expected):
    assert level_widths(n, steps, topk) == expected


def draw_tree(q_of, widths, gen):
    tree = SampledTree(99, widths, V)
    frontier = [0]
    while frontier:
        frontier = tree.expand(frontier, torch.stack([q_of(tree, u) for u in frontier]), gen)
    return tree


def test_sampled_tree_children_are_draws_without_replacement_from_q():
    q = torch.tensor([0.4, 0.3, 0.2, 0.1, 0.0, 0.0])
    gen = torch.Generator().manual_seed(0)
    n = 6000
    counts = torch.zeros(V, V)
    for _ in range(n):
        tree = draw_tree(lambda t, u: q, [2], gen).finalize()
        assert tree.parents.tolist() == [-1, 0, 0]
        a, b = tree.tokens[1:].tolist()
        counts[a, b] += 1
    # P(a, b) = q(a) q(b) / (1 - q(a)): sequential sampling without replacement, in draw order
    expect = q[:, None] * q[None, :] / (1 - q[:, None])
    expect.fill_diagonal_(0.0)
    assert counts[q == 0].sum() == 0 and counts[:, q == 0].sum() == 0 and counts.trace() == 0
    keep = expect > 0
    stat = float(((counts[keep] - n * expect[keep]) ** 2 / (n * expect[keep])).sum())
    assert stat < 33.1, f"chi-square {stat:.1f} over 11 dof"  # p = 0.0005


def test_sampled_tree_shape_is_fixed_and_q_rows_are_what_children_were_drawn_from():
    gen = torch.Generator().manual_seed(1)
    qs: dict[tuple, torch.Tensor] = {}

    def q_of(tree, u):
        key = path_of(tree, u)
        if key not in qs:
            qs[key] = torch.softmax(torch.randn(V, generator=gen), -1)
        return qs[key]

    for _ in range(50):
        builder = draw_tree(q_of, [3, 2, 1], gen)
        tree = builder.finalize()
        assert (tree.depth == 1).sum() == 3 and (tree.depth == 2).sum() == 2
        assert (tree.depth == 3).sum() == 1
        for u in range(tree.num_nodes):
            kids = tree.children(u)
            if kids:  # expanded: its row is the q its children came from, siblings distinct
                torch.testing.assert_close(tree.draft_probs[u], qs[path_of(tree, u)])
                assert len({int(tree.tokens[c]) for c in kids}) == len(kids)
            else:
                assert float(tree.draft_probs[u].sum()) == 0.0
        # only the best-scored nodes of a level are expanded (decided before their children
        # are drawn): level 1 → its best 2, level 2 → its best 1
        for depth, best in ((1, 2), (2, 1)):
            level = [u for u in range(tree.num_nodes) if int(tree.depth[u]) == depth]
            top = sorted(level, key=lambda u: -builder.scores[u])[:best]
            parents = {int(tree.parents[c]) for c in range(tree.num_nodes)
                       if int(tree.depth[c]) == depth + 1}
            assert parents <= set(top)
            for u in level:  # the builder's score is the path's cumulative log q
                path = path_of(tree, u)
                want = sum(math.log(float(qs[path[:i]][path[i]])) for i in range(len(path)))
                assert builder.scores[u] == pytest.approx(want, abs=1e-5)


def test_sampled_tree_over_a_reduced_vocabulary_draws_target_ids_and_scatters_q():
    # q over 4 draft ids that stand for target ids 5, 1, 3, 0 of a V-token vocabulary: the
    # children are target ids, and the verifier's q row is the draft q put at those ids
    to_target = torch.tensor([5, 1, 3, 0])
    q = torch.tensor([0.5, 0.0, 0.3, 0.2])
    gen = torch.Generator().manual_seed(2)
    seen = set()
    for _ in range(200):
        builder = SampledTree(99, [2], V, to_target)
        assert builder.expand([0], q[None], gen) == []
        tree = builder.finalize()
        kids = tree.tokens[1:].tolist()
        assert len(set(kids)) == 2 and set(kids) <= {5, 3, 0}  # draft id 1 has q = 0
        seen.update(kids)
        full = torch.zeros(V)
        full[to_target] = q
        torch.testing.assert_close(tree.draft_probs[0], full)
        assert float(tree.draft_probs[1:].sum()) == 0.0
    assert seen == {5, 3, 0}
