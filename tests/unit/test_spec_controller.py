"""The speculation controller (specserve/speculative/controller.py): the plan on cost models, one
acceptance estimate per request, probes, sure drafts, the server-wide regime, measured costs."""

from __future__ import annotations

import itertools
import random

import pytest

from specserve.runtime.verify_cost import VERIFY_COST, VerifyCost
from specserve.speculative.controller import (
    MAX_PROBE_INTERVAL,
    PROBE_EVERY,
    PROBE_SHARE,
    WARM_STEPS,
    SpecController,
)
from specserve.speculative.planning import ReqSpec, TreeSizes, best_prefix, plan_drafts, update

FLAT = VerifyCost((1, 64), (1.0, 1.0))  # memory-bound: any number of rows costs one pass
LINEAR = VerifyCost((1, 2), (1.0, 2.0))  # compute-bound from the first row
CPU = VERIFY_COST["cpu"]


def expected_rate(sizes, rates, cost):
    tokens = sum(sum(a**k for k in range(n)) for n, a in zip(sizes, rates))
    return tokens / cost(sum(sizes))


def test_verify_cost_interpolates_and_extrapolates_the_measured_points():
    c = VerifyCost((1, 4, 8), (1.0, 1.6, 3.0))
    assert c(1) == 1.0 and c(4) == pytest.approx(1.6) and c(8) == pytest.approx(3.0)
    assert c(2) == pytest.approx(1.2) and c(6) == pytest.approx(2.3)
    assert c(12) == pytest.approx(4.4)  # the last slope, continued
    with pytest.raises(AssertionError):
        VerifyCost((2, 4), (1.0, 2.0))


def test_compute_bound_cost_means_no_drafts_at_any_batch():
    for b in (1, 4, 32):
        assert plan_drafts([0.9] * b, [8] * b, LINEAR) == [1] * b


def test_flat_cost_means_every_request_drafts_its_whole_cap():
    assert plan_drafts([0.5, 0.2, 0.9], [4, 6, 8], FLAT) == [4, 6, 8]
    assert plan_drafts([0.0, 0.5], [4, 4], FLAT) == [1, 4]  # a request that never accepts: none


def test_measured_cpu_curve_drafts_alone_and_stops_drafting_when_busy():
    assert plan_drafts([0.9], [8], CPU)[0] >= 4
    assert plan_drafts([0.5] * 2, [4] * 2, CPU) == [2, 2]
    assert plan_drafts([0.5] * 8, [4] * 8, CPU) == [1] * 8  # compute-bound: plain decoding
    assert plan_drafts([0.5] * 64, [4] * 64, CPU) == [1] * 64
    # a batch of 4 drafts only for requests that copy almost everything
    assert plan_drafts([0.3] * 4, [4] * 4, CPU) == [1] * 4


def test_more_nodes_go_to_the_requests_likely_to_accept():
    sizes = plan_drafts([0.95, 0.2], [8, 8], CPU)
    assert sizes[0] > sizes[1]


def test_caps_are_respected_and_one_node_is_the_floor():
    rng = random.Random(0)
    for _ in range(200):
        b = rng.randrange(1, 12)
        rates = [rng.random() for _ in range(b)]
        caps = [rng.randrange(1, 9) for _ in range(b)]
        sizes = plan_drafts(rates, caps, CPU)
        assert all(1 <= n <= c for n, c in zip(sizes, caps))


@pytest.mark.parametrize("cost", [CPU, VERIFY_COST["torch"], VerifyCost((1, 3, 5), (1, 1.1, 3))])
def test_plan_is_the_best_allocation_by_exhaustive_search(cost):
    rng = random.Random(1)
    for _ in range(60):
        b = rng.randrange(1, 4)
        rates = [rng.random() for _ in range(b)]
        caps = [rng.randrange(1, 7) for _ in range(b)]
        best = max(expected_rate(s, rates, cost)
                   for s in itertools.product(*[range(1, c + 1) for c in caps]))
        got = expected_rate(plan_drafts(rates, caps, cost), rates, cost)
        assert got == pytest.approx(best, rel=1e-9), (rates, caps)


