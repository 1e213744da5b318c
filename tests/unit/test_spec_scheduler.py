"""Speculative steps inside continuous batching, with drafters that are right, wrong or mixed:
greedy output must equal plain decoding token for token and no KV may leak."""

from __future__ import annotations

import random

import pytest
import torch

from runtime.model_runner.runner_process import RunnerWorker
from speculative.base import Drafter, SpecConfig, SpecReq
from speculative.tree import DraftTree
from speculative.worker import SpeculativeWorker
from tests.unit.test_scheduler import Harness, prompts, reference, tiny  # noqa: F401


class OracleMixDrafter(Drafter):
    """Random trees whose first branch follows the known greedy continuation for a while."""

    def __init__(self, cfg, runner, truth: dict[tuple, list[int]], seed: int) -> None:
        super().__init__(cfg, runner)
        self.truth = truth
        self.rng = random.Random(seed)

    def propose(self, reqs: list[SpecReq]) -> list[DraftTree]:
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

    def propose(self, reqs: list[SpecReq]) -> list[DraftTree]:
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


def test_draft_sizes_grants_deep_only_to_a_request_decoding_alone():
    from runtime.scheduler.scheduler import draft_sizes

    assert draft_sizes([0], 8, 16) == [8]  # nothing accepted: no deep draft by default
    assert draft_sizes([7], 8, 16) == [16]
    assert draft_sizes([0], 8, 16, deep_for_all=True) == [16]
    assert draft_sizes([0, 0], 8, 16, deep_for_all=True) == [8, 8]  # 8 + 16 > 16
    assert draft_sizes([7, 7], 8, 16) == [8, 8]
    assert draft_sizes([5], 8, 8, deep_for_all=True) == [8]  # deep drafts off


@pytest.mark.parametrize("judges", [False, True])
def test_backoff_leaves_confident_drafts_to_drafters_that_judge_them(judges):
    from types import SimpleNamespace

    from runtime.sampling.sampling_params import SamplingParams
    from speculative.worker import SpecEntry

    class Judging(Drafter):
        drafts_when_backed_off = judges

        def propose(self, reqs):
            return [DraftTree.chain(r.tokens[-1], []) for r in reqs]

    cfg = SpecConfig("TEST", 8)
    w = SpeculativeWorker(cfg, Judging(cfg, None), None)
    state = SimpleNamespace(params=SamplingParams(temperature=0.0))
    entry = SpecEntry("r", [1, 2, 3], 2, torch.arange(10), state)
    assert w._budget(entry) == (8, False)  # optimistic start
    for _ in range(30):  # drafts keep failing: the request backs off
        w._adapt("r", 7, 0)
    w.prior_accept = 1.0  # (other requests' drafts pay: this one probes on its own)
    got = [w._budget(entry) for _ in range(2 * w.drafter.probe_every)]
    probes = [g for g in got if g == (8, False)]
    assert len(probes) == 2  # a full-tree probe every probe_every steps either way
    rest = {g for g in got if g != (8, False)}
    assert rest == ({(8, True)} if judges else {(1, False)})
    w._adapt("r", 15, 15)  # a confident draft that was accepted lifts the backoff
    w._adapt("r", 15, 15)
    assert w._budget(entry) == (8, False)


