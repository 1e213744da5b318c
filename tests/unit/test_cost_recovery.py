"""Decisions that can be won back: a server whose start-up verify-cost curve was timed beside
busy neighbours (x1.6 past 2 rows) drafts again on repeated-output prompts within the stated
bound, because probes are judged under the cost the steps' own forwards show; with the learned
cost switched off (the start-up curve trusted for good) the same checks fail.

The bound (docs/speculative.md, "How the controller learns cost"): once the learned cost moved
enough to change a decision, the next server-wide probe runs within PROBE_EVERY steps, is judged
with its own forward timed, and a probe that pays turns drafting back on at the next step."""

from __future__ import annotations

import pytest

from specserve.speculative.controller import PROBE_EVERY, SpecController
from specserve.speculative.planning import TreeSizes
from tests.helpers.cost_replay import TRUE, Replay, distorted, replay

BOUND = PROBE_EVERY + 1  # steps until drafting is back on


def check_recovered(r: Replay) -> None:
    on = r.first_on()
    assert on is not None and on <= BOUND, f"drafting back on for good at step {on}"
    assert r.accept_length(BOUND) >= 2.0, r.accept_length(BOUND)


def probes_only(learn_cost: bool, seed: int) -> Replay:
    """NGRAM without match sizing (no sure drafts: only the probes can win the decision back)
    on a rewrite, arriving switched off, as after traffic that drafting did not pay for."""
    return replay("NGRAM", distorted(TRUE), learn_cost, seed=seed, switched_off=True,
                  speculative_ngram_disable_match_sizing=True)


@pytest.mark.parametrize("seed", [0, 1, 2])
def test_ngram_switched_off_under_a_distorted_curve_drafts_again_within_the_bound(seed):
    check_recovered(probes_only(True, seed))


@pytest.mark.parametrize("seed", [0, 1, 2])
def test_negative_control_with_the_start_up_curve_trusted_it_stays_off_past_the_bound(seed):
    r = probes_only(False, seed)
    with pytest.raises(AssertionError):
        check_recovered(r)
    assert r.accept_length(BOUND) < probes_only(True, seed).accept_length(BOUND)


@pytest.mark.parametrize("algorithm", ["NGRAM", "SUFFIX"])
@pytest.mark.parametrize("batch", [1, 2])
def test_a_fresh_server_with_a_distorted_curve_drafts_on_repeated_output(algorithm, batch):
    r = replay(algorithm, distorted(TRUE), True, batch=batch, seed=batch)
    check_recovered(r)
    alone = replay(algorithm, TRUE, True, batch=batch, seed=batch)
    assert r.accept_length(BOUND) >= 0.9 * alone.accept_length(BOUND)


def test_suffix_probes_draft_the_whole_tree_so_its_cost_gets_timed():
    """SUFFIX cuts its trees by the curve: under a curve that overprices big trees it would
    never draft one, and so never time one. A probe's tree is uncut (`explore`)."""
    r = replay("SUFFIX", distorted(TRUE, factor=3.0), True, switched_off=True)
    assert max(r.rows) >= 6
    assert r.controller.cost.learned_rows() >= 6


@pytest.mark.parametrize("learn_cost", [True, False])
def test_a_model_drafters_probe_comes_within_its_cost_bound_and_is_judged_by_its_forward(
        learn_cost):
    """A drafter whose probes cost 20 plain steps beyond their rows (a draft model catching
    up): probes at most every max(global interval, cost interval) steps, and the probe that
    comes is judged under the cost its own verify forward shows."""
    c = SpecController(TreeSizes(8, 8), distorted(TRUE), learn_cost=learn_cost)
    t1 = TRUE.t1_s
    c.prior, c.t1, c.probe_s = [1.0, 20.0], t1, 20 * t1
    c.global_interval = max(PROBE_EVERY, c.cost_interval(1))
    st, probed = c.new_request(), None
    for step in range(1, 2 * c.global_interval + 1):
        n = c.plan([st]).sizes[0]
        probed = step if st.out == "global" else None
        # a probe accepts 1 of its 7 drafts: that pays at C(8) = 1.65 (alone), not at 2.64; a
        # draft the plan gives (one node: C(2) is flat) accepts nothing
        accepted = min(n - 1, 1) if probed else 0
        info = {"drafted": n - 1, "accepted": accepted, "draft_s": 0.0}
        c.observe([st], [info], t1 * TRUE(n) + 0.2 * t1 * (n > 1), (n, t1 * TRUE(n)))
        if probed:
            break
    assert probed is not None and probed <= max(PROBE_EVERY, 20 / 0.02)
    assert (c.global_interval == PROBE_EVERY) == learn_cost  # paid only under the live cost


def test_a_server_wide_probe_that_pays_turns_the_traffic_on_at_the_next_step():
    c = SpecController(TreeSizes(4, 8), TRUE)
    c.prior, c.global_interval = [1.0, 50.0], PROBE_EVERY
    st = c.new_request()
    for _ in range(PROBE_EVERY):
        plan = c.plan([st])
        assert plan.traffic_off
        n = plan.sizes[0]
        paid = st.out == "global"
        info = {"drafted": n - 1, "accepted": n - 1 if paid else 0, "draft_s": 0.0}
        c.observe([st], [info], TRUE.t1_s * TRUE(n), (n, TRUE.t1_s * TRUE(n)))
        if paid:
            break
    assert paid, "no server-wide probe within PROBE_EVERY steps"
    assert not any(c.plan([st]).traffic_off for _ in range(PROBE_EVERY))
