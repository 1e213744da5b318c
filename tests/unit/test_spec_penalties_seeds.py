"""Speculation leaves every request's output exactly as plain decoding gives it, on a 12-token
tiny target in-process (exact, no near-tie excuse): requests with repetition / frequency /
presence penalties (which draft too) and seeded sampled requests (whose tokens are keyed by
(seed, position)), for every algorithm, at batch 1 and 8, and through retractions."""

from __future__ import annotations

import random

import pytest
import torch

from specserve.runtime.model_runner.local_generator import LocalGenerator
from specserve.runtime.model_runner.runner_process import RunnerWorker
from specserve.runtime.sampling.sampling_params import SamplingParams
from specserve.speculative.base import SpecConfig, create_drafter
from specserve.speculative.tree import DraftTree
from specserve.speculative.worker import SpeculativeWorker
from tests.helpers.eagle_checkpoints import write_eagle1_checkpoint, write_eagle3_checkpoint
from tests.unit.test_scheduler import Harness
from tests.unit.test_spec_sampling_distribution import VOCAB, tiny_vocab  # noqa: F401
from tests.unit.test_spec_scheduler import OracleMixDrafter


class SmallVocabOracle(OracleMixDrafter):
    """OracleMixDrafter over the 12-token vocabulary: a random-length chain of the known
    continuation from the root, plus random siblings and subtrees elsewhere."""

    def propose(self, reqs):
        trees = []
        for r in reqs:
            n = self.rng.randint(1, r.budget)
            tokens, parents = [r.tokens[-1]], [-1]
            cont = self._continuation(r.tokens) or []
            good = self.rng.randint(0, n - 1)
            for i in range(1, n):
                if i <= good and i - 1 < len(cont):
                    tokens.append(cont[i - 1])
                    parents.append(i - 1)
                else:
                    tokens.append(self.rng.randrange(1, VOCAB))
                    parents.append(self.rng.randrange(0, i))
            trees.append(DraftTree.from_parents(tokens, parents))
        return trees

NEW_TOKENS = 24
PARAMS = {
    "greedy_repetition": {"temperature": 0.0, "repetition_penalty": 1.5},
    "greedy_frequency": {"temperature": 0.0, "frequency_penalty": 0.7},
    "greedy_presence": {"temperature": 0.0, "presence_penalty": 0.9},
    "seeded": {"temperature": 0.7, "top_p": 0.9},
    "seeded_repetition": {"temperature": 0.7, "top_p": 0.9, "repetition_penalty": 1.3},
    "seeded_frequency_presence": {"temperature": 0.9, "frequency_penalty": 0.5,
                                  "presence_penalty": 0.4, "top_k": 8},
}
ALGOS = ("ORACLE", "NGRAM", "SUFFIX", "LOOKAHEAD", "EAGLE", "EAGLE3")


def copy_heavy(n: int, seed: int) -> list[list[int]]:
    """Prompts that repeat phrases, so n-gram drafts exist and get accepted sometimes."""
    rng = random.Random(seed)
    out = []
    for _ in range(n):
        phrase = [rng.randrange(1, VOCAB) for _ in range(rng.randrange(3, 7))]
        body = []
        for _ in range(rng.randrange(2, 5)):
            body += phrase + [rng.randrange(1, VOCAB) for _ in range(rng.randrange(0, 3))]
        out.append(body)
    return out


@pytest.fixture(scope="module")
def heads(tiny_vocab, tmp_path_factory):  # noqa: F811
    root = tmp_path_factory.mktemp("pen_heads")
    return {"EAGLE": write_eagle1_checkpoint(root / "e1", tiny_vocab[0], seed=5),
            "EAGLE3": write_eagle3_checkpoint(root / "e3", tiny_vocab[0], seed=6,
                                              draft_vocab_size=8, aux_layer_ids=[0, 0, 1])}


def plain(runner, ps: list[list[int]], params: dict, seeds: bool) -> list[list[int]]:
    gen = LocalGenerator(runner)
    sp = [SamplingParams(max_new_tokens=NEW_TOKENS, ignore_eos=True, **params,
                         **({"seed": 1000 + i} if seeds else {})) for i in range(len(ps))]
    return [r.output_ids for r in gen.generate(ps, sp)]


