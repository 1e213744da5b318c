"""The verify-cost curve learned from the server's own forwards (specserve/speculative/
live_cost.py), under noisy timings: outliers, drift, a distorted prior, a busy server that never
runs one row; and how the controller uses it (specserve/speculative/controller.py)."""

from __future__ import annotations

import math
import random

import pytest

from specserve.runtime.verify_cost import VerifyCost, extend_curve
from specserve.speculative.controller import REMEASURE_EVERY, SpecController
from specserve.speculative.live_cost import FIRM, LiveCost
from specserve.speculative.planning import TreeSizes
from tests.helpers.cost_replay import TRUE, distorted


def noisy(rng: random.Random, t: float, sigma: float = 0.08, burst: float = 0.15) -> float:
    """A forward's time beside a noisy neighbour: lognormal jitter, and a share of `burst`
    forwards slowed 2-4x."""
    t *= math.exp(rng.gauss(0.0, sigma))
    return t * rng.uniform(2.0, 4.0) if rng.random() < burst else t


def test_the_live_curve_is_the_machines_not_the_distorted_priors_under_noise():
    rng = random.Random(0)
    live = LiveCost(distorted(TRUE))
    for i in range(600):
        n = rng.choice([1, 1, 2, 3, 4, 5, 6, 8, 9, 12])
        speed = 1.0 + 0.5 * i / 600  # the machine slows down by half over the run
        live.add(n, noisy(rng, TRUE.t1_s * speed * TRUE(n)))
    curve = live.curve
    for n in (2, 3, 4, 5, 6, 8, 9, 12):
        assert curve(n) == pytest.approx(TRUE(n), rel=0.08), n
    # where it never went, the prior's shape at the level learned next to it
    assert curve(32) == pytest.approx(TRUE(32), rel=0.1)
    assert live.prior.ratios == distorted(TRUE).ratios  # the prior itself is kept
    assert live.disagreement() > 1.5


def test_one_slow_forward_does_not_price_a_size_out_but_a_dearer_size_shows_within_firm():
    rng = random.Random(1)
    live = LiveCost(TRUE)
    for _ in range(30):
        for n in (1, 2, 8):
            live.add(n, noisy(rng, TRUE.t1_s * TRUE(n), burst=0.0))
    live.add(4, 5.0 * TRUE.t1_s * TRUE(4))  # 4 rows once, during a neighbour's burst
    assert live.curve(4) < 1.1 * TRUE(4)
    assert live.curve(8) < 1.1 * TRUE(8)  # and nothing above it moved
    for _ in range(FIRM):  # 4 rows truly cost twice as much now
        live.add(4, 2.0 * TRUE.t1_s * TRUE(4))
    assert live.curve(4) == pytest.approx(2.0 * TRUE(4), rel=0.1)


def test_bursts_in_most_of_a_window_do_not_move_a_bucket():
    rng = random.Random(2)
    live = LiveCost(TRUE)
    for i in range(200):
        n = 1 if i % 2 else 6
        live.add(n, noisy(rng, TRUE.t1_s * TRUE(n), burst=0.5))  # half the forwards slowed
    assert live.curve(6) == pytest.approx(TRUE(6), rel=0.1)


def test_a_busy_server_that_never_runs_one_row_learns_the_ratios_between_its_sizes():
    rng = random.Random(3)
    prior = distorted(TRUE, beyond=24)  # wrong past 24 rows only
    live = LiveCost(prior)
    for _ in range(300):
        n = rng.choice([32, 36, 40, 48])
        live.add(n, noisy(rng, 0.004 * TRUE(n)))
    curve = live.curve
    assert curve(48) / curve(32) == pytest.approx(TRUE(48) / TRUE(32), rel=0.08)
    assert curve(40) / curve(32) == pytest.approx(TRUE(40) / TRUE(32), rel=0.08)


def test_the_first_forwards_before_any_one_row_forward_are_moved_to_its_level():
    live = LiveCost(distorted(TRUE))
    for _ in range(3):  # verify forwards come first: their level is a guess
        live.add(4, TRUE.t1_s * TRUE(4))
    for _ in range(3):
        live.add(1, TRUE.t1_s)
    assert live.curve(4) == pytest.approx(TRUE(4), rel=0.02)


def ctl(prior: VerifyCost, **kw) -> SpecController:
    return SpecController(TreeSizes(4, 8), prior, **kw)


def test_the_controller_plans_with_the_live_curve_and_the_runner_gets_it_when_it_moves():
    c = ctl(distorted(TRUE))
    assert c.curve is c.cost.prior and c.curve_update() is None
    st = c.new_request()
    for n in (1, 5, 1, 5, 1, 5):
        c.observe([st], [{"drafted": n - 1, "accepted": 0, "draft_s": 0.0}], 0.01,
                  (n, TRUE.t1_s * TRUE(n)))
    assert c.curve(5) == pytest.approx(TRUE(5), rel=0.02)
    sent = c.curve_update()
    assert sent is c.curve and c.curve_update() is None  # once, until it moves again
    off = ctl(distorted(TRUE), learn_cost=False)
    off.observe([st], [{"drafted": 4, "accepted": 0, "draft_s": 0.0}], 0.01,
                (5, TRUE.t1_s * TRUE(5)))
    assert off.curve is off.cost.prior and off.curve_update() is None


def test_a_prior_that_disagrees_is_measured_again_with_backoff_and_continued_past_it():
    c = ctl(distorted(TRUE))
    st = c.new_request()

    def forwards(k: int) -> None:
        for i in range(k):
            n = 6 if i % 2 else 1
            c.observe([st], [{"drafted": n - 1, "accepted": 0, "draft_s": 0.0}], 0.01,
                      (n, TRUE.t1_s * TRUE(n)))

    forwards(REMEASURE_EVERY - 1)
    assert c.remeasure_rows() is None  # not yet: too few forwards
    forwards(1)
    rows = c.remeasure_rows()
    assert rows[0] == 1 and max(rows) >= 12 and set(rows) <= set(TRUE.rows)
    assert c.remeasure_rows() is None  # once, then it waits twice as long
    measured = VerifyCost((1, 2, 4, 8, 16), tuple(TRUE(n) for n in (1, 2, 4, 8, 16)),
                          "measured again", TRUE.t1_s)
    c.set_prior(measured)
    assert c.cost.prior(4) == pytest.approx(TRUE(4))
    # past the new measurement, the old prior's shape, joined to it
    assert c.cost.prior(64) / c.cost.prior(16) == pytest.approx(
        distorted(TRUE)(64) / distorted(TRUE)(16))
    forwards(2 * REMEASURE_EVERY)
    assert c.remeasure_rows() is None  # it agrees now


def test_extend_curve_keeps_the_measured_points_and_the_old_shape_past_them():
    old = VerifyCost((1, 4, 16, 64), (1.0, 2.0, 4.0, 12.0))
    new = VerifyCost((1, 2, 4, 8), (1.0, 1.1, 1.3, 1.8), "new", 0.005)
    joined = extend_curve(new, old)
    assert joined.rows == (1, 2, 4, 8, 16, 64) and joined.t1_s == 0.005
    assert joined(16) / joined(64) == pytest.approx(old(16) / old(64))
    assert joined(16) == pytest.approx(4.0 * 1.8 / old(8))
