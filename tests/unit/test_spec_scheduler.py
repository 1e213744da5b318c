"""Speculative steps inside continuous batching, with drafters that are right, wrong or mixed:
greedy output must equal plain decoding token for token and no KV may leak."""

from __future__ import annotations

import random

import pytest
import torch

from specserve.runtime.model_runner.runner_process import RunnerWorker
from specserve.speculative.base import Drafter, RunnerReq, SpecConfig
from specserve.speculative.tree import DraftTree
from specserve.speculative.worker import SpeculativeWorker
from tests.unit.test_scheduler import Harness, prompts, reference, tiny  # noqa: F401


class OracleMixDrafter(Drafter):
    """Random trees whose first branch follows the known greedy continuation for a while."""

    def __init__(self, cfg, runner, truth: dict[tuple, list[int]], seed: int) -> None:
        super().__init__(cfg, runner)
        self.truth = truth
        self.rng = random.Random(seed)

    def propose(self, reqs: list[RunnerReq]) -> list[DraftTree]:
        trees = []
        for r in reqs:
            n = self.rng.randint(1, r.budget)
            tokens, parents = [r.tokens[-1]], [-1]
            cont = self._continuation(r.tokens)
            good = self.rng.randint(0, n - 1)
            for i in range(1, n):
                if i <= good and cont is not None and i - 1 < len(cont):
                    tokens.append(cont[i - 1])
                    parents.append(i - 1)  # a chain of correct tokens
                else:
                    tokens.append(self.rng.randrange(3, 300))
                    parents.append(self.rng.randrange(0, i))
            trees.append(DraftTree.from_parents(tokens, parents))
        return trees

    def _continuation(self, history: list[int]) -> list[int] | None:
        for prompt, out in self.truth.items():
            full = list(prompt) + out
            if history == full[: len(history)] and len(history) >= len(prompt):
                return full[len(history) :]
        return None


def spec_harness(tiny, drafter_factory, num_draft_tokens=6, **cfg):  # noqa: F811
    h = Harness(tiny, num_draft_tokens=num_draft_tokens, **cfg)
    runner = tiny[1]
    spec_cfg = SpecConfig("TEST", num_draft_tokens, disable_adaptive=True)
    h.worker = RunnerWorker(runner, SpeculativeWorker(spec_cfg, drafter_factory(spec_cfg, runner),
                                                      runner))
    h.sched.run_batch = h.worker.run
    return h


@pytest.mark.parametrize("seed", [0, 1])
def test_greedy_spec_output_equals_plain_decoding_under_batching(tiny, seed):  # noqa: F811
    ps = prompts(8, seed=10 + seed)
    ref = reference(tiny, ps, ignore_eos=True, max_new_tokens=24)
    truth = {tuple(p): r for p, r in zip(ps, ref)}
    h = spec_harness(tiny, lambda c, r: OracleMixDrafter(c, r, truth, seed),
                     max_running_requests=5, chunked_prefill_size=32)
    for i, p in enumerate(ps):
        h.submit(f"r{i}", p, ignore_eos=True, max_new_tokens=24)
    h.run()
    assert [h.outputs[f"r{i}"] for i in range(8)] == ref
    info = h.sched.info()
    assert info["spec_decode_num_accepted_tokens"] > 0, "oracle drafts must be accepted"
    assert info["avg_spec_accept_length"] > 1.0
    meta = h.meta["r0"]
    assert meta["spec_verify_ct"] < 24 and meta["spec_accept_length"] > 1.0
    h.sched.check_no_leak()


def test_spec_with_stop_inside_accepted_tokens_and_retraction(tiny):  # noqa: F811
    ps = prompts(6, seed=3)
    ref = reference(tiny, ps, ignore_eos=True, max_new_tokens=30)
    truth = {tuple(p): r for p, r in zip(ps, ref)}
    h = spec_harness(tiny, lambda c, r: OracleMixDrafter(c, r, truth, 5), capacity=130,
                     decode_reserve_ratio=0.0)
    for i, p in enumerate(ps):
        stop_ids = [ref[i][7]] if i % 2 == 0 else []
        h.submit(f"r{i}", p, ignore_eos=True, max_new_tokens=30, stop_token_ids=stop_ids)
    h.run()
    for i in range(6):
        expect = ref[i][: ref[i].index(ref[i][7]) + 1] if i % 2 == 0 else ref[i]
        assert h.outputs[f"r{i}"] == expect
    assert h.sched.totals["retracted"] > 0
    h.sched.check_no_leak()