def spec_run(tiny_vocab, heads, algo, ps, params, seeds, ref,  # noqa: F811
             priorities=None, late=(), **cfg):
    """(outputs, scheduler info, drafter) of `ps` through the scheduler with speculation;
    the requests numbered in `late` arrive after 4 steps, `priorities` one per request."""
    runner = tiny_vocab[1]
    n = 6
    if algo == "ORACLE":
        spec = SpecConfig("TEST", n, disable_adaptive=True)
        truth = {tuple(p): r for p, r in zip(ps, ref)}
        drafter = SmallVocabOracle(spec, runner, truth, seed=3)
    elif algo in ("NGRAM", "SUFFIX", "LOOKAHEAD"):
        spec = SpecConfig(algo, n, disable_adaptive=True)
        drafter = create_drafter(spec, runner)
    else:
        spec = SpecConfig(algo, n, draft_model_path=str(heads[algo]), num_steps=2, eagle_topk=3,
                          disable_adaptive=True)
        drafter = create_drafter(spec, runner)
    h = Harness(tiny_vocab, num_draft_tokens=n, **cfg)
    h.worker = RunnerWorker(runner, SpeculativeWorker(spec, drafter, runner))
    h.sched.run_batch = h.worker.run

    def submit(i):
        h.submit(f"r{i}", ps[i], ignore_eos=True, max_new_tokens=NEW_TOKENS, **params,
                 priority=0 if priorities is None else priorities[i],
                 **({"seed": 1000 + i} if seeds else {}))

    for i in range(len(ps)):
        if i not in late:
            submit(i)
    if late:
        for _ in range(4):
            h.sched.step()
        for i in late:
            submit(i)
    h.run()
    h.sched.check_no_leak()
    return [h.outputs[f"r{i}"] for i in range(len(ps))], h.sched.info(), drafter


@pytest.mark.parametrize("algo", ALGOS)
@pytest.mark.parametrize("kind", list(PARAMS))
def test_spec_output_equals_plain_decoding(tiny_vocab, heads, algo, kind):  # noqa: F811
    params = PARAMS[kind]
    seeds = kind.startswith("seeded")
    ps = copy_heavy(8, seed=len(kind))
    ref = plain(tiny_vocab[1], ps, params, seeds)
    out, info, _ = spec_run(tiny_vocab, heads, algo, ps, params, seeds, ref,
                            max_running_requests=8)
    assert out == ref
    # penalised requests draft, and drafts get accepted
    assert info["spec_decode_num_draft_tokens"] > 0
    assert info["spec_decode_num_accepted_tokens"] > 0, info


@pytest.mark.parametrize("algo", ["NGRAM", "EAGLE3"])
def test_seeded_spec_output_is_the_same_at_batch_one(tiny_vocab, heads, algo):  # noqa: F811
    params = PARAMS["seeded_repetition"]
    ps = copy_heavy(6, seed=40)
    ref = plain(tiny_vocab[1], ps, params, True)
    out, _, _ = spec_run(tiny_vocab, heads, algo, ps, params, True, ref, max_running_requests=1)
    assert out == ref


@pytest.mark.parametrize("algo", ["NGRAM", "EAGLE"])
@pytest.mark.parametrize("kind", ["greedy_repetition", "seeded", "seeded_frequency_presence"])
def test_retraction_under_speculation_keeps_outputs(tiny_vocab, heads, algo, kind):  # noqa: F811
    params = PARAMS[kind]
    seeds = kind.startswith("seeded")
    ps = copy_heavy(6, seed=7)
    ref = plain(tiny_vocab[1], ps, params, seeds)
    out, info, _ = spec_run(tiny_vocab, heads, algo, ps, params, seeds, ref, capacity=150,
                            decode_reserve_ratio=0.0)
    assert info["retracted"] > 0, "capacity was meant to force retractions"
    assert info["spec_decode_num_accepted_tokens"] > 0
    assert out == ref


