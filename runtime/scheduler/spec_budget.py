"""How many draft-tree nodes each decoding request gets this step: load-aware speculation.

A step's forward costs T(rows), rows summed over the batch (each request's root plus its draft
nodes). Its yield is the tokens it produces: per request 1 + the accepted drafts. Speculation
pays only while the extra expected tokens outgrow the extra cost, and on a compute-bound engine
T grows almost linearly past a few rows, so a busy batch should draft little or nothing.

The policy (`plan_drafts`) maximises expected tokens per unit of step time:

    rate(sizes) = sum_i E_i(n_i) / T(sum_i n_i)

with request i's nodes n_i in [1, cap_i]. E_i is the chain model: the k-th draft node is accepted
with probability a_i^k, so a node's marginal yield is a_i^(n_i) and E_i(n) = sum_{k<n} a_i^k.
Nodes are handed out greedily in order of marginal yield (the order that maximises the yield of
every total); the best total is kept (T is measured, not convex, so every total is scored).
With no draft worth its cost, every request gets 1 node: plain decoding. Requests kept at 1
node are probed (their full cap) once every PROBE_EVERY * B steps (`with_probes`), so their
acceptance estimate follows the text.

`a_i` comes from the request's own verify outcomes (`Acceptance`): accepted drafts over accepted
drafts plus rejections (the maximum-likelihood rate of a geometric run), decayed so it follows
the text; trees are treated as chains of the same effective rate. Draft-model cost is not in T
here: the runner's speculative worker measures it (seconds of drafting per drafting request)
and backs a request off while its accepted drafts per step do not pay for it
(speculative/worker.py, `break_even`).

T(n)/T(1) is the curve the runner measured at start-up on this machine
(`runtime/verify_cost.py`; the stored per-engine tables are the fallback).
"""

from __future__ import annotations

import heapq
from dataclasses import dataclass

from runtime.verify_cost import VERIFY_COST, VerifyCost  # noqa: F401 - re-exported


@dataclass(slots=True)
class Acceptance:
    """A request's running draft-acceptance rate: decayed counts of accepted drafts and of
    rejections (a verify step that accepted fewer drafts than it was shown)."""

    accepted: float = 1.0  # prior: one accept, one reject (a = 0.5) until the request shows
    rejected: float = 1.0
    decay: float = 0.9  # ~10 drafting steps of memory: acceptance comes in bursts
    idle: int = 0  # decode steps since the budget last let it draft (for probes)

    @property
    def rate(self) -> float:
        return self.accepted / (self.accepted + self.rejected)

    def update(self, drafted: int, accepted: int) -> None:
        if drafted <= 0:
            return  # nothing drafted (no n-gram match, or no budget): nothing learned
        self.accepted = self.decay * self.accepted + accepted
        self.rejected = self.decay * self.rejected + (1.0 if accepted < drafted else 0.0)


# A request the budget keeps at 0 drafts learns nothing new about its acceptance (the rate only
# moves on verify outcomes), so it is given its full cap once every PROBE_EVERY * B steps (B =
# the decoding batch): the batch as a whole probes about once per PROBE_EVERY steps.
PROBE_EVERY = 16


def with_probes(sizes: list[int], caps: list[int], accs: list[Acceptance]) -> list[int]:
    """`sizes` with the probes that are due (see PROBE_EVERY); updates each `idle` count."""
    out = list(sizes)
    due = PROBE_EVERY * len(sizes)
    for i, acc in enumerate(accs):
        if out[i] > 1 or caps[i] <= 1:
            acc.idle = 0
            continue
        acc.idle += 1
        if acc.idle >= due:
            out[i], acc.idle = caps[i], 0
    return out


def plan_drafts(rates: list[float], caps: list[int], cost: VerifyCost) -> list[int]:
    """Nodes per request (root included, 1 = no draft, <= caps[i]) maximising expected tokens
    per unit of step time under `cost`; see the module docstring."""
    sizes = [1] * len(rates)
    if not sizes:
        return sizes
    rows, tokens = len(sizes), float(len(sizes))
    best_rate, best_rows = tokens / cost(rows), rows
    order: list[tuple[float, int]] = []  # nodes in hand-out order (heap of marginal yields)
    heap = [(-a, i) for i, a in enumerate(rates) if caps[i] > 1 and a > 0.0]
    heapq.heapify(heap)
    while heap:
        neg_gain, i = heapq.heappop(heap)
        sizes[i] += 1
        rows += 1
        tokens -= neg_gain
        order.append((-neg_gain, i))
        rate = tokens / cost(rows)
        if rate > best_rate:
            best_rate, best_rows = rate, rows
        if sizes[i] < caps[i]:
            heapq.heappush(heap, (neg_gain * rates[i], i))  # next node: a_i^(n_i)
    out = [1] * len(rates)
    for _, i in order[: best_rows - len(rates)]:
        out[i] += 1
    return out