def test_backoff_counts_the_measured_draft_cost_and_batch_probes():
    """A drafting request pays its share of the measured drafting time: it keeps drafting only
    while its accepted drafts per step beat B * d / T(B); backed-off requests of a batch of B
    probe every probe_every * B steps."""
    from types import SimpleNamespace

    from runtime.sampling.sampling_params import SamplingParams
    from speculative.worker import SpecEntry, SpecReqState

    class Costly(Drafter):
        min_accept_per_step = 0.2
        probe_every = 4

        def propose(self, reqs):
            return [DraftTree.chain(r.tokens[-1], []) for r in reqs]

    cfg = SpecConfig("TEST", 4)
    w = SpeculativeWorker(cfg, Costly(cfg, None), None)
    assert w.break_even(1) == 0.2  # nothing measured yet: the drafter's floor
    w._measure(1, 1, 0.05)  # no plain step measured yet: nothing to compare with
    assert w.draft_cost is None
    # plain steps: 10 ms at batch 1 and 10 * C(2) ms at batch 2 -> t1 = 10 ms
    for _ in range(30):
        w._measure(1, 0, 0.010)
        w._measure(2, 0, 0.010 * w.verify_cost(2))
    assert w.plain_t1 == pytest.approx(0.010, rel=1e-3)
    for _ in range(30):  # 6 ms more than a plain batch-3 step, 2 drafting requests: 3 ms each
        w._measure(3, 2, 0.010 * w.verify_cost(3) + 0.006)
    assert w.draft_cost == pytest.approx(0.003, rel=1e-3)
    assert w.break_even(1) == pytest.approx(0.3, rel=1e-3)  # 1 * 3 ms / 10 ms
    b4 = 4 * 0.003 / (0.010 * w.verify_cost(4))
    assert w.break_even(4) == pytest.approx(b4, rel=1e-3) and b4 > 0.3
    state = SimpleNamespace(params=SamplingParams(temperature=0.0))
    entry = SpecEntry("r", [1, 2, 3], 2, torch.arange(6), state)
    w.req_states.clear()
    w.prior_accept = 0.5  # between the batch-1 and the batch-4 break-even
    assert w._budget(entry, 1) == (4, False)  # pays alone
    w.prior_accept = 10.0  # the drafter pays in general: this request probes on its own
    got = [w._budget(entry, 4) for _ in range(4 * 4 * 3)]
    assert got.count((4, False)) == 3  # at batch 4: backed off, a probe every 16 steps
    assert set(got) == {(4, False), (1, False)}
    # probes that fail double the interval (4, 8, 16 steps at batch 1); one that pays resets it
    w.req_states.clear()
    w.req_states["r"] = SpecReqState(accept_ema=0.0)
    gaps, since = [], 0
    for _ in range(4 + 8 + 16 + 32):
        since += 1
        if w._budget(entry, 1) == (4, False):
            w._adapt("r", 3, 0)
            gaps.append(since)
            since = 0
    assert gaps == [4, 8, 16, 32], gaps
    got = [w._budget(entry, 1) for _ in range(64)]
    assert got.index((4, False)) == 63  # the next probe after 64 steps
    w._adapt("r", 3, 3)  # it paid
    assert w.req_states["r"].probe_interval == 4


def test_backoff_knows_the_plain_step_from_the_start_up_measurement():
    """With the one-row forward timed at start-up, the first drafting step already measures the
    draft's cost: a drafter that drafts from the first step is held to its real break-even, not
    to its floor until some plain step happens (which, while it drafts, never does)."""
    from runtime.verify_cost import VerifyCost

    class Costly(Drafter):
        min_accept_per_step = 0.2

        def propose(self, reqs):
            return [DraftTree.chain(r.tokens[-1], []) for r in reqs]

    cfg = SpecConfig("TEST", 4)
    curve = VerifyCost((1, 2, 4), (1.0, 1.2, 1.4), "measured", t1_s=0.004)
    w = SpeculativeWorker(cfg, Costly(cfg, None), None, curve)
    assert w.plain_t1 == 0.004
    w._measure(1, 1, 0.010)  # a drafting step 6 ms over a plain one
    assert w.draft_cost == pytest.approx(0.006)
    assert w.break_even(1) == pytest.approx(1.5)  # 6 ms / 4 ms: far above the 0.2 floor
    assert VerifyCost.from_dict(curve.to_dict()) == curve  # t1 travels to the scheduler too


def worker_off_on_traffic():
    """A worker whose drafter (4 nodes, probing every 4 steps, drafting nothing) does not pay
    on the traffic: the server-wide regime. Returns it and a greedy request state."""
    from types import SimpleNamespace

    from runtime.sampling.sampling_params import SamplingParams

    class Costly(Drafter):
        min_accept_per_step = 0.2
        probe_every = 4

        def propose(self, reqs):
            return [DraftTree.chain(r.tokens[-1], []) for r in reqs]

    cfg = SpecConfig("TEST", 4)
    w = SpeculativeWorker(cfg, Costly(cfg, None), None)
    w.prior_accept = 0.0
    return w, SimpleNamespace(params=SamplingParams(temperature=0.0))


def test_a_drafter_that_does_not_pay_probes_once_per_server_interval():
    """While the server-wide acceptance is below the bar, requests stop probing on their own:
    one probe runs for the whole server every `global_interval` steps (the request that waited
    longest), doubling after each probe that does not pay."""
    from speculative.worker import SpecEntry

    w, state = worker_off_on_traffic()
    entries = [SpecEntry(f"r{i}", [1, 2, 3], 2, torch.arange(6), state) for i in range(3)]
    probes = []  # (step, rid)
    for step in range(1, 4 + 8 + 16 + 32 + 1):
        g = w._global_probe(entries)
        for e in entries:
            if w._budget(e, len(entries), g) == (4, False):
                probes.append((step, e.rid))
                w._adapt(e.rid, 3, 0)
    assert [s for s, _ in probes] == [4, 12, 28, 60], probes  # one at a time, doubling
    assert len({r for _, r in probes[:3]}) == 3  # the request that waited longest goes next
    assert w.global_interval == 64
    # a server-wide probe that pays brings the interval back
    w.global_interval, w.steps_since_global = 4, 3
    g = w._global_probe(entries)
    assert g is not None and w._budget(entries[0 if g == "r0" else 1 if g == "r1" else 2],
                                       3, g) == (4, False)
    w._adapt(g, 3, 3)
    assert w.global_interval == 4