def test_a_per_request_overhead_moves_the_plan_toward_fewer_drafting_requests():
    # with a measured cost per drafting request, a marginal request stops drafting first
    cheap_rows = VerifyCost((1, 2, 8), (1.0, 1.05, 1.6))
    free = plan_drafts([0.9, 0.5], [4, 4], cheap_rows)
    dear = plan_drafts([0.9, 0.5], [4, 4], cheap_rows, delta=0.1)
    assert free[1] > 1 and dear[1] == 1 and dear[0] > 1
    assert plan_drafts([0.6], [4], CPU, delta=10.0) == [1]  # nothing pays that much


def test_best_prefix_cuts_the_unlikely_tail_and_drafts_less_in_a_busy_batch():
    probs = [1.0, 0.95, 0.9, 0.5, 0.1, 0.05]
    alone = best_prefix(probs, 1, CPU)
    assert 2 <= alone < len(probs)
    assert best_prefix(probs, 32, CPU) <= alone
    assert best_prefix(probs, 1, None) == len(probs)  # no curve: no cut
    assert best_prefix(probs, 1, FLAT) == len(probs)  # rows are free: keep everything


def test_the_estimate_follows_the_requests_own_outcomes():
    a = ReqSpec(1.0, 1.0)
    assert a.rate == pytest.approx(0.5)  # prior
    for _ in range(30):
        update(a, drafted=3, accepted=3, decay=0.9)  # copying: every draft accepted
    assert a.rate > 0.95
    for _ in range(30):
        update(a, drafted=3, accepted=0, decay=0.9)  # stopped copying
    assert a.rate < 0.2


def ctl(base=4, alone=None, curve=CPU, **kw) -> SpecController:
    return SpecController(TreeSizes(base, alone or base, **kw), curve)


def outcome(drafted: int, accepted: int) -> dict:
    return {"drafted": drafted, "accepted": accepted, "draft_s": 0.0}


def test_caps_go_deep_only_for_a_request_decoding_alone():
    c = ctl(8, 16)
    fresh = c.new_request()
    assert c.caps([fresh]) == [8]  # nothing accepted yet: no deep draft by default
    fresh.last_accepted = 7
    assert c.caps([fresh]) == [16]
    assert c.caps([fresh, c.new_request()]) == [8, 8]  # 8 + 16 > 16: the step would leave it
    d = ctl(8, 16, deep_for_all=True)
    assert d.caps([d.new_request()]) == [16]
    assert ctl(8, 8, deep_for_all=True).caps([ReqSpec(1, 1)]) == [8]  # deep drafts off


def test_without_adaptation_every_request_gets_its_cap_every_step():
    c = SpecController(TreeSizes(4, 4), LINEAR, adaptive=False)
    for _ in range(50):
        plan = c.plan([c.new_request() for _ in range(3)])
        assert plan.sizes == [4, 4, 4] and not plan.idle and not any(plan.confident)


def test_a_request_kept_back_is_probed_with_doubling_intervals_and_reset_when_it_pays():
    c = ctl(4, curve=VerifyCost((1, 2, 8), (1.0, 1.1, 1.9)))
    c.prior = [50.0, 1.0]  # the drafter pays in general: requests probe on their own
    st = c.new_request()
    st.accepted, st.rejected = 0.0, 10.0  # this one's drafts fail
    gaps, since = [], 0
    for _ in range(PROBE_EVERY * (1 + 2 + 4 + 8)):
        since += 1
        plan = c.plan([st])
        if plan.sizes[0] > 1:
            c.observe([st], [outcome(3, 0)], 0.01)
            gaps.append(since)
            since = 0
        else:
            c.observe([st], [outcome(0, 0)], 0.01)
    assert gaps == [PROBE_EVERY, 2 * PROBE_EVERY, 4 * PROBE_EVERY, 8 * PROBE_EVERY], gaps
    assert st.interval == 16 * PROBE_EVERY
    st.idle = st.interval - 1
    assert c.plan([st]).sizes == [4]
    c.observe([st], [outcome(3, 3)], 0.01)  # it paid
    assert st.interval == PROBE_EVERY
    for _ in range(3):
        c.observe([st], [outcome(3, 3)], 0.01)
    assert c.plan([st]).sizes[0] > 1  # copying again: it drafts without probes


