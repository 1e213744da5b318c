"""The verify-cost curve C(n) = T(n) / T(1) learned from the forwards the server really runs.

The start-up curve (specserve/runtime/verify_cost.py) is one measurement of a few seconds, and
the machine may have been busy then: timed while two other servers were loading their models it
read C(4) = 1.79 where the same machine alone read 1.24, and a planner that trusted it for the
server's life judged that no draft pays. So the controller plans with `LiveCost.curve`: the
start-up curve (the prior) where the server has not been, corrected at every row count whose
target forwards the runner timed (`BatchResult.forward_rows` / `target_s`).

The model, in log seconds: a forward over n rows takes s + c(n), where s, the one-row forward's
time now, drifts with the machine's load (memory bandwidth swings 2x between hours), and
c(n) = log C(n) is the curve's shape. Contention only ever slows a forward down, so every
window is read at its lower quartile (`low`): a neighbour's bursts move nothing until they are
three quarters of a window, and a curve read low prices drafts a little cheap rather than
switching them off.
- s: the last one-row forwards (c(1) = 0 by definition); where none ran lately (a busy server
  never runs one row), the last forwards of any size less their c. When one-row forwards
  arrive, every bucket is moved to their level (the first forwards had only a guess).
- c, per bucket (every row count up to EXACT_ROWS, where small batches plan; beyond, the
  nearest of a grid of ratio sqrt(2), a forward moved there along the prior's slope): the last
  values of log T - s. It replaces the prior from the bucket's first forward on; until it has
  FIRM forwards it is taken at most at what the firm buckets around it say, so one slow forward
  cannot price a tree size out of the plan (which would then never time it again).
- A bucket without data takes the correction log(live / prior) of its neighbours (linear in log
  rows between buckets with data; past the last one, that one's), and the curve never falls
  with n: the prior keeps the shape where the server never went, live data sets its level.
- The curve is rebuilt only when its inputs moved (REBUILD_TOLERANCE): the controller reads it
  every step, and an unchanged object lets it skip reconsidering and resending.
"""

from __future__ import annotations

import bisect
import math
from collections import deque

from specserve.runtime.verify_cost import VerifyCost

WINDOW = 9  # forwards per bucket (and for s) that its value is read from
FIRM = 3  # forwards a bucket needs to stand on its own
EXACT_ROWS = 16  # a bucket per row count up to here, then a grid of ratio sqrt(2)
STALE_ONES = 64  # forwards after the last one-row forward, beyond which it no longer sets s
# the prior is measured again (when the server is idle) once a bucket of this many forwards
# disagrees with it by more than this factor
REMEASURE_SAMPLES = 5
REMEASURE_MARGIN = 1.25
# the curve is rebuilt (and the controller re-plans under it) only once its inputs moved by
# more than this in log seconds: a step's forward mostly leaves them where they were
REBUILD_TOLERANCE = 0.005


