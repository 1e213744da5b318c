"""EAGLE / EAGLE3 sampling end to end (scheduler + runner worker + draft head, top-k > 1, trees
two levels deep) on a 12-token target: the sampled tokens follow the target's processed
distribution (penalties included) at every verify position whether the tree is drawn from q and
verified with q (WITHOUT_REPLACEMENT), is the top-k tree verified with q ignored (target-only,
ONE_HOT), or belongs to a seeded request (children drawn with the request's own Gumbel noise,
verified by its seeded draws)."""

from __future__ import annotations

import pytest
import torch

from specserve.runtime.model_runner.runner_process import RunnerWorker
from specserve.speculative.base import SpecConfig, create_drafter
from specserve.speculative.worker import SpeculativeWorker
from tests.helpers.eagle_checkpoints import write_eagle1_checkpoint, write_eagle3_checkpoint
from tests.unit.test_scheduler import Harness
from tests.unit.test_spec_sampling_distribution import (  # noqa: F401 - fixtures
    PARAMS,
    PROMPT,
    TOKENS,
    joints,
    pair_fits,
    tiny_vocab,
)

SAMPLES = 3000
STEPS, TOPK, NODES = 2, 3, 6  # sampled trees: 3 children of the root, 2 grandchildren


@pytest.fixture(scope="module")
def heads(tiny_vocab, tmp_path_factory):  # noqa: F811
    root = tmp_path_factory.mktemp("eagle_tv")
    return {"EAGLE": write_eagle1_checkpoint(root / "e1", tiny_vocab[0], seed=5),
            # 8 of the 12 ids; the 2-layer target is captured entering layers 1, 1 and after 2
            "EAGLE3": write_eagle3_checkpoint(root / "e3", tiny_vocab[0], seed=6,
                                              draft_vocab_size=8, aux_layer_ids=[0, 0, 1])}


# `make test` runs EAGLE-3 drafting from q and seeded; the rest of the grid is `make test-all`'s
KEPT = {("EAGLE3", "with_q"), ("EAGLE3", "seeded")}
GRID = [pytest.param(algo, mode, marks=() if (algo, mode) in KEPT else pytest.mark.full)
        for algo in ("EAGLE", "EAGLE3") for mode in ("with_q", "target_only", "seeded")]


@pytest.mark.parametrize("algo,mode", GRID)
def test_eagle_sampling_matches_target_distribution(tiny_vocab, joints, heads, algo,  # noqa: F811
                                                    mode):
    runner = tiny_vocab[1]
    target_only = mode == "target_only"
    torch.manual_seed(0)  # unseeded requests draw from the global RNG
    cfg = SpecConfig(algo, NODES, draft_model_path=str(heads[algo]), num_steps=STEPS,
                     eagle_topk=TOPK, eagle_target_only=target_only, disable_adaptive=True)
    drafter = create_drafter(cfg, runner)
    with_q = []
    propose = drafter.propose

    def spy(reqs):
        trees = propose(reqs)
        with_q.extend(t.draft_probs is not None for t in trees if t.num_nodes > 1)
        return trees

    drafter.propose = spy
    coupled = []
    noise_of = drafter._coupled_noise
    drafter._coupled_noise = lambda g, nodes: coupled.append(noise_of(g, nodes)) or coupled[-1]
    h = Harness(tiny_vocab, capacity=60000, num_draft_tokens=NODES, max_running_requests=512,
                chunked_prefill_size=4096)
    h.worker = RunnerWorker(runner, SpeculativeWorker(cfg, drafter, runner))
    h.sched.run_batch = h.worker.run
    h.sched.stop.eos = set()
    for i in range(SAMPLES):
        seed = {"seed": i} if mode == "seeded" else {}
        h.submit(f"s{i}", PROMPT, max_new_tokens=TOKENS, **seed, **PARAMS)
    h.run()
    info = h.sched.info()
    assert info["spec_decode_num_draft_tokens"] >= 4 * info["spec_verify_steps"], info
    per_pos = info["spec_decode_num_accepted_tokens_per_pos"]
    assert len(per_pos) >= 2 and per_pos[1] > 0, f"no depth-2 draft accepted: {per_pos}"
    assert with_q and all(q != target_only for q in with_q), "q travels only in sampled trees"
    # seeded requests draw their children with their own noise (coupling), the others never;
    # target-only trees are top-k trees, drawn from nothing
    assert bool(coupled) != target_only
    assert all((c is not None) == (mode == "seeded") for c in coupled)
    assert drafter.scratch >= 512 * STEPS * TOPK, "512 requests outgrew the initial scratch KV"
    outs = torch.tensor([h.outputs[f"s{i}"] for i in range(SAMPLES)])  # [n, TOKENS]
    for k, fit in enumerate(pair_fits(outs, joints)):
        assert fit.passed, f"tokens {k + 1},{k + 2}: {fit}"
    h.sched.check_no_leak()