def test_a_batch_probes_each_kept_back_request_once_per_interval_times_its_size():
    c = ctl(4, curve=VerifyCost((1, 2, 8), (1.0, 1.1, 1.9)))
    c.prior = [50.0, 1.0]
    states = [ReqSpec(0.0, 10.0) for _ in range(3)]
    probes = [0, 0, 0]
    for _ in range(PROBE_EVERY * 3):
        plan = c.plan(states)
        for i, n in enumerate(plan.sizes):
            probes[i] += n > 1
    assert probes == [1, 1, 1]


def test_a_drafter_that_does_not_pay_probes_once_per_server_interval():
    """While a fresh request would not draft (the server-wide estimate is below break-even),
    requests stop probing on their own: one probe runs for the whole server every
    `global_interval` steps (the request kept back longest), doubling after each probe that
    does not pay; one that pays brings the interval back."""
    c = ctl(4)
    c.prior = [0.0, 50.0]
    states = [ReqSpec(0.0, 10.0) for _ in range(3)]
    probes = []
    for step in range(1, PROBE_EVERY * (1 + 2 + 4) + 1):
        plan = c.plan(states)
        assert plan.traffic_off
        got = [i for i, n in enumerate(plan.sizes) if n > 1]
        assert len(got) <= 1
        probes += [(step, i) for i in got]
        c.observe(states, [outcome(3, 0) if n > 1 else outcome(0, 0) for n in plan.sizes], 0.01)
        c.prior = [0.0, 50.0]  # (keep the traffic off: the test is about the schedule)
    assert [s for s, _ in probes] == [PROBE_EVERY, 3 * PROBE_EVERY, 7 * PROBE_EVERY], probes
    assert len({i for _, i in probes}) == 3  # the request kept back longest goes next
    assert c.global_interval == 8 * PROBE_EVERY
    c.global_interval, c.since_global = PROBE_EVERY, PROBE_EVERY - 1
    plan = c.plan(states)
    i = next(i for i, n in enumerate(plan.sizes) if n > 1)
    c.observe(states, [outcome(3, 3) if j == i else outcome(0, 0) for j in range(3)], 0.01)
    assert c.global_interval == PROBE_EVERY


def test_probes_that_cost_much_wait_so_that_they_take_at_most_their_share():
    """A probe step of a draft model catches up every position since it last drafted: here
    40 plain steps' time. After the first probe is timed, probes that do not pay come so
    rarely that they take at most PROBE_SHARE of the decode time; cheap probes keep the
    doubling schedule (the test above)."""
    c = ctl(4)
    c.prior, c.t1 = [0.0, 50.0], 0.004
    st = ReqSpec(0.0, 10.0)
    plain = c.t1 * c.curve(1)
    steps, extra, probes = 20_000, 40 * plain, []
    for step in range(steps):
        plan = c.plan([st])
        probing = plan.sizes[0] > 1
        probes += [step] if probing else []
        c.observe([st], [outcome(3, 0) if probing else outcome(0, 0)],
                  plain + (extra if probing else 0.0))
        c.prior = [0.0, 50.0]
    assert c.probe_s == pytest.approx(extra, rel=0.05)
    assert min(b - a for a, b in zip(probes[1:], probes[2:])) >= 0.95 * c.cost_interval(1)
    assert len(probes) * extra / (steps * plain) <= PROBE_SHARE + 0.005, probes


