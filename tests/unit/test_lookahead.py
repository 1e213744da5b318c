"""LOOKAHEAD (Lookahead decoding): the step's attention mask equals the paper's 2-D mask built
densely from its definition, the one forward gives every node the logits of its path run as a
causal sequence, the Jacobi step harvests the window's n-grams, the pools stay bounded, and
greedy output equals plain decoding on the tiny model at batch 1 and 8."""

from __future__ import annotations

import pytest
import torch

from specserve.runtime.forward_batch import ForwardBatch, ForwardMode
from specserve.runtime.model_runner.runner_process import RunnerWorker
from specserve.speculative.base import SpecConfig, create_drafter
from specserve.speculative.drafters.lookahead import _Request, lookahead_tree_size
from specserve.speculative.tree import DraftTree
from specserve.speculative.worker import SpeculativeWorker
from tests.integration.test_spec_lossless import copy_heavy_prompts
from tests.unit.test_scheduler import Harness, reference, tiny  # noqa: F401

W, N, G = 4, 4, 2


def drafter(w=W, n=N, g=G, **kw):
    return create_drafter(SpecConfig("LOOKAHEAD", lookahead_tree_size(w, n, g),
                                     lookahead_window=w, lookahead_ngram=n,
                                     lookahead_guess_set=g, **kw), None)


def state_with_pool(d, root):
    levels = [[100 * (lv + 1) + i for i in range(W)] for lv in range(N - 1)]
    st = _Request(levels)
    st.pool[root] = [(7, 8, 9), (7, 8, 5)]  # share the prefix 7, 8: merged in the tree
    d.reqs["r"] = st
    return st


def paper_mask(roles: list[tuple]) -> torch.Tensor:
    """The dense mask from the paper's definition, over nodes described by role:
    ("root",), ("look", level, column), ("verify", candidate, k): a lookahead token at
    (level l, column i) sees level 0's columns <= i (column 0 being the root) and its own
    column's levels 1..l; a verification token sees the root and its candidate's tokens
    before it; nothing sees across branches."""
    n = len(roles)
    m = torch.zeros(n, n, dtype=torch.bool)
    for a, ra in enumerate(roles):
        for b, rb in enumerate(roles):
            if rb[0] == "root":
                m[a, b] = True
            elif ra[0] == "look" and rb[0] == "look":
                (_, la, ia), (_, lb, ib) = ra, rb
                m[a, b] = (lb == 0 and ib <= ia) or (lb >= 1 and ib == ia and lb <= la)
            elif ra[0] == "verify" and rb[0] == "verify":
                (_, ca, ka), (_, cb, kb) = ra, rb
                m[a, b] = kb <= ka and ca_prefix_equal(ca, cb, kb)
    return m


CANDS = [(7, 8, 9), (7, 8, 5)]


def ca_prefix_equal(ca, cb, kb):
    return CANDS[ca][: kb + 1] == CANDS[cb][: kb + 1]


def test_the_step_mask_equals_the_papers_2d_mask():
    d = drafter()
    root = 3
    st = state_with_pool(d, root)
    tokens, parents = d.build(st, root, lookahead_tree_size(W, N, G))
    tree = DraftTree.from_parents(tokens, parents)
    roles: list[tuple | None] = [None] * len(tokens)
    roles[0] = ("root",)
    for lv in range(N - 1):
        for i in range(W):
            node = st.layout[lv][i]
            if node:
                roles[node] = ("look", lv, i)
    # verification nodes: the candidates merged (7 -> 8 -> {5, 9}); one role per node
    for node, tok in enumerate(tokens):
        if roles[node] is None:
            depth = int(tree.depth[node]) - 1
            cand = next(c for c, g in enumerate(CANDS) if g[depth] == tok
                        and all(tokens[x] == g[k] for k, x in enumerate(
                            path_nodes(parents, node)[1:])))
            roles[node] = ("verify", cand, depth)
    assert sum(r[0] == "verify" for r in roles) == 4  # 7, 8, 9, 5
    assert len(tokens) == 1 + 4 + (W - 1) + W * (N - 2)
    assert torch.equal(tree.ancestor_mask, paper_mask(roles))
    # positions: (level l, column i) at depth i + l (+1 for columns past the root's)
    for lv in range(N - 1):
        for i in range(W):
            node = st.layout[lv][i]
            assert int(tree.depth[node]) == i + lv


def path_nodes(parents, node):
    out = []
    while node != -1:
        out.append(node)
        node = parents[node]
    return out[::-1]


def test_one_forward_gives_each_node_its_causal_path_logits(tiny):  # noqa: F811
    runner = tiny[1]
    d = drafter()
    prompt = list(range(10, 40))
    root = prompt[-1]
    st = state_with_pool(d, root)
    tokens, parents = d.build(st, root, lookahead_tree_size(W, N, G))
    tree = DraftTree.from_parents(tokens, parents)
    n = len(tokens)
    pre = len(prompt) - 1
    slots = torch.arange(1, pre + n + 1)
    runner.forward(ForwardBatch.build(ForwardMode.EXTEND, [prompt[:-1]], [slots[:pre]], [0]))
    verify = ForwardBatch.build(ForwardMode.TARGET_VERIFY, [tokens], [slots], [pre],
                                positions=[pre + tree.depth], custom_masks=[tree.ancestor_mask],
                                logits="all")
    got = runner.forward(verify).logits
    for node in range(n):
        path = [tokens[j] for j in path_nodes(parents, node)]
        seq = prompt[:-1] + path
        s2 = torch.arange(300, 300 + len(seq))
        ref = runner.forward(ForwardBatch.build(ForwardMode.EXTEND, [seq], [s2], [0])).logits[-1]
        assert (got[node] - ref).abs().max().item() < 1e-3, node