def test_the_server_wide_probe_waits_for_a_request_the_scheduler_gave_draft_slots():
    """A server-wide probe can only draft where the scheduler's load-aware budget gave the
    request draft slots: while nobody has them the probe stays due (a probe on a request
    without slots would draft nothing, learn nothing, and still reset the interval), and it
    goes to the first request that has them."""
    from speculative.worker import SpecEntry

    w, state = worker_off_on_traffic()

    def entries(offered: set[str]):  # 2 committed tokens; 4 fresh slots when offered, else 1
        return [SpecEntry(f"r{i}", [1, 2, 3], 2, torch.arange(6 if f"r{i}" in offered else 3),
                          state) for i in range(3)]

    for _ in range(9):
        es = entries(set())
        g = w._global_probe(es)
        assert g is None
        assert all(w._budget(e, 3, g) == (1, False) for e in es)
    assert w.steps_since_global == 9  # past the interval of 4: due, waiting for slots
    es = entries({"r2"})
    g = w._global_probe(es)
    assert g == "r2" and w._budget(es[2], 3, g) == (4, False)
    assert w.steps_since_global == 0


class BatchRecordingOracle(ChainOracleDrafter):
    """Records each step's budgets as one list (one per decoding request)."""

    def __init__(self, *args, **kw) -> None:
        super().__init__(*args, **kw)
        self.steps: list[list[int]] = []

    def propose(self, reqs: list[SpecReq]) -> list[DraftTree]:
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

    h = spec_harness(tiny, make, num_draft_tokens=4, load_aware=True, engine="cpu")
    h.submit("alone", ps[0], ignore_eos=True, max_new_tokens=24)
    h.run()
    alone = drafters[0].steps
    assert all(len(s) == 1 for s in alone) and max(s[0] for s in alone) == 4
    assert h.meta["alone"]["spec_verify_ct"] < 24 // 2  # the oracle's drafts paid off
    drafters[0].steps = []
    for i, p in enumerate(ps[1:], start=1):
        h.submit(f"r{i}", p, ignore_eos=True, max_new_tokens=24)
    h.run()
    assert [h.outputs["alone"]] + [h.outputs[f"r{i}"] for i in range(1, 9)] == ref
    busy = [s for s in drafters[0].steps if len(s) >= 8]
    assert busy, "eight requests were meant to decode together"
    # a batch of 8 is compute-bound on the CPU engine's curve: plain decoding, even though
    # these requests would accept everything (the prior has not learned that yet)
    assert all(set(s) == {1} for s in busy)
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
    """An oracle drafter that may be skipped while it does not pay; records what it saw."""

    skips_when_off = True

    def __init__(self, *a, **kw) -> None:
        super().__init__(*a, **kw)
        self.proposed_steps = 0
        self.skipped_rows = 0

    def propose(self, reqs):
        self.proposed_steps += 1
        return super().propose(reqs)

    def skipped(self, rids):
        self.skipped_rows += len(rids)


@pytest.mark.parametrize("skips", [True, False])
def test_a_drafter_that_does_not_pay_is_skipped_between_server_wide_probes(tiny, skips):  # noqa: F811
    """While the server-wide acceptance is below the bar, steps with no draft and no probe due
    within WARM_STEPS run as plain decoding without the drafter (a `skips_when_off` drafter
    hears of them through `skipped`); the steps before each server-wide probe, and the probes,
    run the full path. Greedy output is plain decoding's either way, and no KV leaks."""
    ps = prompts(6, seed=21)
    ref = reference(tiny, ps, ignore_eos=True, max_new_tokens=40)
    truth = {tuple(p): r for p, r in zip(ps, ref)}
    h = Harness(tiny, num_draft_tokens=4, max_running_requests=3, chunked_prefill_size=32)
    runner = tiny[1]
    cfg = SpecConfig("TEST", 4)
    drafter = OffRecordingOracle(cfg, runner, truth, 3)
    drafter.skips_when_off = skips
    worker = SpeculativeWorker(cfg, drafter, runner)
    worker.prior_accept = 0.0  # the drafter does not pay on this traffic
    worker.global_interval = 64  # (as after a few probes that did not pay)
    worker.PRIOR_WEIGHT = 0.0  # keep it so (what the probes accept must not bring it back)
    assert serve_with(h, runner, worker, ps, 40) == ref
    if skips:
        assert drafter.skipped_rows > 0
        # only the WARM_STEPS steps before each server-wide probe (and the probe) proposed
        assert drafter.proposed_steps <= (worker.WARM_STEPS + 1) * 3, drafter.proposed_steps
        assert drafter.proposed_steps > 0  # the server-wide probes still run
    else:
        assert drafter.skipped_rows == 0 and drafter.proposed_steps > 40
    h.sched.check_no_leak()


