"""The speculation controller: which requests draft this step, and how many tree nodes each.

It runs in the scheduler (which hands out the KV slots the trees need) and is the only place
that decides how much to draft; the speculative worker drafts what it is given and reports what
was accepted and how long the step took.

What a step yields and costs. A decode step of B requests yields B tokens plus the accepted
drafts, and costs T(rows) = t1 * C(rows) seconds of target forward, rows summed over the batch
(each request's root plus its draft nodes; C is the verify-cost curve measured on this machine
at start-up, specserve/runtime/verify_cost.py) plus d seconds per request that drafted (`draft_s`:
the drafter's own work, a draft model's forwards, the tree mask, verification, the commit; measured
from the steps' times). The plan maximises expected tokens per second:

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

What the drafter is decides the rest (specserve/speculative/base.py, `Drafter.tree_sizes`): the caps
(a request decoding alone may go deeper), whether it sizes its own trees by its node estimates (then
a request drafts while its expected accepted drafts, a / (1 - a), pay a tree of the size such trees
keep on average; it gets its whole cap and the drafter cuts it with the same curve, `best_prefix`),
and whether it can tell a sure draft from a guess (then a request the plan keeps at one node still
drafts what the drafter is sure of; a sure draft whose accepted drafts did not pay the rows it
drafted makes the request wait, doubling).
"""

from __future__ import annotations

import heapq
from collections.abc import Sequence
from dataclasses import dataclass

from specserve.runtime.speculation import StepPlan
from specserve.runtime.verify_cost import VerifyCost


@dataclass(frozen=True)
class TreeSizes:
    """A drafter's tree sizes and what it can judge itself (`Drafter.tree_sizes`)."""

    base: int  # tree nodes per request per step, root included
    alone: int  # the most a request may get while it decodes alone (the curve's flat part)
    # any request alone may get `alone` (the drafter sizes trees by how long its context match
    # is and leaves what it does not use); otherwise only one whose last step accepted a whole
    # base-size draft (it is copying)
    deep_for_all: bool = False
    self_sized: bool = False  # cuts each tree itself by its node estimates (`best_prefix`)
    judges_confidence: bool = False  # can draft only what it is sure of


@dataclass(slots=True)
class ReqSpec:
    """The controller's record of one request (kept on the scheduler's `Req.spec`)."""

    accepted: float  # decayed accepted drafts ...
    rejected: float  # ... and rejections: the acceptance estimate is their ratio
    last_accepted: int = 0  # drafts accepted by its last verify step
    idle: int = 0  # steps kept at one node while it could have drafted
    interval: int = 0  # probe interval (x batch size); 0 until the first probe
    # sure drafts (`TreeSizes.judges_confidence`) that kept failing wait this many steps
    sure_wait: int = 0
    sure_interval: int = 0
    # what its last plan gave it beyond the estimate (a probe, the server-wide probe, a sure
    # draft): whether its accepted drafts paid the rows it drafted sets the next interval
    out: str = ""
    constrained: bool = False  # it follows a grammar: slots for the tokens the grammar forces
    drafting: bool = False  # its last plan gave its drafter nodes (not only forced tokens)

    @property
    def rate(self) -> float:
        return self.accepted / (self.accepted + self.rejected)


DECAY = 0.9  # ~10 drafting steps of memory: acceptance comes in bursts
PRIOR_DECAY = 0.98  # the server-wide estimate pools every request's drafting steps
PRIOR_WEIGHT = 2.0  # a new request starts from the server-wide rate, worth two outcomes
PROBE_EVERY = 16  # a kept-back request's first probe interval (x batch size)
MAX_PROBE_INTERVAL = 512
WARM_STEPS = 8  # steps before a server-wide probe that run the drafter (fresh head state)
COST_WEIGHT = 0.2  # EMA weight of a step's measured times
PROBE_SHARE = 0.02  # of the decode time, the most that probes which do not pay may take
MAX_COST_INTERVAL = 4096  # (steps) the longest wait that PROBE_SHARE may impose
FORCED_NODES = 8  # slots of a constrained request, at least (grammar-forced tokens)
# a self-sized drafter's request drafts while it expects at least this many accepted drafts
# per step, whatever the measured cost says (the cost is unknown until drafting steps ran)
MIN_GAIN = 0.2


