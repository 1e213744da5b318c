"""The batched tree ops the worker verifies with on CUDA (specserve/speculative/tree_ops.py) give
exactly the per-tree walk's results (specserve/speculative/verify.py): greedy / seeded walks and
stochastic sampling in every q mode, on random batches of trees, with the torch reference ops and
with the Triton ops under Triton's interpreter on the CPU; and a worker verifying through them
serves the same tokens as one that walks."""

from __future__ import annotations

import os

import pytest
import torch

from specserve.speculative.tree import DraftTree
from specserve.speculative.tree_ops import TreeOps, make_tree_ops
from specserve.speculative.verify import QMode, verify_greedy, verify_stochastic
from tests.unit.test_spec_penalties_seeds import heads  # noqa: F401
from tests.unit.test_spec_sampling_distribution import tiny_vocab  # noqa: F401

BACKENDS = ["torch"]
if os.environ.get("TRITON_INTERPRET") == "1":  # set by tests/conftest.py when triton imports
    try:
        import triton  # noqa: F401

        BACKENDS.append("triton")
    except ImportError:
        pass


def random_trees(n_trees: int, max_nodes: int, vocab: int, gen: torch.Generator,
                 with_q: bool = False) -> list[DraftTree]:
    trees = []
    for _ in range(n_trees):
        n = int(torch.randint(1, max_nodes + 1, (1,), generator=gen))
        parents = [-1] + [int(torch.randint(0, i, (1,), generator=gen)) for i in range(1, n)]
        tokens = torch.randint(0, vocab, (n,), generator=gen).tolist()
        q = None
        if with_q:
            q = torch.softmax(torch.randn(n, vocab, generator=gen) * 2, -1)
        trees.append(DraftTree.from_parents(tokens, parents, q))
    return trees


def test_auto_walks_on_the_cpu_and_names_a_backend_otherwise() -> None:
    assert make_tree_ops("auto", "cpu") is None
    assert make_tree_ops("walk", "cpu") is None
    ops = make_tree_ops("torch", "cpu")
    assert isinstance(ops, TreeOps) and "torch" in ops.describe()


@pytest.mark.parametrize("backend", BACKENDS)
@pytest.mark.parametrize("seed", range(4))
def test_batched_walk_equals_verify_greedy(backend: str, seed: int) -> None:
    gen = torch.Generator().manual_seed(seed)
    vocab = 3  # small: long accepted paths
    trees = random_trees(7, 9, vocab, gen)
    target = []
    for t in trees:  # mostly a child's token: accepted paths
        for node in range(t.num_nodes):
            kids = t.children(node)
            if kids and float(torch.rand(1, generator=gen)) < 0.8:
                pick = kids[int(torch.randint(0, len(kids), (1,), generator=gen))]
                target.append(int(t.tokens[pick]))
            else:
                target.append(int(torch.randint(0, vocab, (1,), generator=gen)))
    target = torch.tensor(target)
    got = TreeOps(backend, "cpu").walk_tokens(trees, target)
    off = 0
    for t, r in zip(trees, got):
        assert r == verify_greedy(t, target[off : off + t.num_nodes])
        off += t.num_nodes
    assert sum(len(r.accepted_tokens) for r in got) >= 3  # real paths were walked


@pytest.mark.parametrize("backend", BACKENDS)
@pytest.mark.parametrize("q_mode", list(QMode))
@pytest.mark.parametrize("thresholds", [(1.0, 1.0), (0.6, 0.5)])
def test_batched_sampling_equals_verify_stochastic(backend: str, q_mode: QMode,
                                                   thresholds: tuple[float, float]) -> None:
    gen = torch.Generator().manual_seed(11)
    vocab = 5
    trees = random_trees(6, 8, vocab, gen, with_q=q_mode is not QMode.ONE_HOT)
    total = sum(t.num_nodes for t in trees)
    probs = torch.softmax(torch.randn(total, vocab, generator=gen) * 1.5, -1)
    coins = [torch.rand(t.num_nodes, generator=gen, dtype=torch.float64) for t in trees]
    got = TreeOps(backend, "cpu").sample(trees, probs, coins, q_mode, *thresholds)
    off = 0
    for t, u, r in zip(trees, coins, got):
        want = verify_stochastic(t, probs[off : off + t.num_nodes], u, q_mode=q_mode,
                                 threshold_single=thresholds[0], threshold_acc=thresholds[1])
        assert r == want
        off += t.num_nodes


MIXED = [{"temperature": 0.0}, {"temperature": 0.0, "repetition_penalty": 1.3},
         {"temperature": 0.8, "top_p": 0.9, "seed": 7}, {"temperature": 0.9},
         {"temperature": 0.7, "top_k": 6}, {"temperature": 0.0}]


def _serve(tiny_vocab, heads, algo: str, tree_ops: str) -> tuple[list, dict]:  # noqa: F811
    """Six requests of mixed kinds (greedy, penalised, seeded, unseeded sampled) in one batch."""
    from specserve.runtime.model_runner.runner_process import RunnerWorker
    from specserve.speculative.base import SpecConfig, create_drafter
    from specserve.speculative.worker import SpeculativeWorker
    from tests.unit.test_scheduler import Harness
    from tests.unit.test_spec_penalties_seeds import copy_heavy

    runner = tiny_vocab[1]
    if algo == "NGRAM":
        spec = SpecConfig(algo, 6, disable_adaptive=True, tree_ops=tree_ops)
    else:
        spec = SpecConfig(algo, 6, draft_model_path=str(heads[algo]), num_steps=2, eagle_topk=3,
                          disable_adaptive=True, tree_ops=tree_ops)
    worker = SpeculativeWorker(spec, create_drafter(spec, runner), runner)
    assert (worker.tree_ops is None) == (tree_ops == "walk")
    h = Harness(tiny_vocab, num_draft_tokens=6, max_running_requests=8)
    h.worker = RunnerWorker(runner, worker)
    h.sched.run_batch = h.worker.run
    for i, (p, params) in enumerate(zip(copy_heavy(len(MIXED), seed=21), MIXED)):
        h.submit(f"r{i}", p, ignore_eos=True, max_new_tokens=20, **params)
    torch.manual_seed(5)
    h.run()
    h.sched.check_no_leak()
    return [h.outputs[f"r{i}"] for i in range(len(MIXED))], h.sched.info()


@pytest.mark.parametrize("backend", BACKENDS)
@pytest.mark.parametrize("algo", ["NGRAM", "EAGLE3"])
def test_worker_verifying_through_the_ops_serves_the_walks_tokens(
        tiny_vocab, heads, backend: str, algo: str) -> None:  # noqa: F811
    """The worker with tree_ops=<backend> gives the walking worker's tokens for the same torch
    RNG state (greedy, penalised, seeded and unseeded sampled requests in one batch; EAGLE-3's
    trees carry q, NGRAM's are one-hot)."""
    walked, info = _serve(tiny_vocab, heads, algo, "walk")
    assert info["spec_decode_num_accepted_tokens"] > 0, info
    assert _serve(tiny_vocab, heads, algo, backend)[0] == walked