def test_a_due_probe_that_no_request_can_take_keeps_the_steps_plain(tiny, monkeypatch):  # noqa: F811
    """A server-wide probe that is due waits for a request the scheduler gave draft slots.
    While the scheduler hands out none (here its plan never does, as a busy batch's load-aware
    plan does not), no request can probe or draft, so every step is a plain step without the
    drafter, not the full path with its capture and bookkeeping (the warm steps before a probe
    run only within SLOT_HORIZON steps of a request with slots); output is plain decoding's
    and no KV leaks."""
    import runtime.scheduler.scheduler as sched_mod

    monkeypatch.setattr(sched_mod, "plan_drafts", lambda rates, caps, cost: [1] * len(caps))
    monkeypatch.setattr(sched_mod, "with_probes", lambda sizes, caps, accs: sizes)
    ps = prompts(4, seed=31)
    ref = reference(tiny, ps, ignore_eos=True, max_new_tokens=30)
    truth = {tuple(p): r for p, r in zip(ps, ref)}
    h = Harness(tiny, num_draft_tokens=4, max_running_requests=4, chunked_prefill_size=32,
                load_aware=True)
    runner = tiny[1]
    cfg = SpecConfig("TEST", 4)
    drafter = OffRecordingOracle(cfg, runner, truth, 3)
    worker = SpeculativeWorker(cfg, drafter, runner)
    worker.prior_accept, worker.PRIOR_WEIGHT, worker.global_interval = 0.0, 0.0, 4
    assert serve_with(h, runner, worker, ps, 30) == ref
    assert worker.steps_since_global > worker.global_interval  # the probe stayed due
    assert drafter.proposed_steps == 0 and drafter.skipped_rows > 0
    h.sched.check_no_leak()


@pytest.mark.parametrize("algorithm", ["NGRAM", "LOOKAHEAD"])
def test_steps_without_draft_slots_are_plain_for_model_free_drafters(tiny, monkeypatch,  # noqa: F811
                                                                     algorithm):
    """NGRAM and LOOKAHEAD (`plain_without_budget`): a step in which the scheduler gave no
    request draft slots is a plain decode step (no propose), whatever the traffic, and NGRAM's
    trie counts nothing for requests that never drafted; with slots they draft (and the trie
    counts). Greedy output is plain decoding's both ways, and no KV leaks."""
    import runtime.scheduler.scheduler as sched_mod
    from speculative.base import ALGORITHMS

    class Counting(ALGORITHMS[algorithm]):
        proposed = 0

        def propose(self, reqs):
            self.proposed += 1
            return super().propose(reqs)

    assert Counting.plain_without_budget
    ps = prompts(4, seed=33)
    ref = reference(tiny, ps, ignore_eos=True, max_new_tokens=24)
    runner = tiny[1]
    for slots in (False, True):
        with monkeypatch.context() as m:
            if not slots:
                m.setattr(sched_mod, "plan_drafts", lambda rates, caps, cost: [1] * len(caps))
                m.setattr(sched_mod, "with_probes", lambda sizes, caps, accs: sizes)
            h = Harness(tiny, num_draft_tokens=4, max_running_requests=4,
                        chunked_prefill_size=32, load_aware=True)
            cfg = SpecConfig(algorithm, 4)
            drafter = Counting(cfg, runner)
            worker = SpeculativeWorker(cfg, drafter, runner)
            assert serve_with(h, runner, worker, ps, 24) == ref
            assert bool(drafter.proposed) == slots
            if algorithm == "NGRAM":
                assert (drafter.cache.num_nodes > 0) == slots
                assert len(drafter._history) <= 1  # (the last release rides the next batch)
            h.sched.check_no_leak()
