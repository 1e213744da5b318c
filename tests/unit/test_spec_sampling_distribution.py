"""End to end through scheduler + speculative worker on a tiny-vocabulary model: sampled output
follows the target distribution (temperature, top-k, top-p applied) with a deterministic drafter
and with a probabilistic (i.i.d.-sampling) drafter."""

from __future__ import annotations

import random

import pytest
import torch

from runtime.model_runner.forward_batch import ForwardBatch, ForwardMode
from runtime.model_runner.model_runner import ModelRunner, RunnerConfig
from runtime.model_runner.runner_process import RunnerWorker
from runtime.sampling.sampler import SamplingBatchInfo, process_logits
from runtime.sampling.sampling_params import SamplingParams
from speculative.base import Drafter, SpecConfig, SpecReq
from speculative.tree import DraftTree
from speculative.verify import QMode
from speculative.worker import SpeculativeWorker
from tests.helpers.tiny_models import write_tiny_model
from tests.unit.test_scheduler import Harness

VOCAB = 12
PROMPT = [3, 7, 1, 9]
PARAMS = {"temperature": 1.3, "top_k": 6, "top_p": 0.95}


@pytest.fixture(scope="module")
def tiny_vocab(tmp_path_factory):
    d = write_tiny_model(tmp_path_factory.mktemp("tv") / "m", "llama", seed=11,
                         vocab_size=VOCAB, bos_token_id=0, eos_token_id=0)
    runner = ModelRunner(RunnerConfig(str(d), "cpu", "float32", max_total_tokens=60000))
    return d, runner


def target_joint(runner) -> torch.Tensor:
    """Exact p(t1, t2 | prompt) [V, V] under the processed sampling distribution."""
    params = SamplingParams(**PARAMS)

    def dist(ids):
        slots = torch.arange(1, len(ids) + 1)
        logits = runner.forward(ForwardBatch.build(ForwardMode.EXTEND, [ids], [slots], [0])).logits
        return process_logits(logits, SamplingBatchInfo.from_params([params], VOCAB))[0].double()

    p1 = dist(PROMPT)
    return torch.stack([p1[a] * dist(PROMPT + [a]) for a in range(VOCAB)])


class RandomTreeDrafter(Drafter):
    """Deterministic-style drafter: random tokens, one-hot q (ONE_HOT mode)."""

    q_mode = QMode.ONE_HOT

    def __init__(self, cfg, runner):
        super().__init__(cfg, runner)
        self.rng = random.Random(0)

    def propose(self, reqs: list[SpecReq]) -> list[DraftTree]:
        out = []
        for r in reqs:
            n = r.budget
            parents = [-1] + [self.rng.randrange(0, i) for i in range(1, n)]
            tokens = [r.tokens[-1]] + [self.rng.randrange(VOCAB) for _ in range(1, n)]
            out.append(DraftTree.from_parents(tokens, parents))
        return out


class IIDDrafter(Drafter):
    """Probabilistic drafter: siblings drawn i.i.d. from a fixed q (IID mode, q is used)."""

    q_mode = QMode.IID

    def __init__(self, cfg, runner):
        super().__init__(cfg, runner)
        self.gen = torch.Generator().manual_seed(1)
        q = torch.rand(VOCAB, generator=self.gen) ** 2
        self.q = q / q.sum()

    def propose(self, reqs: list[SpecReq]) -> list[DraftTree]:
        out = []
        for r in reqs:
            # root with 2 i.i.d. children, the first child with 2 i.i.d. children of its own
            toks = torch.multinomial(self.q, 4, replacement=True, generator=self.gen).tolist()
            tokens = [r.tokens[-1], toks[0], toks[1], toks[2], toks[3]]
            parents = [-1, 0, 0, 1, 1]
            probs = self.q.expand(5, VOCAB).clone()
            out.append(DraftTree.from_parents(tokens, parents, draft_probs=probs))
        return out


def chi_square(counts: torch.Tensor, probs: torch.Tensor, n: int) -> tuple[float, int]:
    expected = probs.flatten() * n
    keep = expected >= 5
    stat = float((((counts.flatten()[keep] - expected[keep]) ** 2) / expected[keep]).sum())
    # lumped tail cell
    rest_e, rest_o = float(expected[~keep].sum()), float(counts.flatten()[~keep].sum())
    if rest_e > 0:
        stat += (rest_o - rest_e) ** 2 / max(rest_e, 1e-9)
    return stat, int(keep.sum())


@pytest.mark.parametrize("drafter_cls,budget", [(RandomTreeDrafter, 5), (IIDDrafter, 5)])
def test_speculative_sampling_matches_target_distribution(tiny_vocab, drafter_cls, budget):
    model_dir, runner = tiny_vocab
    joint = target_joint(runner)
    n = 3000
    h = Harness(tiny_vocab, capacity=60000, num_draft_tokens=budget, max_running_requests=512,
                chunked_prefill_size=4096)
    cfg = SpecConfig("TEST", budget, adaptive=False)
    h.worker = RunnerWorker(runner, SpeculativeWorker(cfg, drafter_cls(cfg, runner), runner))
    h.sched.run_batch = h.worker.run
    h.sched.stop.eos = set()
    for i in range(n):
        h.submit(f"s{i}", PROMPT, max_new_tokens=2, seed=i, **PARAMS)
    h.run()
    counts = torch.zeros(VOCAB, VOCAB, dtype=torch.float64)
    for i in range(n):
        a, b = h.outputs[f"s{i}"][:2]
        counts[a, b] += 1
    assert h.sched.info()["spec_decode_num_accepted_tokens"] > 0, "some drafts must be accepted"
    stat, cells = chi_square(counts, joint, n)
    # chi-square critical value at p = 0.001 for up to ~36 dof is < 68; a biased verifier that
    # e.g. ignores the residual lands in the hundreds here
    assert stat < 70, f"chi-square {stat:.1f} over {cells} cells"
    h.sched.check_no_leak()