def expected_gain(rate: float) -> float:
    """Accepted drafts per drafting step of a request of this acceptance estimate (the mean
    of the geometric run the chain model assumes)."""
    return float("inf") if rate >= 1.0 else rate / (1.0 - rate)


def update(counts: ReqSpec | list[float], drafted: int, accepted: int, decay: float) -> None:
    """One verify outcome into decayed (accepted, rejected) counts: a rejection is a step that
    accepted fewer drafts than it was shown (the maximum-likelihood rate of a geometric run)."""
    rejected = 1.0 if accepted < drafted else 0.0
    if isinstance(counts, ReqSpec):
        counts.accepted = decay * counts.accepted + accepted
        counts.rejected = decay * counts.rejected + rejected
    else:
        counts[0] = decay * counts[0] + accepted
        counts[1] = decay * counts[1] + rejected


def plan_drafts(rates: Sequence[float], caps: Sequence[int], cost: VerifyCost,
                delta: float = 0.0) -> list[int]:
    """Nodes per request (root included, 1 = no draft, <= caps[i]) maximising expected tokens
    per unit of step time, C(rows) + delta per drafting request (see the module docstring)."""
    sizes = [1] * len(rates)
    if not sizes:
        return sizes
    rows, tokens, drafting = len(sizes), float(len(sizes)), 0
    best_rate, best_rows = tokens / cost(rows), rows
    order: list[int] = []  # requests in node hand-out order (heap of marginal yields)
    heap = [(-a, i) for i, a in enumerate(rates) if caps[i] > 1 and a > 0.0]
    heapq.heapify(heap)
    while heap:
        neg_gain, i = heapq.heappop(heap)
        drafting += sizes[i] == 1
        sizes[i] += 1
        rows += 1
        tokens -= neg_gain
        order.append(i)
        rate = tokens / (cost(rows) + delta * drafting)
        if rate > best_rate:
            best_rate, best_rows = rate, rows
        if sizes[i] < caps[i]:
            heapq.heappush(heap, (neg_gain * rates[i], i))  # next node: a_i^(n_i)
    out = [1] * len(rates)
    for i in order[: best_rows - len(rates)]:
        out[i] += 1
    return out


def best_prefix(probs: Sequence[float], batch_size: int, cost: VerifyCost | None,
                delta: float = 0.0) -> int:
    """Nodes (root included) of a best-first tree worth verifying, from the drafter's own
    estimate of each node's acceptance (`probs[0]` is the root): the prefix that maximises the
    step's expected tokens per cost, beside `batch_size - 1` one-row requests:
    (B + sum of its drafts' probabilities) / (C(B - 1 + nodes) + delta). None: every node."""
    if cost is None or len(probs) <= 1:
        return len(probs)
    others = max(batch_size, 1) - 1
    best_k, best_rate, tokens = 1, (others + 1) / cost(others + 1), others + 1.0
    for k in range(2, len(probs) + 1):
        tokens += probs[k - 1]
        rate = tokens / (cost(others + k) + delta)
        if rate > best_rate:
            best_k, best_rate = k, rate
    return best_k