def test_sampled_spec_runs_and_frees_kv(tiny):  # noqa: F811
    ps = prompts(4, seed=4)
    truth = {tuple(p): [] for p in ps}
    h = spec_harness(tiny, lambda c, r: OracleMixDrafter(c, r, truth, 9))
    for i, p in enumerate(ps):
        h.submit(f"r{i}", p, ignore_eos=True, max_new_tokens=20, temperature=0.8, top_p=0.9,
                 seed=i)
    h.run()
    assert all(len(h.outputs[f"r{i}"]) == 20 for i in range(4))
    h.sched.check_no_leak()
    torch.manual_seed(0)


class ChainOracleDrafter(OracleMixDrafter):
    """The known continuation as a chain of the whole budget, or of at most `max_drafts` nodes
    (a drafter sizing its own trees, like NGRAM by match length: the slots it leaves must go
    back to the pool); records every budget it got."""

    def __init__(self, cfg, runner, truth, max_drafts: int | None = None) -> None:
        super().__init__(cfg, runner, truth, seed=0)
        self.budgets: dict[str, list[int]] = {}
        self.max_drafts = max_drafts

    def propose(self, reqs: list[RunnerReq]) -> list[DraftTree]:
        trees = []
        for r in reqs:
            self.budgets.setdefault(r.rid, []).append(r.budget)
            cont = self._continuation(r.tokens) or []
            n = r.budget - 1 if self.max_drafts is None else min(r.budget - 1, self.max_drafts)
            trees.append(DraftTree.chain(r.tokens[-1], cont[:n]))
        return trees


def chain_oracle_harness(tiny, ps, max_new_tokens, max_drafts=None, **cfg):  # noqa: F811
    """(harness, reference outputs, the drafters made) for prompts `ps`, 4-node base trees."""
    ref = reference(tiny, ps, ignore_eos=True, max_new_tokens=max_new_tokens)
    truth = {tuple(p): r for p, r in zip(ps, ref)}
    drafters = []

    def make(c, r):
        drafters.append(ChainOracleDrafter(c, r, truth, max_drafts))
        return drafters[-1]

    return spec_harness(tiny, make, num_draft_tokens=4, **cfg), ref, drafters


@pytest.mark.parametrize("concurrent", [False, True])
def test_deep_drafts_after_a_fully_accepted_draft_only_while_the_step_fits(
        tiny, concurrent):  # noqa: F811
    ps = prompts(2, seed=21)
    h, ref, drafters = chain_oracle_harness(tiny, ps, 40, max_draft_tokens=10)
    if concurrent:  # two copying requests: 4 + 10 > 10, the step would leave the flat cost
        for i, p in enumerate(ps):
            h.submit(f"r{i}", p, ignore_eos=True, max_new_tokens=40)
        h.run()
    else:
        for i, p in enumerate(ps):
            h.submit(f"r{i}", p, ignore_eos=True, max_new_tokens=40)
            h.run()
    assert [h.outputs[f"r{i}"] for i in range(2)] == ref
    budgets = drafters[0].budgets
    for i in range(2):
        b = budgets[f"r{i}"]
        assert b[0] == 4  # the first step has no history
        if concurrent:
            assert set(b) == {4}
        else:  # every draft is accepted whole, so every later step drafts deep
            assert set(b[1:]) <= {10} and len(b) <= 1 + 36 // 10 + 1
    h.sched.check_no_leak()


@pytest.mark.parametrize("concurrent", [False, True])
def test_deep_for_all_grants_deep_budgets_from_the_first_step_at_batch_one(
        tiny, concurrent):  # noqa: F811
    ps = prompts(2, seed=22)
    h, ref, drafters = chain_oracle_harness(tiny, ps, 30, max_drafts=2, max_draft_tokens=10,
                                            deep_for_all=True)
    for i, p in enumerate(ps):
        h.submit(f"r{i}", p, ignore_eos=True, max_new_tokens=30)
        if not concurrent:
            h.run()
    h.run()
    assert [h.outputs[f"r{i}"] for i in range(2)] == ref
    budgets = drafters[0].budgets
    if concurrent:  # both decode in the first step: 4 + 10 > 10, nobody gets deep
        assert budgets["r0"][0] == budgets["r1"][0] == 4
    else:  # alone, every step may draft deep, the first included
        assert all(set(budgets[f"r{i}"]) == {10} for i in range(2))
    h.sched.check_no_leak()


class BatchRecordingOracle(ChainOracleDrafter):
    """Records each step's budgets as one list (one per decoding request)."""

    def __init__(self, *args, **kw) -> None:
        super().__init__(*args, **kw)
        self.steps: list[list[int]] = []

    def propose(self, reqs: list[RunnerReq]) -> list[DraftTree]:
        self.steps.append([r.budget for r in reqs])
        return super().propose(reqs)


