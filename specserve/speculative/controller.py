"""The speculation controller: which requests draft this step, and how many tree nodes each.

It runs in the scheduler (which hands out the KV slots the trees need) and is the only place
that decides how much to draft; the speculative worker drafts what it is given and reports what
was accepted and how long the step took.

What a step yields and costs. A decode step of B requests yields B tokens plus the accepted
drafts, and costs T(rows) = t1 * C(rows) seconds of target forward, rows summed over the batch
(each request's root plus its draft nodes; C is the verify-cost curve, learned from the target
forwards the runner timed over the start-up measurement, specserve/speculative/live_cost.py)
plus d seconds per request that drafted (`draft_s`: the drafter's own work, a draft model's
forwards, the tree mask, verification, the commit; the steps' time outside the target forward).
The plan maximises expected tokens per second:

    rate(sizes) = (B + sum_i E_i(n_i)) / (C(rows) + delta * drafting),   delta = d / t1

One acceptance estimate per request (`ReqSpec`): accepted drafts over accepted drafts plus
rejections, decayed so it follows the text; E_i is the chain model (the k-th draft node is
accepted with probability a_i^k). Nodes go out greedily in order of marginal yield and the best
total is kept (`plan_drafts`). Requests kept at one node learn nothing, so they are probed (given
their whole cap) every `interval * B` steps; a probe that does not pay doubles the request's
interval (up to MAX_PROBE_INTERVAL), one that pays resets it. While a fresh request would not
draft at this batch size (the server-wide estimate, `prior`, which new requests start from, is
below break-even) the drafter does not pay on the current traffic: requests stop probing on
their own and one server-wide probe (the request idle longest) runs every `global_interval`
steps, doubling the same way; steps far from any probe then run without the drafter (`idle`).
A probe costs more than a drafting step (a draft model first catches up every position since
it last drafted), so after one that did not pay, the next waits long enough that probes take
at most PROBE_SHARE of the decode time, by the probes' measured extra time (`probe_s`).

Decisions that can be won back. A probe's own forward enters the curve before the probe is
judged, and a server-wide probe goes to a request planned below its cap (so it times the cap's
rows, and SUFFIX drafts it uncut: `StepPlan.explore`). When the learned curve lowers the
break-even of a base-size or deepest tree by RECONSIDER_MARGIN against the curve under which a
probe interval last grew, every back-off starts again (`_reconsider`): the next server-wide
probe comes within max(PROBE_EVERY, cost interval) steps, and one that pays puts the traffic
back on at the next step, for PROBE_EVERY steps at least (`won_back`; docs/speculative.md
states the bound).

What the drafter is decides the rest (specserve/speculative/base.py, `Drafter.tree_sizes`): the caps
(a request decoding alone may go deeper), whether it sizes its own trees by its node estimates (then
a request drafts while its expected accepted drafts, a / (1 - a), pay a tree of the size such trees
keep on average; it gets its whole cap and the drafter cuts it with the same curve, `best_prefix`),
and whether it can tell a sure draft from a guess (then a request the plan keeps at one node still
drafts what the drafter is sure of; a sure draft whose accepted drafts did not pay the rows it
drafted makes the request wait, doubling).
"""

from __future__ import annotations

import math
import statistics
from collections import deque
from collections.abc import Sequence

from specserve.runtime.speculation import StepPlan
from specserve.runtime.verify_cost import VerifyCost, extend_curve
from specserve.speculative.live_cost import REMEASURE_MARGIN, LiveCost
from specserve.speculative.planning import (
    ReqSpec,
    TreeSizes,
    break_even,
    expected_gain,
    plan_drafts,
    update,
)