def test_jacobi_step_shifts_the_window_and_harvests_column_ngrams():
    d = drafter(g=1)
    st = state_with_pool(d, 3)
    st.pool.clear()  # no verification branch: the lookahead branch alone
    before = [list(lv) for lv in st.levels]
    tokens, parents = d.build(st, 3, lookahead_tree_size(W, N, 0))
    layout = [list(row) for row in st.layout]
    assert len(tokens) == lookahead_tree_size(W, N, 0)
    tree = DraftTree.from_parents(tokens, parents)
    am = [1000 + k for k in range(len(tokens))]  # the target's argmax at each node
    d.after_verify(["r"], [tree], [am], [[0]])
    new = [1000 + layout[N - 2][i] for i in range(W)]  # argmax at each column's last level
    assert st.levels[:-1] == before[1:] and st.levels[-1] == new
    for i in range(W):
        first = 3 if i == 0 else before[0][i]  # column 0's level-0 token is the root
        gram = tuple(before[lv][i] for lv in range(1, N - 1)) + (new[i],)
        assert gram in st.pool[first] and gram in d.global_pool[first]


def test_a_small_budget_drafts_fewer_columns_and_keeps_room_for_one():
    d = drafter()
    st = state_with_pool(d, 3)
    tokens, _ = d.build(st, 3, 6)
    assert len(tokens) <= 6
    assert st.layout[N - 2][0] is not None  # column 0 always fits
    assert tokens[1:3] == [7, 8]  # a verification candidate first


def test_pools_stay_bounded():
    d = drafter(lookahead_global_pool=50)
    import random

    rng = random.Random(0)
    st = _Request([[0] * W for _ in range(N - 1)])
    for _ in range(2000):
        d._add(st, [rng.randrange(40) for _ in range(N)])
        assert d.global_count <= 50
        assert d.global_count == sum(len(v) for v in d.global_pool.values())
    assert all(len(v) <= G for v in st.pool.values())
    assert all(len(v) <= G for v in d.global_pool.values())


@pytest.mark.parametrize("concurrency", [1, 8])
def test_tiny_model_lookahead_greedy_equals_plain(tiny, concurrency):  # noqa: F811
    prompts = copy_heavy_prompts(50, seed=20 + concurrency)
    ref = reference(tiny, prompts, ignore_eos=True, max_new_tokens=20)
    n = lookahead_tree_size(3, 3, 3)
    h = Harness(tiny, num_draft_tokens=n, max_running_requests=concurrency)
    cfg = SpecConfig("LOOKAHEAD", n)
    runner = tiny[1]
    h.worker = RunnerWorker(runner, SpeculativeWorker(cfg, create_drafter(cfg, runner), runner))
    h.sched.run_batch = h.worker.run
    for i, p in enumerate(prompts):
        h.submit(f"r{i}", p, ignore_eos=True, max_new_tokens=20)
    h.run()
    assert [h.outputs[f"r{i}"] for i in range(50)] == ref
    assert h.sched.info()["spec_decode_num_accepted_tokens"] > 0
    assert h.worker.spec.drafter.global_count > 0
    h.sched.check_no_leak()
    # every finished request's window is dropped (the last releases ride the next batch)
    assert set(h.worker.spec.drafter.reqs) <= set(h.sched.released)


def test_lookahead_sizes_its_tree_from_w_n_g():
    from specserve.launch.server_args import ServerArgs

    args = ServerArgs(speculative_algorithm="LOOKAHEAD", speculative_lookahead_window=5,
                      speculative_lookahead_ngram=4, speculative_lookahead_guess_set=2).resolve()
    assert args.speculative_num_draft_tokens == lookahead_tree_size(5, 4, 2) == 1 + 4 + 10 + 6
    with pytest.raises(ValueError, match="lookahead-ngram"):
        ServerArgs(speculative_algorithm="LOOKAHEAD", speculative_lookahead_ngram=1).resolve()


def test_the_pool_holds_the_context_ngrams_unless_turned_off():
    d = drafter(n=3, g=2)
    d.observe("a", [1, 2, 3, 1, 2, 4], 6)
    assert d.reqs["a"].pool[1] == [(2, 3), (2, 4)] and d.reqs["a"].pool[2] == [(3, 1)]
    d.observe("a", [1, 2, 3, 1, 2, 4, 1, 2, 5], 3)  # output n-grams join as they come
    assert d.reqs["a"].pool[1] == [(2, 4), (2, 5)]  # at most G per first token, newest kept
    assert d.global_count == 0  # a request's own text is not shared
    tokens, _ = d.build(d.reqs["a"], 1, lookahead_tree_size(W, 3, 2))
    assert tokens[1:4] == [2, 5, 4]  # the newest candidate first, merged on their shared 2
    off = drafter(n=3, g=2, lookahead_pool_from_context=False)
    off.observe("a", [1, 2, 3, 1, 2, 4], 6)
    assert not off.reqs["a"].pool
