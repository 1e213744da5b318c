"""Grammar masks over a draft tree (specserve/runtime/constrained/tree_masks.py) and the
grammar-forced chain added to a drafter's tree (specserve/speculative/worker.py: `add_chain`), on
the toy grammar of test_grammar_spec_distribution.py."""

from __future__ import annotations

from specserve.runtime.constrained.tree_masks import constrain_tree
from specserve.speculative.worker import add_chain
from tests.unit.test_grammar_spec_distribution import ToyBackend, ToyMatcher, allowed


def bits(mask_row) -> list[int]:
    word = int(mask_row[0]) & 0xFFFFFFFF
    return [t for t in range(32) if word >> t & 1]


def test_each_node_is_masked_by_its_own_paths_state_and_forbidden_subtrees_go():
    m = ToyMatcher(ToyBackend())
    assert m.accept(4)  # the root: the last committed token, accepted already
    # root 4 -> 3 (allowed after 4) -> 11 (allowed after 3?) ; root -> 8 (forbidden after 4)
    ok3, ok8 = 3 in allowed(4), 8 in allowed(4)
    assert ok3 and not ok8
    tokens, parents = [4, 3, 8, allowed(3)[0], 5], [-1, 0, 0, 1, 2]
    kept, masks, ended = constrain_tree(m, tokens, parents)
    assert kept == [0, 1, 3]  # node 2 (8) is forbidden after 4, and its child 4 with it
    assert bits(masks[0]) == allowed(4)
    assert bits(masks[1]) == allowed(3)
    assert bits(masks[2]) == allowed(allowed(3)[0])
    assert ended == [False, False, False]
    assert m.states == [None, 4]  # the matcher is left where it was


def test_the_forced_chain_shares_the_drafters_path_and_keeps_its_numbering():
    tokens, parents = [9, 1, 2, 7], [-1, 0, 1, 0]
    out_t, out_p = add_chain(tokens, parents, [1, 2, 3, 4], cap=6)
    assert out_t[:4] == tokens and out_p[:4] == parents  # the drafter's nodes first, unchanged
    assert out_t[4:] == [3, 4] and out_p[4:] == [2, 4]  # the chain continues its shared path
    out_t, out_p = add_chain(tokens, parents, [5, 6], cap=5)
    assert out_t == [9, 1, 2, 7, 5] and out_p == [-1, 0, 1, 0, 0]  # the cap cuts it