DECAY = 0.9  # ~10 drafting steps of memory: acceptance comes in bursts
PRIOR_DECAY = 0.98  # the server-wide estimate pools every request's drafting steps
PRIOR_WEIGHT = 2.0  # a new request starts from the server-wide rate, worth two outcomes
PROBE_EVERY = 16  # a kept-back request's first probe interval (x batch size)
MAX_PROBE_INTERVAL = 512
WARM_STEPS = 8  # steps before a server-wide probe that run the drafter (fresh head state)
COST_WEIGHT = 0.2  # EMA weight of a step's measured times
CLIP = 0.5  # the most log(step time / estimate) one step moves an estimate by (x COST_WEIGHT)
DRAFT_WINDOW = 9  # drafting steps the per-request drafting cost is the median of
PROBE_SHARE = 0.02  # of the decode time, the most that probes which do not pay may take
MAX_COST_INTERVAL = 4096  # (steps) the longest wait that PROBE_SHARE may impose
FORCED_NODES = 8  # slots of a constrained request, at least (grammar-forced tokens)
# a self-sized drafter's request drafts while it expects at least this many accepted drafts
# per step, whatever the measured cost says (the cost is unknown until drafting steps ran)
MIN_GAIN = 0.2
# a fall of the break-even accepted drafts (at the batch size, of a base-size or deepest tree)
# by this share since a probe interval last grew resets every back-off: it was decided under a
# dearer cost
RECONSIDER_MARGIN = 0.1
EXPLORE_EVERY = 16  # steps between cost probes of a self-sized drafter's uncut trees
CURVE_RESEND = 1.05  # the runner's drafter gets the curve again once it moved by this factor
REMEASURE_EVERY = 1024  # timed forwards before the prior is measured again (doubling after)


def toward(x: float, t: float) -> float:
    """x moved toward t by COST_WEIGHT in log space, by at most CLIP: a trimmed EWMA."""
    step = max(-CLIP, min(CLIP, math.log(t / x)))
    return x * math.exp(COST_WEIGHT * step)


