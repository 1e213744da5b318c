"""The load-aware draft budget (runtime/scheduler/spec_budget.py) on cost models."""

from __future__ import annotations

import itertools
import random

import pytest

from runtime.scheduler.spec_budget import VERIFY_COST, Acceptance, VerifyCost, plan_drafts

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


def test_acceptance_follows_the_requests_own_outcomes():
    a = Acceptance()
    assert a.rate == pytest.approx(0.5)  # prior
    for _ in range(30):
        a.update(drafted=3, accepted=3)  # copying: every draft accepted
    assert a.rate > 0.95
    for _ in range(30):
        a.update(drafted=3, accepted=0)  # stopped copying
    assert a.rate < 0.2
    before = a.rate
    a.update(drafted=0, accepted=0)  # nothing drafted: nothing learned
    assert a.rate == before


def test_requests_kept_from_drafting_are_probed_once_per_probe_interval_of_the_batch():
    from runtime.scheduler.spec_budget import PROBE_EVERY, with_probes

    accs = [Acceptance() for _ in range(4)]
    caps = [4, 4, 4, 1]  # the last one has no room to draft: never probed
    got = [with_probes([1, 1, 1, 1], caps, accs) for _ in range(PROBE_EVERY * 4 * 2)]
    for i in range(3):
        probes = [g[i] for g in got if g[i] > 1]
        assert probes == [4, 4], (i, probes)  # its cap, once per PROBE_EVERY * B steps
    assert all(g[3] == 1 for g in got)
    # a request the plan lets draft is never "idle"
    accs = [Acceptance()]
    assert all(with_probes([3], [4], accs) == [3] for _ in range(5 * PROBE_EVERY))
    assert accs[0].idle == 0