@pytest.mark.parametrize("algo", ["NGRAM", "EAGLE3"])
@pytest.mark.parametrize("kind", ["greedy_repetition", "seeded"])
def test_priority_preemption_under_speculation_keeps_outputs(tiny_vocab, heads, algo,  # noqa: F811
                                                             kind):
    """Three urgent requests arrive while four less urgent ones hold every seat: three are
    preempted mid-speculation (their trees' slots freed), resume later, and every output is
    still plain decoding's."""
    params = PARAMS[kind]
    seeds = kind.startswith("seeded")
    ps = copy_heavy(7, seed=21)
    ref = plain(tiny_vocab[1], ps, params, seeds)
    out, info, _ = spec_run(tiny_vocab, heads, algo, ps, params, seeds, ref,
                            priorities=[0, 0, 0, 0, 50, 50, 50], late=(4, 5, 6),
                            max_running_requests=4, enable_priority_scheduling=True)
    assert info["preempted"] == 3 and info["retracted"] == 3
    assert info["spec_decode_num_accepted_tokens"] > 0
    assert out == ref


def test_negative_control_penalties_dropped_in_verification_are_caught(
        tiny_vocab, heads, monkeypatch):  # noqa: F811
    """Verification that drops the penalties fails the test above."""
    monkeypatch.setattr("specserve.speculative.worker.SpeculativeWorker._penalise",
                        staticmethod(lambda entries, trees, logits, starts: logits))
    params = PARAMS["greedy_repetition"]
    ps = copy_heavy(8, seed=len("greedy_repetition"))
    ref = plain(tiny_vocab[1], ps, params, False)
    out, _, _ = spec_run(tiny_vocab, heads, "NGRAM", ps, params, False, ref,
                         max_running_requests=8)
    assert out != ref


def test_unseeded_sampled_requests_still_draw_fresh_randomness(tiny_vocab, heads):  # noqa: F811
    params = PARAMS["seeded"]
    ps = [copy_heavy(1, seed=9)[0]] * 6
    torch.manual_seed(0)
    out, _, _ = spec_run(tiny_vocab, heads, "NGRAM", ps, params, False, [[]] * 6)
    assert len({tuple(o) for o in out}) > 1, "the same prompt six times, unseeded"


@pytest.mark.parametrize("kind", ["greedy", *PARAMS])
def test_plain_steps_of_a_drafter_that_is_off_equal_plain_decoding(tiny_vocab, heads, kind):  # noqa: F811
    """While a drafter (EAGLE-3) does not pay on the traffic, the worker decodes plain steps
    without it between server-wide probes (`_plain_step`): a batch of greedy requests without
    penalties takes the target's argmax, any other batch goes through verification of
    one-node trees (penalties, seeded draws). Either way: plain decoding's output."""
    params = {"temperature": 0.0} if kind == "greedy" else PARAMS[kind]
    seeds = kind.startswith("seeded")
    ps = copy_heavy(6, seed=11)
    runner = tiny_vocab[1]
    ref = plain(runner, ps, params, seeds)
    spec = SpecConfig("EAGLE3", 6, draft_model_path=str(heads["EAGLE3"]), num_steps=2,
                      eagle_topk=3)
    drafter = create_drafter(spec, runner)
    assert drafter.wants_committed_rows
    worker = SpeculativeWorker(spec, drafter, runner)
    skipped = []
    drafter.skipped = lambda rids, inner=drafter.skipped: (skipped.append(len(rids)),
                                                          inner(rids))
    h = Harness(tiny_vocab, num_draft_tokens=6, max_running_requests=6, load_aware=True)
    h.traffic_off()  # the drafter does not pay on this traffic: server-wide probes only
    h.worker = RunnerWorker(runner, worker)
    h.sched.run_batch = h.worker.run
    for i, p in enumerate(ps):
        h.submit(f"r{i}", p, ignore_eos=True, max_new_tokens=NEW_TOKENS, **params,
                 **({"seed": 1000 + i} if seeds else {}))
    h.run()
    h.sched.check_no_leak()
    assert [h.outputs[f"r{i}"] for i in range(len(ps))] == ref
    assert sum(skipped) > 6 * NEW_TOKENS // 2, skipped  # most tokens came from plain steps