class LiveCost:
    """See the module docstring. `add` a timed forward; `curve` is the current estimate."""

    def __init__(self, prior: VerifyCost) -> None:
        self.samples = 0
        self.ones: deque[float] = deque(maxlen=WINDOW)  # log T(1)
        self.last_one = -STALE_ONES - 1  # the sample number of the last one-row forward
        self.levels: deque[float] = deque(maxlen=WINDOW)  # log T - c, any size
        self.buckets: dict[int, deque[float]] = {}  # bucket rows -> recent log T - s
        self.set_prior(prior)

    def set_prior(self, prior: VerifyCost) -> None:
        """The prior, measured again: the data stay."""
        self.prior = prior
        self._curve: VerifyCost | None = None
        self._key: tuple | None = None  # the inputs `_curve` was built from
        self._checked = -1  # `samples` when the inputs were last compared

    # ---- data ---------------------------------------------------------------------------
    def add(self, rows: int, seconds: float) -> None:
        """One target forward over `rows` rows (summed over the batch) took `seconds`."""
        if rows < 1 or not seconds > 0.0:
            return
        self.samples += 1
        g = self._bucket(rows)
        v = math.log(seconds) - (self._p(rows) - self._p(g))  # moved to bucket g
        if g == 1:
            self._add_one(v)
        else:
            s = self.level()
            if s is None:  # the very first forward: the prior's ratio, until data say more
                s = v - self._p(g)
            self.buckets.setdefault(g, deque(maxlen=WINDOW)).append(v - s)
            self.levels.append(v - low(self.buckets[g]))

    def _add_one(self, v: float) -> None:
        guessed = None if self._ones_fresh() else self.level()
        self.ones.append(v)
        self.levels.append(v)
        self.last_one = self.samples
        if guessed is not None:  # the buckets' values were relative to a guessed level
            shift = guessed - self.level()
            for g, values in self.buckets.items():
                self.buckets[g] = deque((x + shift for x in values), maxlen=WINDOW)

    def _ones_fresh(self) -> bool:
        return bool(self.ones) and self.samples - self.last_one <= STALE_ONES

    def level(self) -> float | None:
        """s: log seconds of a one-row forward now (None before any forward)."""
        if self._ones_fresh():
            return low(self.ones)
        return low(self.levels) if self.levels else None

    def corrections(self) -> dict[int, float]:
        """log(live / prior) at every bucket with data (bucket 1: 0, by definition); a bucket
        of fewer than FIRM forwards at most what its firm neighbours say."""
        firm, tentative = {1: 0.0}, {}
        for g, values in self.buckets.items():
            (firm if len(values) >= FIRM else tentative)[g] = low(values) - self._p(g)
        known = sorted(firm)
        out = dict(firm)
        for g, c in tentative.items():
            out[g] = min(c, self._fill(g, known, firm))
        return out

    def learned_rows(self) -> int:
        """The largest row count the estimate rests on data for (1: none beyond one row)."""
        return max(self.buckets, default=1)

    def knows(self, rows: int) -> bool:
        """Whether the curve at `rows` lies between buckets with data (not extrapolated)."""
        return self._bucket(rows) <= self.learned_rows()

    def disagreement(self) -> float:
        """The largest factor between live and prior over buckets of REMEASURE_SAMPLES
        forwards or more (1.0: none)."""
        worst = 0.0
        for g, values in self.buckets.items():
            if len(values) >= REMEASURE_SAMPLES:
                worst = max(worst, abs(low(values) - self._p(g)))
        return math.exp(worst)

    # ---- the curve ----------------------------------------------------------------------
    @property
    def curve(self) -> VerifyCost:
        if self._curve is not None and self._checked == self.samples:
            return self._curve  # no forward since the last look
        self._checked = self.samples
        key = self._inputs()
        if self._curve is None or not _close(key, self._key):
            self._curve, self._key = self._build(), key
        return self._curve

    def _inputs(self) -> tuple:
        """What the curve is built from: the level, and each bucket's value and firmness."""
        return (self.level(), {g: (low(v), len(v) >= FIRM) for g, v in self.buckets.items()})

    def _build(self) -> VerifyCost:
        corr = self.corrections()
        if len(corr) == 1:
            return self.prior  # nothing learned beyond one row: the prior's shape is all
        known = sorted(corr)
        rows = tuple(sorted(set(self.prior.rows) | set(known)))
        ratios, top = [], 1.0
        for n in rows:
            top = max(top, math.exp(self._p(n) + self._fill(n, known, corr)))
            ratios.append(top)
        ratios[0] = 1.0
        s = self.level()
        return VerifyCost(rows, tuple(ratios), f"learned from {self.samples} timed forwards "
                          f"over the prior ({self.prior.source})",
                          math.exp(s) if s is not None else self.prior.t1_s)

    def _fill(self, n: int, known: list[int], corr: dict[int, float]) -> float:
        """The correction at bucket n: its own, or its neighbours' (linear in log rows)."""
        j = bisect.bisect_left(known, n)
        if j < len(known) and known[j] == n:
            return corr[n]
        if j == len(known):
            return corr[known[-1]]
        lo, hi = known[j - 1], known[j]
        w = (math.log(n) - math.log(lo)) / (math.log(hi) - math.log(lo))
        return corr[lo] + w * (corr[hi] - corr[lo])

    @staticmethod
    def _bucket(rows: int) -> int:
        """The bucket a forward of `rows` rows counts in."""
        if rows <= EXACT_ROWS:
            return rows
        k = round(2.0 * math.log2(rows / EXACT_ROWS))
        return round(EXACT_ROWS * 2.0 ** (k / 2.0))

    def _p(self, n: int) -> float:
        return math.log(self.prior(n))


def _close(a: tuple, b: tuple | None) -> bool:
    """Whether two `_inputs` differ by at most REBUILD_TOLERANCE everywhere."""
    if b is None or (a[0] is None) != (b[0] is None) or a[1].keys() != b[1].keys():
        return False
    if a[0] is not None and abs(a[0] - b[0]) > REBUILD_TOLERANCE:
        return False
    return all(f == b[1][g][1] and abs(x - b[1][g][0]) <= REBUILD_TOLERANCE
               for g, (x, f) in a[1].items())


def low(values: deque[float]) -> float:
    """A window's lower quartile (its least value below four)."""
    return sorted(values)[(len(values) - 1) // 4]
