"""EAGLE / EAGLE3 sampling end to end (scheduler + runner worker + draft head, top-k > 1, trees
two levels deep) on a 12-token target: three sampled tokens follow the target's processed
distribution whether the tree is drawn from q and verified with q (WITHOUT_REPLACEMENT) or is
the top-k tree verified with q ignored (target-only, ONE_HOT)."""

from __future__ import annotations

import math

import pytest
import torch

from runtime.model_runner.forward_batch import ForwardBatch, ForwardMode
from runtime.model_runner.runner_process import RunnerWorker
from runtime.sampling.sampler import SamplingBatchInfo, process_logits
from runtime.sampling.sampling_params import SamplingParams
from speculative.base import SpecConfig, create_drafter
from speculative.worker import SpeculativeWorker
from tests.helpers.eagle_checkpoints import write_eagle1_checkpoint, write_eagle3_checkpoint
from tests.unit.test_scheduler import Harness
from tests.unit.test_spec_sampling_distribution import (  # noqa: F401 - tiny_vocab is a fixture
    PARAMS,
    PROMPT,
    VOCAB,
    chi_square,
    tiny_vocab,
)

SAMPLES = 3000
STEPS, TOPK, NODES = 2, 3, 6  # sampled trees: 3 children of the root, 2 grandchildren


@pytest.fixture(scope="module")
def joints(tiny_vocab):  # noqa: F811
    """Exact p(t1, t2) and p(t2, t3) [V, V] after PROMPT under the processed distribution."""
    runner = tiny_vocab[1]
    params = SamplingParams(**PARAMS)

    def dist(seqs: list[list[int]]) -> torch.Tensor:  # [len(seqs), V]
        lens = [len(s) for s in seqs]
        slots = [torch.arange(1, n + 1) + 64 * i for i, n in enumerate(lens)]
        logits = runner.forward(ForwardBatch.build(ForwardMode.EXTEND, seqs, slots,
                                                   [0] * len(seqs))).logits
        info = SamplingBatchInfo.from_params([params] * len(seqs), VOCAB)
        return process_logits(logits, info).double()

    p1 = dist([PROMPT])[0]  # [V]
    p2 = dist([PROMPT + [a] for a in range(VOCAB)])  # [V, V]: p(t2 | t1)
    p3 = dist([PROMPT + [a, b] for a in range(VOCAB) for b in range(VOCAB)]).view(
        VOCAB, VOCAB, VOCAB)  # p(t3 | t1, t2)
    j12 = p1[:, None] * p2
    return j12, (j12[:, :, None] * p3).sum(0)


@pytest.fixture(scope="module")
def heads(tiny_vocab, tmp_path_factory):  # noqa: F811
    root = tmp_path_factory.mktemp("eagle_tv")
    return {"EAGLE": write_eagle1_checkpoint(root / "e1", tiny_vocab[0], seed=5),
            # 8 of the 12 ids; the 2-layer target is captured entering layers 1, 1 and after 2
            "EAGLE3": write_eagle3_checkpoint(root / "e3", tiny_vocab[0], seed=6,
                                              draft_vocab_size=8, aux_layer_ids=[0, 0, 1])}


def chi2_critical(dof: int, z: float = 3.29) -> float:
    """Wilson-Hilferty approximation of the chi-square quantile (z = 3.29: p = 0.0005)."""
    a = 2.0 / (9.0 * dof)
    return dof * (1.0 - a + z * math.sqrt(a)) ** 3


@pytest.mark.parametrize("algo", ["EAGLE", "EAGLE3"])
@pytest.mark.parametrize("target_only", [False, True])
def test_eagle_sampling_matches_target_distribution(tiny_vocab, joints, heads, algo,  # noqa: F811
                                                    target_only):
    runner = tiny_vocab[1]
    cfg = SpecConfig(algo, NODES, draft_model_path=str(heads[algo]), num_steps=STEPS,
                     eagle_topk=TOPK, eagle_target_only=target_only, adaptive=False)
    drafter = create_drafter(cfg, runner)
    with_q = []
    propose = drafter.propose

    def spy(reqs):
        trees = propose(reqs)
        with_q.extend(t.draft_probs is not None for t in trees if t.num_nodes > 1)
        return trees

    drafter.propose = spy
    h = Harness(tiny_vocab, capacity=60000, num_draft_tokens=NODES, max_running_requests=512,
                chunked_prefill_size=4096)
    h.worker = RunnerWorker(runner, SpeculativeWorker(cfg, drafter, runner))
    h.sched.run_batch = h.worker.run
    h.sched.stop.eos = set()
    for i in range(SAMPLES):
        h.submit(f"s{i}", PROMPT, max_new_tokens=3, seed=i, **PARAMS)
    h.run()
    info = h.sched.info()
    assert info["spec_decode_num_draft_tokens"] >= 4 * info["spec_verify_steps"], info
    per_pos = info["spec_decode_num_accepted_tokens_per_pos"]
    assert len(per_pos) >= 2 and per_pos[1] > 0, f"no depth-2 draft accepted: {per_pos}"
    assert with_q and all(q != target_only for q in with_q), "q travels only in sampled trees"
    assert drafter.scratch >= 512 * STEPS * TOPK, "512 requests outgrew the initial scratch KV"
    outs = torch.tensor([h.outputs[f"s{i}"][:3] for i in range(SAMPLES)])  # [n, 3]
    for (a, b), joint in zip(((0, 1), (1, 2)), joints):
        counts = torch.zeros(VOCAB, VOCAB, dtype=torch.float64)
        counts.index_put_((outs[:, a], outs[:, b]), torch.ones(SAMPLES, dtype=torch.float64),
                          accumulate=True)
        stat, cells = chi_square(counts, joint, SAMPLES)
        assert stat < chi2_critical(cells), f"tokens {a + 1},{b + 1}: chi-square {stat:.1f} " \
                                            f"over {cells} cells"
    h.sched.check_no_leak()