class SpecController:
    """See the module docstring. `adaptive=False` (--speculative-disable-adaptive): every
    request gets its cap every step. `learn_cost=False`: plan with the start-up curve `curve`
    for good (the live estimate, specserve/speculative/live_cost.py, is not kept)."""

    def __init__(self, sizes: TreeSizes, curve: VerifyCost, adaptive: bool = True,
                 learn_cost: bool = True) -> None:
        self.sizes = sizes
        self.cost = LiveCost(curve)
        self.learn_cost = learn_cost
        self.adaptive = adaptive
        self.base_nodes = sizes.base
        self.epoch = 0  # back-offs set in an earlier epoch were decided under another cost
        self._backed_off_under = curve  # the curve when a probe interval last grew
        self._sent = curve  # the curve the runner's drafter cuts its trees by
        self._remeasure_at, self._remeasures = REMEASURE_EVERY, 0
        self.since_explore = 0
        self.reset()
        # seconds of a one-row step (EMA over plain steps, starting from the start-up timing),
        # and a drafting request's extra seconds beyond its verify rows (`_measure`)
        self.t1: float | None = curve.t1_s
        self.draft_s: float | None = None
        self._draft: deque[float] = deque(maxlen=DRAFT_WINDOW)  # its last values
        self.outside: float | None = None  # a plain step's seconds outside the target forward
        # a probe step's seconds beyond a plain step of the same batch (EMA over probes)
        self.probe_s: float | None = None

    def reset(self) -> None:
        """Forget what was learned about the traffic (flush_cache); measured costs stay."""
        self.prior = [1.0, 1.0]  # decayed (accepted, rejected) over every request
        self.self_sized_nodes = 2.0  # drafts a self-sized drafter's tree keeps (EMA)
        self.global_interval = PROBE_EVERY
        self.since_global = 0
        self.won_back = 0  # steps left in which a paying server-wide probe keeps the traffic on

    @property
    def curve(self) -> VerifyCost:
        """T(n)/T(1) as the plan prices it: learned from the steps' forwards over the start-up
        prior (`LiveCost`), or the prior alone with `learn_cost=False`."""
        return self.cost.curve if self.learn_cost else self.cost.prior

    @property
    def delta(self) -> float:
        """A drafting request's extra cost in one-row forwards (0 until measured)."""
        if self.draft_s is None or not self.t1:
            return 0.0
        return self.draft_s / self.t1

    def new_request(self, constrained: bool = False) -> ReqSpec:
        a = self.prior[0] / (self.prior[0] + self.prior[1])
        return ReqSpec(PRIOR_WEIGHT * a, PRIOR_WEIGHT * (1.0 - a), constrained=constrained,
                       epoch=self.epoch)

    # ---- the plan -------------------------------------------------------------------------
    def caps(self, states: Sequence[ReqSpec]) -> list[int]:
        """Most nodes per request: the base size, or `alone` for a request decoding alone
        (the verify forward stays on the flat part of its cost curve)."""
        s = self.sizes
        caps = [s.base] * len(states)
        if s.alone > s.base and len(caps) == 1 and (
                s.deep_for_all or states[0].last_accepted >= s.base - 1):
            caps[0] = s.alone
        return caps

    def pays(self, rate: float, batch_size: int, nodes: int) -> float:
        """Whether a request of this acceptance rate drafting `nodes` beside `batch_size - 1`
        one-row requests beats plain decoding, by expected tokens per cost."""
        b, delta = batch_size, self.delta
        tokens = b + sum(rate ** k for k in range(1, nodes))
        return tokens / (self.curve(b - 1 + nodes) + delta) > b / self.curve(b)

    def bar(self, batch_size: int, nodes: int) -> float:
        """Accepted drafts a request drafting `nodes` must bring for its step to pay."""
        b, c = batch_size, self.curve
        return b * (c(b - 1 + nodes) + self.delta) / c(b) - b

    def plan(self, states: Sequence[ReqSpec]) -> StepPlan:
        caps = self.caps(states)
        n = len(states)
        if not self.adaptive:
            for st in states:
                st.drafting = True
            return self._with_forced(StepPlan(caps, [False] * n, False, False), states)
        prior = self.prior[0] / (self.prior[0] + self.prior[1])
        if self.sizes.self_sized:
            # the drafter cuts each tree by its own node estimates, so the plan only decides
            # who drafts: a request whose accepted drafts pay a tree of the usual size
            bar = max(MIN_GAIN, self.bar(n, 1.0 + self.self_sized_nodes))
            sizes = [c if expected_gain(s.rate) >= bar else 1 for s, c in zip(states, caps)]
            off = expected_gain(prior) < bar
        else:
            sizes = plan_drafts([s.rate for s in states], caps, self.curve, self.delta)
            off = not self.pays(prior, n, self.sizes.base)
        if self.won_back:  # a server-wide probe paid: the traffic is on while this lasts
            self.won_back -= 1
            off = False
        confident = [False] * n
        kept = [i for i in range(n) if sizes[i] == 1 and caps[i] > 1]
        # (a request drafting less than its cap is probed too: a probe times the cap's rows)
        probe = self._global_probe(states, [i for i in range(n) if sizes[i] < caps[i]]) \
            if off else None
        sure = self.sizes.judges_confidence and kept and self.pays(1.0, n, max(caps))
        for i in range(n):
            st = states[i]
            st.out = ""
            st.drafting = sizes[i] > 1
            if i == probe:
                sizes[i], st.idle, st.drafting, st.out = caps[i], 0, True, "global"
                continue
            if sizes[i] > 1:
                st.idle = 0
                continue
            if caps[i] <= 1:
                continue
            st.idle += 1
            if st.epoch != self.epoch:  # its back-off was decided under a dearer cost
                st.epoch, st.interval, st.sure_interval, st.sure_wait = self.epoch, 0, 0, 0
            st.sure_wait = max(st.sure_wait - 1, 0)
            if not off and st.idle >= (st.interval or PROBE_EVERY) * n:
                sizes[i], st.idle, st.drafting, st.out = caps[i], 0, True, "probe"
            elif sure and not st.sure_wait:
                sizes[i], confident[i], st.drafting = caps[i], True, True
                st.out = "sure"
        idle = all(k == 1 for k in sizes) and self._steps_to_probe(states, kept, off) > WARM_STEPS
        explore = self._explore(states, sizes)
        return self._with_forced(StepPlan(sizes, confident, idle, off, explore=explore), states)

    def _explore(self, states: Sequence[ReqSpec], sizes: list[int]) -> list[bool] | None:
        """Which requests draft their whole budget, uncut by the drafter's cost estimate, so
        that the cost of a bigger tree gets timed: every probe, and every EXPLORE_EVERY steps
        one drafting request of a self-sized drafter whose budget reaches rows the curve has
        no data for (else a curve that overprices big trees keeps them from ever running)."""
        if not self.learn_cost:
            return None
        flags = [st.out in ("global", "probe") for st in states]
        self.since_explore += 1
        if self.sizes.self_sized and self.since_explore >= EXPLORE_EVERY:
            rows = len(states) - 1
            for i, n in enumerate(sizes):
                if n > 1 and not flags[i] and not self.cost.knows(rows + n):
                    flags[i], self.since_explore = True, 0
                    break
        return flags if any(flags) else None

    def _with_forced(self, plan: StepPlan, states: Sequence[ReqSpec]) -> StepPlan:
        """A constrained request gets FORCED_NODES slots at least: the tokens its grammar
        forces are drafted for free (their acceptance is near certain, and a slot they do not
        use costs nothing); its drafter keeps the plan's share."""
        if not any(s.constrained for s in states):
            return plan
        slots = [max(n, FORCED_NODES) if s.constrained else n
                 for n, s in zip(plan.sizes, states)]
        return plan._replace(sizes=slots, drafts=list(plan.sizes), idle=False)

    def _global_probe(self, states: Sequence[ReqSpec], short: list[int]) -> int | None:
        """The request that probes for the whole server this step, if one is due: of those
        planned below their cap, the one kept back longest (a probe that could not draft would
        teach nothing, so it waits for one)."""
        self.since_global += 1
        if self.since_global < self.global_interval or not short:
            return None
        self.since_global = 0
        return max(short, key=lambda i: states[i].idle)

    def _steps_to_probe(self, states: Sequence[ReqSpec], kept: list[int], off: bool) -> int:
        if off:
            return self.global_interval - self.since_global
        n = len(states)
        return min(((states[i].interval or PROBE_EVERY) * n - states[i].idle for i in kept),
                   default=MAX_PROBE_INTERVAL * n)

    # ---- what happened --------------------------------------------------------------------
    def observe(self, states: Sequence[ReqSpec], infos: Sequence[dict], step_s: float,
                forward: tuple[int, float] | None = None) -> None:
        """A decode step's outcome: per request its `drafted` and `accepted` drafts; the step's
        time teaches the costs (plain steps t1, drafting steps the extra per drafting request),
        and its target forward (rows, seconds) the curve, before any probe of it is judged."""
        if forward is not None and self.learn_cost:
            self.cost.add(*forward)
            self._reconsider(len(states))
        rows, drafting, outcomes = len(states), 0, []
        for st, info in zip(states, infos):
            drafted, accepted = info["drafted"], info["accepted"]
            rows += drafted
            if drafted <= 0 or (st.constrained and not st.drafting):
                # no draft (no n-gram match, or no budget), or only the tokens a grammar
                # forced: nothing learned of the drafter
                continue
            drafting += 1
            st.last_accepted = accepted
            update(st, drafted, accepted, DECAY)
            update(self.prior, drafted, accepted, PRIOR_DECAY)
            if self.sizes.self_sized and st.out != "sure":
                self.self_sized_nodes += COST_WEIGHT * (drafted - self.self_sized_nodes)
            if st.out:
                outcomes.append((st, accepted >= self.bar(len(states), 1 + drafted)))
        if any(st.out in ("global", "probe") for st, _ in outcomes) and self.t1 is not None:
            extra = max(0.0, step_s - self.t1 * self.curve(len(states)))
            self.probe_s = extra if self.probe_s is None else (
                self.probe_s + COST_WEIGHT * (extra - self.probe_s))
        for st, paid in outcomes:
            self._learn_outcome(st, paid, len(states))
        self._measure(len(states), rows, drafting, step_s,
                      forward[1] if forward is not None and self.learn_cost else None)

    def cost_interval(self, batch_size: int) -> int:
        """Steps between probes that do not pay, at least, so that they take at most
        PROBE_SHARE of the decode time (0 until a probe was timed)."""
        if not self.probe_s or not self.t1:
            return 0
        plain = self.t1 * self.curve(batch_size)
        return min(MAX_COST_INTERVAL, int(self.probe_s / (PROBE_SHARE * plain)))

    def _learn_outcome(self, st: ReqSpec, paid: bool, batch_size: int) -> None:
        """A probe or a sure draft that paid resets its interval; one that did not doubles it,
        and waits at least as long as PROBE_SHARE allows for the probes' cost."""
        if st.out in ("global", "probe") and not paid:
            self._backed_off_under = self.curve
        if st.out == "global":
            self.global_interval = PROBE_EVERY if paid else max(
                min(2 * self.global_interval, MAX_PROBE_INTERVAL), self.cost_interval(batch_size))
            if paid and self.learn_cost:
                # won back: requests plan by their own estimates for PROBE_EVERY steps, and
                # their drafting steps teach the server-wide one whether it pays again
                self.won_back = PROBE_EVERY
        elif st.out == "probe":
            # (each of the batch's requests probes once per interval x batch size steps)
            st.interval = PROBE_EVERY if paid else max(
                min(2 * (st.interval or PROBE_EVERY), MAX_PROBE_INTERVAL),
                self.cost_interval(batch_size))
        elif paid:
            st.sure_interval = 0
        else:  # sure drafts that fail (a penalty that forbids copying) wait, doubling
            st.sure_interval = min(2 * st.sure_interval or 2, MAX_PROBE_INTERVAL)
            st.sure_wait = st.sure_interval
        st.out = ""

    def _measure(self, batch_size: int, rows: int, drafting: int, step_s: float,
                 forward_s: float | None) -> None:
        """t1 from plain steps (a log-space EMA whose steps are clipped: one slow step moves it
        little); a drafting request's extra seconds as the median of the last steps': their
        time outside the target forward beyond a plain step's, where the forward was timed."""
        if not drafting:
            t = step_s / self.curve(batch_size)
            self.t1 = t if self.t1 is None else toward(self.t1, t)
            if forward_s is not None:
                o = max(step_s - forward_s, 1e-6)
                self.outside = o if self.outside is None else toward(self.outside, o)
        elif self.t1 is not None:
            if forward_s is not None and self.outside is not None:
                d = (step_s - forward_s - self.outside) / drafting
            else:
                d = (step_s - self.t1 * self.curve(rows)) / drafting
            self._draft.append(max(0.0, d))
            self.draft_s = statistics.median(self._draft)

    # ---- the cost, learned ----------------------------------------------------------------
    def _reconsider(self, batch_size: int) -> None:
        """After the curve moved: if a tree of the base size, or of a probe's (the cap),
        now breaks even on RECONSIDER_MARGIN fewer accepted drafts than when a probe interval
        last grew, every back-off starts again (the server-wide interval now, each request's
        at its next plan: `epoch`)."""
        curve, old = self.curve, self._backed_off_under
        if curve is old:
            return
        delta = self.delta
        for nodes in (self.sizes.base, self.sizes.alone):
            before = break_even(old, batch_size, nodes, delta)
            now = break_even(curve, batch_size, nodes, delta)
            if now < before - RECONSIDER_MARGIN * abs(before):
                self.global_interval = max(PROBE_EVERY, self.cost_interval(batch_size))
                self.epoch += 1
                self._backed_off_under = curve
                return

    def curve_update(self) -> VerifyCost | None:
        """The curve, when it moved by CURVE_RESEND since the runner's drafter last got it."""
        curve = self.curve
        if curve is self._sent:
            return None
        moved = max(abs(math.log(curve(n) / self._sent(n))) for n in curve.rows)
        if moved < math.log(CURVE_RESEND):
            return None
        self._sent = curve
        return curve

    def remeasure_rows(self) -> list[int] | None:
        """Row counts to time the prior at again (while the server is idle) when a bucket of
        the live estimate disagrees with it by more than REMEASURE_MARGIN; at most once per
        REMEASURE_EVERY timed forwards, the wait doubling after each measurement."""
        c = self.cost
        if not self.learn_cost or c.samples < self._remeasure_at or \
                c.disagreement() <= REMEASURE_MARGIN:
            return None
        self._remeasures += 1
        self._remeasure_at = c.samples + REMEASURE_EVERY * 2 ** self._remeasures
        top = max(16, 2 * c.learned_rows())
        return sorted({n for n in c.prior.rows if n <= top} | {1})

    def cost_info(self) -> dict:
        """For /server_info: the curve planned with, its prior and the forwards behind it."""
        return {"verify_cost": self.curve.to_dict(), "verify_cost_prior": self.cost.prior.to_dict(),
                "verify_cost_timed_forwards": self.cost.samples}

    def set_prior(self, measured: VerifyCost) -> None:
        """The prior timed again on its first rows; past them, the old one's shape."""
        self.cost.set_prior(extend_curve(measured, self.cost.prior))