def test_load_aware_budget_drafts_alone_and_not_when_the_batch_is_compute_bound(
        tiny):  # noqa: F811
    ps = prompts(9, seed=23)
    ref = reference(tiny, ps, ignore_eos=True, max_new_tokens=24)
    truth = {tuple(p): r for p, r in zip(ps, ref)}
    drafters = []

    def make(c, r):
        drafters.append(BatchRecordingOracle(c, r, truth))
        return drafters[-1]

    h = spec_harness(tiny, make, num_draft_tokens=4, load_aware=True)
    h.sched.spec.learn_cost = False  # (the plan on the CPU engine's curve, not the tiny model's)
    h.submit("alone", ps[0], ignore_eos=True, max_new_tokens=24)
    h.run()
    alone = drafters[0].steps
    assert all(len(s) == 1 for s in alone) and max(s[0] for s in alone) == 4
    assert h.meta["alone"]["spec_verify_ct"] < 24 // 2  # the oracle's drafts paid off
    drafters[0].steps = []
    h.sched.spec.reset()  # new traffic: a fresh request starts from an even estimate
    for i, p in enumerate(ps[1:], start=1):
        h.submit(f"r{i}", p, ignore_eos=True, max_new_tokens=24)
    h.run()
    assert [h.outputs["alone"]] + [h.outputs[f"r{i}"] for i in range(1, 9)] == ref
    busy = [s for s in drafters[0].steps if len(s) >= 8]
    assert busy, "eight requests were meant to decode together"
    # a batch of 8 is compute-bound on the CPU engine's curve: plain decoding, even though
    # these requests would accept everything (the estimates have not learned that yet; the
    # first busy step may still draft for the request that decoded a step alone and saw its
    # draft accepted)
    assert all(set(s) == {1} for s in busy[1:]), busy
    h.sched.check_no_leak()


def serve_with(h, runner, worker: SpeculativeWorker, ps: list[list[int]], new: int) -> list:
    """Serve prompts `ps` (greedy, `new` tokens each) through harness h with this worker;
    their outputs in order."""
    h.worker = RunnerWorker(runner, worker)
    h.sched.run_batch = h.worker.run
    for i, p in enumerate(ps):
        h.submit(f"r{i}", p, ignore_eos=True, max_new_tokens=new)
    h.run()
    return [h.outputs[f"r{i}"] for i in range(len(ps))]


class OffRecordingOracle(OracleMixDrafter):
    """An oracle drafter that keeps KV of its own (so only the controller's `idle` lets a
    step skip it); records what it saw."""

    mirrors_kv = True

    def __init__(self, *a, **kw) -> None:
        super().__init__(*a, **kw)
        self.proposed_steps = 0
        self.skipped_rows = 0

    def propose(self, reqs):
        self.proposed_steps += 1
        return super().propose(reqs)

    def skipped(self, rids):
        self.skipped_rows += len(rids)


@pytest.mark.parametrize("mirrors", [True, False])
def test_a_drafter_that_does_not_pay_is_skipped_between_server_wide_probes(tiny, mirrors):  # noqa: F811
    """While drafting does not pay on the traffic, steps with no draft and no probe due within
    WARM_STEPS run as plain decoding without the drafter (it hears of them through `skipped`);
    the steps before each server-wide probe, and the probes, run the full path for a drafter
    that reads committed rows. A drafter that reads none skips every step without a draft.
    Greedy output is plain decoding's either way, and no KV leaks."""
    from specserve.speculative import controller

    ps = prompts(6, seed=21)
    ref = reference(tiny, ps, ignore_eos=True, max_new_tokens=40)
    truth = {tuple(p): r for p, r in zip(ps, ref)}
    h = Harness(tiny, num_draft_tokens=4, max_running_requests=3, chunked_prefill_size=32,
                load_aware=True)
    h.sched.spec.prior = [0.0, 1e9]  # the drafter does not pay on this traffic ...
    h.sched.spec.global_interval = 64  # (as after a few probes that did not pay)
    h.sched.spec.learn_cost = False  # (a cost learned lower would bring the probes back)
    runner = tiny[1]
    cfg = SpecConfig("TEST", 4)
    drafter = OffRecordingOracle(cfg, runner, truth, 3)
    drafter.mirrors_kv = mirrors
    worker = SpeculativeWorker(cfg, drafter, runner)
    with pytest.MonkeyPatch.context() as m:  # ... and stays so, whatever the probes accept
        m.setattr(controller, "PRIOR_DECAY", 1.0)
        assert serve_with(h, runner, worker, ps, 40) == ref
    assert drafter.skipped_rows > 0
    if mirrors:
        # only the WARM_STEPS steps before each server-wide probe (and the probe) proposed
        assert drafter.proposed_steps <= (controller.WARM_STEPS + 1) * 3, drafter.proposed_steps
        assert drafter.proposed_steps > 0  # the server-wide probes still run
    else:
        assert drafter.proposed_steps <= 3  # the probes only
    h.sched.check_no_leak()