class SpecController:
    """See the module docstring. `adaptive=False` (--speculative-disable-adaptive): every
    request gets its cap every step."""

    def __init__(self, sizes: TreeSizes, curve: VerifyCost, adaptive: bool = True) -> None:
        self.sizes = sizes
        self.curve = curve
        self.adaptive = adaptive
        self.base_nodes = sizes.base
        self.reset()
        # seconds of a one-row forward (EMA over plain steps, starting from the start-up
        # timing), and a drafting request's extra seconds beyond its verify rows (EMA)
        self.t1: float | None = curve.t1_s
        self.draft_s: float | None = None
        # a probe step's seconds beyond a plain step of the same batch (EMA over probes)
        self.probe_s: float | None = None

    def reset(self) -> None:
        """Forget what was learned about the traffic (flush_cache); measured costs stay."""
        self.prior = [1.0, 1.0]  # decayed (accepted, rejected) over every request
        self.self_sized_nodes = 2.0  # drafts a self-sized drafter's tree keeps (EMA)
        self.global_interval = PROBE_EVERY
        self.since_global = 0

    @property
    def delta(self) -> float:
        """A drafting request's extra cost in one-row forwards (0 until measured)."""
        if self.draft_s is None or not self.t1:
            return 0.0
        return self.draft_s / self.t1

    def new_request(self, constrained: bool = False) -> ReqSpec:
        a = self.prior[0] / (self.prior[0] + self.prior[1])
        return ReqSpec(PRIOR_WEIGHT * a, PRIOR_WEIGHT * (1.0 - a), constrained=constrained)

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
        confident = [False] * n
        kept = [i for i in range(n) if sizes[i] == 1 and caps[i] > 1]
        probe = self._global_probe(states, kept) if off else None
        sure = self.sizes.judges_confidence and kept and self.pays(1.0, n, max(caps))
        for i in range(n):
            st = states[i]
            st.out = ""
            st.drafting = sizes[i] > 1
            if sizes[i] > 1:
                st.idle = 0
                continue
            if caps[i] <= 1:
                continue
            st.idle += 1
            st.sure_wait = max(st.sure_wait - 1, 0)
            if (i == probe) if off else st.idle >= (st.interval or PROBE_EVERY) * n:
                sizes[i], st.idle, st.drafting = caps[i], 0, True
                st.out = "global" if off else "probe"
            elif sure and not st.sure_wait:
                sizes[i], confident[i], st.drafting = caps[i], True, True
                st.out = "sure"
        idle = all(k == 1 for k in sizes) and self._steps_to_probe(states, kept, off) > WARM_STEPS
        return self._with_forced(StepPlan(sizes, confident, idle, off), states)

    def _with_forced(self, plan: StepPlan, states: Sequence[ReqSpec]) -> StepPlan:
        """A constrained request gets FORCED_NODES slots at least: the tokens its grammar
        forces are drafted for free (their acceptance is near certain, and a slot they do not
        use costs nothing); its drafter keeps the plan's share."""
        if not any(s.constrained for s in states):
            return plan
        slots = [max(n, FORCED_NODES) if s.constrained else n
                 for n, s in zip(plan.sizes, states)]
        return plan._replace(sizes=slots, drafts=list(plan.sizes), idle=False)

    def _global_probe(self, states: Sequence[ReqSpec], kept: list[int]) -> int | None:
        """The request that probes for the whole server this step, if one is due: the one kept
        back longest (a probe that could not draft would teach nothing, so it waits for one)."""
        self.since_global += 1
        if self.since_global < self.global_interval or not kept:
            return None
        self.since_global = 0
        return max(kept, key=lambda i: states[i].idle)

    def _steps_to_probe(self, states: Sequence[ReqSpec], kept: list[int], off: bool) -> int:
        if off:
            return self.global_interval - self.since_global
        n = len(states)
        return min(((states[i].interval or PROBE_EVERY) * n - states[i].idle for i in kept),
                   default=MAX_PROBE_INTERVAL * n)

    # ---- what happened --------------------------------------------------------------------
    def observe(self, states: Sequence[ReqSpec], infos: Sequence[dict], step_s: float) -> None:
        """A decode step's outcome: per request its `drafted` and `accepted` drafts; the step's
        time teaches the costs (plain steps t1, drafting steps the extra per drafting request)."""
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
        self._measure(len(states), rows, drafting, step_s)

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
        if st.out == "global":
            self.global_interval = PROBE_EVERY if paid else max(
                min(2 * self.global_interval, MAX_PROBE_INTERVAL), self.cost_interval(batch_size))
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

    def _measure(self, batch_size: int, rows: int, drafting: int, step_s: float) -> None:
        w = COST_WEIGHT
        if not drafting:
            t = step_s / self.curve(batch_size)
            self.t1 = t if self.t1 is None else self.t1 + w * (t - self.t1)
        elif self.t1 is not None:
            d = max(0.0, step_s - self.t1 * self.curve(rows)) / drafting
            self.draft_s = d if self.draft_s is None else self.draft_s + w * (d - self.draft_s)