def test_steps_far_from_any_probe_are_idle():
    c = ctl(4)
    c.prior = [0.0, 50.0]
    c.global_interval = 4 * WARM_STEPS
    states = [ReqSpec(0.0, 10.0) for _ in range(2)]
    idle = []
    for _ in range(4 * WARM_STEPS):
        plan = c.plan(states)
        idle.append(plan.idle)
    assert idle[: 3 * WARM_STEPS - 1] == [True] * (3 * WARM_STEPS - 1)
    assert not any(idle[3 * WARM_STEPS :])  # the warm steps before the probe, and the probe


def test_sure_drafts_for_a_drafter_that_judges_them_back_off_when_they_fail():
    """A request the plan keeps back drafts what the drafter is sure of (where a sure draft
    pays); sure drafts that keep failing (a penalty forbidding the copy) wait, doubling."""
    c = ctl(4, judges_confidence=True)
    c.prior = [50.0, 1.0]
    st = ReqSpec(0.0, 10.0)
    plan = c.plan([st])
    assert plan.sizes == [4] and plan.confident == [True]
    sure_steps = []
    for step in range(60):
        plan = c.plan([st])
        if plan.confident[0]:
            sure_steps.append(step)
            c.observe([st], [outcome(3, 0)], 0.01)
    gaps = [b - a for a, b in zip(sure_steps, sure_steps[1:])]
    assert gaps[:4] == sorted(gaps[:4]) and gaps[3] > gaps[0], gaps  # waits grow
    assert not ctl(4).plan([ReqSpec(0.0, 10.0)]).confident[0]  # a drafter that cannot judge


def test_costs_are_measured_from_step_times():
    curve = VerifyCost((1, 2, 4), (1.0, 1.2, 1.4), "measured", t1_s=0.004)
    c = SpecController(TreeSizes(4, 4), curve)
    assert c.t1 == 0.004 and c.delta == 0.0  # nothing drafted yet: no overhead known
    states = [ReqSpec(1.0, 1.0)]
    c.observe(states, [outcome(3, 1)], 0.004 * curve(4) + 0.006)  # 6 ms beyond its rows
    assert c.draft_s == pytest.approx(0.006)
    assert c.delta == pytest.approx(1.5)
    for _ in range(40):  # plain steps of 10 ms at batch 2
        c.observe([ReqSpec(1, 1), ReqSpec(1, 1)], [outcome(0, 0)] * 2, 0.010 * curve(2))
    assert c.t1 == pytest.approx(0.010, rel=1e-3)
    assert VerifyCost.from_dict(curve.to_dict()) == curve  # t1 travels to the scheduler too


def test_a_dear_drafter_stops_drafting_once_its_cost_is_measured():
    c = ctl(4)
    st = c.new_request()
    st.accepted, st.rejected = 3.0, 2.0  # accepts 60%
    assert c.plan([st]).sizes[0] > 1
    t1 = c.t1 or 0.01
    c.t1 = t1
    c.observe([st], [outcome(3, 1)], t1 * CPU(4) + 5 * t1)  # drafting costs 5 forwards
    assert c.plan([st]).sizes == [1]


def test_new_requests_start_from_the_server_wide_estimate():
    c = ctl(4)
    assert c.new_request().rate == pytest.approx(0.5)
    st = c.new_request()
    for _ in range(200):
        c.observe([st], [outcome(3, 0)], 0.01)
    assert c.new_request().rate < 0.1
    c.reset()
    assert c.new_request().rate == pytest.approx(0.5)


def test_probe_intervals_are_bounded():
    c = ctl(4)
    c.prior = [50.0, 1.0]
    st = ReqSpec(0.0, 10.0, interval=MAX_PROBE_INTERVAL)
    st.out = "probe"
    c._learn_outcome(st, False, 1)
    assert st.interval == MAX_PROBE_INTERVAL