@pytest.mark.parametrize("algorithm", ["NGRAM", "LOOKAHEAD"])
def test_steps_without_draft_slots_are_plain_for_model_free_drafters(tiny, monkeypatch,  # noqa: F811
                                                                     algorithm):
    """NGRAM and LOOKAHEAD read no committed rows: a step in which the controller gave no
    request draft slots is a plain decode step (no propose), whatever the traffic, and NGRAM's
    trie counts nothing for requests that never drafted; with slots they draft (and the trie
    counts). Greedy output is plain decoding's both ways, and no KV leaks."""
    from specserve.speculative import controller
    from specserve.speculative.registry import ALGORITHMS

    class Counting(ALGORITHMS[algorithm]):
        proposed = 0

        def propose(self, reqs):
            self.proposed += 1
            return super().propose(reqs)

    ps = prompts(4, seed=33)
    ref = reference(tiny, ps, ignore_eos=True, max_new_tokens=24)
    runner = tiny[1]
    for slots in (False, True):
        with monkeypatch.context() as m:
            if not slots:  # a plan that never drafts and never probes
                m.setattr(controller, "plan_drafts", lambda rates, caps, cost, d: [1] * len(caps))
                m.setattr(controller, "PROBE_EVERY", 10_000)
            h = Harness(tiny, num_draft_tokens=4, max_running_requests=4,
                        chunked_prefill_size=32, load_aware=slots is False)
            cfg = SpecConfig(algorithm, 4)
            drafter = Counting(cfg, runner)
            worker = SpeculativeWorker(cfg, drafter, runner)
            assert serve_with(h, runner, worker, ps, 24) == ref
            assert bool(drafter.proposed) == slots
            if algorithm == "NGRAM":
                assert (drafter.cache.num_nodes > 0) == slots
                assert len(drafter.reqs) <= 1  # (the last release rides the next batch)
            h.sched.check_no_leak()


# ---- negative controls: each check above fails when its bug is put in ------------------------
def test_the_equality_check_catches_a_verifier_that_accepts_a_wrong_draft(tiny, monkeypatch):  # noqa: F811
    """The greedy equality the lossless tests assert is not vacuous: a verifier that accepts a
    tree's first child whatever the target says produces other tokens, and the comparison
    with plain decoding sees it."""
    import specserve.speculative.worker as worker_mod
    from specserve.speculative.verify import VerifyResult, greedy_walk

    def accepts_the_first_child(tree, argmax):
        if tree.num_nodes == 1 or tree.token_list[1] == argmax[0]:
            return greedy_walk(tree, argmax)
        return VerifyResult([0, 1], [tree.token_list[1]], argmax[1])

    monkeypatch.setattr(worker_mod, "greedy_walk", accepts_the_first_child)
    ps = prompts(6, seed=10)
    ref = reference(tiny, ps, ignore_eos=True, max_new_tokens=24)
    truth = {tuple(p): r for p, r in zip(ps, ref)}
    h = spec_harness(tiny, lambda c, r: OracleMixDrafter(c, r, truth, 0),
                     max_running_requests=3)
    for i, p in enumerate(ps):
        h.submit(f"r{i}", p, ignore_eos=True, max_new_tokens=24)
    h.run()
    assert [h.outputs[f"r{i}"] for i in range(6)] != ref


def test_the_leak_check_catches_slots_a_step_forgot_to_free(tiny, monkeypatch):  # noqa: F811
    """`check_no_leak` (asserted after every speculative test) fails when the scheduler keeps
    a rejected draft's slot instead of freeing it."""
    from specserve.runtime.mem_cache.allocator import TokenSlotAllocator

    real_free = TokenSlotAllocator.free
    lost = []

    def free_all_but_one(self, slots):
        if slots.numel() > 1 and not lost:
            lost.append(int(slots[0]))
            slots = slots[1:]
        return real_free(self, slots)

    monkeypatch.setattr(TokenSlotAllocator, "free", free_all_but_one)
    ps = prompts(3, seed=12)
    truth = {tuple(p): [] for p in ps}
    h = spec_harness(tiny, lambda c, r: OracleMixDrafter(c, r, truth, 1))
    for i, p in enumerate(ps):
        h.submit(f"r{i}", p, ignore_eos=True, max_new_tokens=12)
    h.run()
    assert lost
    with pytest.raises(AssertionError, match="KV leak"):
        h.sched.check_no_leak()
