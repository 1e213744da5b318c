"""The speculation plan's arithmetic: what a drafter's trees may be, the controller's record of
a request, and the pure functions the plan is made of (the chain model's expected gain, a verify
outcome into decayed counts, nodes per request by marginal yield, break-even, a self-sized
drafter's best prefix). The controller (specserve/speculative/controller.py) owns the decisions.
"""

from __future__ import annotations

import heapq
from collections.abc import Sequence
from dataclasses import dataclass

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
    epoch: int = 0  # the controller's cost epoch its intervals were set in (`reconsider`)

    @property
    def rate(self) -> float:
        return self.accepted / (self.accepted + self.rejected)


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


def break_even(curve: VerifyCost, batch_size: int, nodes: float, delta: float) -> float:
    """Accepted drafts a request drafting `nodes` beside `batch_size - 1` one-row requests must
    bring for its step to pay."""
    b = batch_size
    return b * (curve(b - 1 + nodes) + delta) / curve(b) - b


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
