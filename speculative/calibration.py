"""Acceptance calibration: what a drafter's node probabilities are worth, measured online.

A model-free drafter estimates a draft node's chance of acceptance from counts (SUFFIX: the
product of count / total along its path). Those estimates are optimistic where the counts are
few: a continuation seen once scores 1.0. Replaying the schema train split
(`python -m benchmark.replay_ngram results/train_schema.json --configs SUFFIX --calibration`,
docs/benchmarks.md) nodes estimated at 1.0 were accepted 66% of the time and those at 0.5
12%. A batch-aware cut (`SuffixDrafter.worth_drafting`) that trusts such numbers drafts rows
that do not pay, most of all in busy batches where every row costs a token's share of the step.

`AcceptCalibration` learns, per (tree depth, estimate in tenths) cell, how many of the nodes
drafted there were accepted against how many the estimates expected, from every verified
draft the server makes, and scales an estimate by that cell's ratio: est * (A + k) / (E + k),
A the nodes accepted, E the sum of their estimates, k a prior mass (an empty cell leaves the
estimate as it is). Old evidence decays (the workload moves). Ratings never fall as the
estimate rises (a cell is capped by every higher cell of its depth), and a node is never
rated above its parent, so a best-first list re-sorted by them still has parents first and
the top depth-1 rating bounds every node of any tree (`best_first_level`: a busy batch skips
the lookups when not even a chain of such nodes would pay).
It only decides which nodes are worth verifying: verification stays exact whatever is drafted.
"""

from __future__ import annotations

from collections.abc import Sequence

# estimate cells: tenths of [0, 1]; depths 1 .. MAX_DEPTH (deeper shares the last cell)
BUCKETS = 10
MAX_DEPTH = 8
# prior mass: a cell's first few nodes move the estimate little
PRIOR = 4.0
# every DECAY_EVERY recorded nodes, all evidence is scaled by DECAY (memory ~ 8.5k nodes)
DECAY_EVERY = 256
DECAY = 0.97
# the ratings are rebuilt from the evidence once this many nodes were recorded since
REFRESH_EVERY = 32


def tree_depths(parents: Sequence[int]) -> list[int]:
    """Depth of every node of a parents-first tree (root 0)."""
    depth = [0] * len(parents)
    for i in range(1, len(parents)):
        depth[i] = depth[parents[i]] + 1
    return depth


class AcceptCalibration:
    __slots__ = ("accepted", "expected", "_since_decay", "recorded", "_table", "_stale")

    def __init__(self) -> None:
        self.accepted = [[0.0] * BUCKETS for _ in range(MAX_DEPTH)]
        self.expected = [[0.0] * BUCKETS for _ in range(MAX_DEPTH)]
        self._since_decay = 0
        self.recorded = 0  # nodes recorded in all (for tests and reports)
        # per depth: (factor per bucket, cap per bucket), rebuilt once REFRESH_EVERY nodes
        # were recorded since (a step's evidence barely moves it; drafting reads it often)
        self._table: list[tuple[list[float], list[float]]] | None = None
        self._stale = 0

    @staticmethod
    def _cell(depth: int, est: float) -> tuple[int, int]:
        return min(max(depth, 1), MAX_DEPTH) - 1, min(int(est * BUCKETS), BUCKETS - 1)

    def factor(self, depth: int, est: float) -> float:
        d, b = self._cell(depth, est)
        return (self.accepted[d][b] + PRIOR) / (self.expected[d][b] + PRIOR)

    def _rows(self) -> list[tuple[list[float], list[float]]]:
        """Per depth, each cell's factor and its cap: the lowest rating any higher cell of
        the depth gives (at its lower edge; the top cell: its rating of 1.0), so ratings never
        fall as the estimate rises: a continuation counted less often is never rated above a
        likelier one."""
        if self._table is None or self._stale >= REFRESH_EVERY:
            table = []
            for acc, exp in zip(self.accepted, self.expected):
                factors = [(a + PRIOR) / (e + PRIOR) for a, e in zip(acc, exp)]
                caps = [0.0] * BUCKETS
                cap = min(1.0, factors[-1])
                for b in range(BUCKETS - 1, -1, -1):
                    caps[b] = cap
                    cap = min(cap, b / BUCKETS * factors[b])
                table.append((factors, caps))
            self._table, self._stale = table, 0
        return self._table

    def rate(self, depth: int, est: float) -> float:
        d, b = self._cell(depth, est)
        factors, caps = self._rows()[d]
        return min(est * factors[b], caps[b])

    def best_first_level(self) -> float:
        """The highest rating a depth-1 node can get now (ratings rise with the estimate, and
        a deeper node is rated at most its depth-1 ancestor's): a bound for a whole tree."""
        return self.rate(1, 1.0)

    def calibrate(self, parents: Sequence[int], probs: Sequence[float]) -> list[float]:
        """Calibrated probabilities of a parents-first tree's nodes (root 1.0), each at most
        its parent's."""
        rows = self._rows()
        depth = [0] * len(parents)
        out = [1.0] * len(probs)
        for i in range(1, len(probs)):
            d = depth[i] = depth[parents[i]] + 1
            est = probs[i]
            factors, caps = rows[min(d, MAX_DEPTH) - 1]
            b = min(int(est * BUCKETS), BUCKETS - 1)
            out[i] = min(est * factors[b], caps[b], out[parents[i]])
        return out

    def record(self, tokens: Sequence[int], parents: Sequence[int], probs: Sequence[float],
               committed: Sequence[int]) -> None:
        """One verified draft: the tree (parents first, root = tokens[0]) with the estimates
        it was drafted with, and the tokens the step committed after the root. A node was
        accepted when its path is a prefix of the committed tokens short of the last one
        (that one is the target's own token, never a draft)."""
        n = len(tokens)
        if n <= 1:
            return
        depth = tree_depths(parents)
        on = [True] + [False] * (n - 1)
        usable = len(committed) - 1
        for i in range(1, n):
            d = depth[i]
            on[i] = on[parents[i]] and d <= usable and tokens[i] == committed[d - 1]
            r, b = self._cell(d, probs[i])
            self.accepted[r][b] += on[i]
            self.expected[r][b] += probs[i]
        self.recorded += n - 1
        self._stale += n - 1
        self._since_decay += n - 1
        if self._since_decay >= DECAY_EVERY:
            self._since_decay = 0
            for row in (*self.accepted, *self.expected):
                for j in range(BUCKETS):
                    row[j] *= DECAY


def best_first_order(probs: Sequence[float]) -> list[int]:
    """Node order of a tree whose probabilities never exceed a parent's, best first (root
    first; stable, so equal values keep their order and a parent still precedes its
    children)."""
    return [0] + sorted(range(1, len(probs)), key=lambda i: -probs[i])


def reorder(order: list[int], tokens: Sequence[int], parents: Sequence[int],
            *values: Sequence[float]) -> tuple[list, ...]:
    """(tokens, parents, *values) of a tree with its nodes in `order` (parents first)."""
    where = {old: new for new, old in enumerate(order)}
    return ([tokens[i] for i in order], [-1] + [where[parents[i]] for i in order[1:]],
            *([v[i] for i in order] for v in values))
