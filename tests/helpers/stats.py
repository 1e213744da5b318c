"""Goodness of fit for the sampling-distribution tests: Pearson's chi-square with its critical
value computed for the actual degrees of freedom (no scipy here), and zero-probability cells
checked on their own: one sample where the target has no mass fails outright.
"""

from __future__ import annotations

import math
from typing import NamedTuple

import torch

ALPHA = 1e-3  # per test; the tests draw with fixed seeds, so a pass is reproducible
MIN_EXPECTED = 5.0  # cells expected below this are pooled into one (Cochran's rule)


def _gamma_p(a: float, x: float) -> float:
    """Regularised lower incomplete gamma P(a, x) (series below a + 1, Lentz continued
    fraction above; both converge to ~1e-15)."""
    if x <= 0:
        return 0.0
    log_front = a * math.log(x) - x - math.lgamma(a)
    if x < a + 1:
        term = total = 1.0 / a
        k = a
        for _ in range(10_000):
            k += 1
            term *= x / k
            total += term
            if abs(term) < abs(total) * 1e-16:
                break
        return total * math.exp(log_front)
    tiny = 1e-300
    b = x + 1 - a
    c, d = 1 / tiny, 1 / b
    h = d
    for i in range(1, 10_000):
        an = -i * (i - a)
        b += 2
        d = an * d + b
        d = tiny if abs(d) < tiny else d
        c = b + an / c
        c = tiny if abs(c) < tiny else c
        d = 1 / d
        delta = d * c
        h *= delta
        if abs(delta - 1) < 1e-16:
            break
    return 1.0 - math.exp(log_front) * h


def chi2_cdf(x: float, dof: int) -> float:
    return _gamma_p(dof / 2.0, x / 2.0)


def chi2_quantile(prob: float, dof: int) -> float:
    """x with chi2_cdf(x, dof) = prob, by bisection (the cdf is increasing)."""
    assert dof >= 1 and 0 < prob < 1
    lo, hi = 0.0, max(10.0, 10.0 * dof)
    while chi2_cdf(hi, dof) < prob:
        hi *= 2
    for _ in range(200):
        mid = (lo + hi) / 2
        lo, hi = (mid, hi) if chi2_cdf(mid, dof) < prob else (lo, mid)
    return (lo + hi) / 2


class Fit(NamedTuple):
    stat: float
    dof: int
    critical: float
    zero_cell_samples: int  # samples that landed where the target has probability 0
    n: int

    @property
    def passed(self) -> bool:
        return self.zero_cell_samples == 0 and self.stat <= self.critical

    def __str__(self) -> str:
        return (f"chi-square {self.stat:.1f} over {self.dof} dof (critical {self.critical:.1f} "
                f"at alpha {ALPHA:g}), {self.zero_cell_samples} of {self.n} samples in "
                f"zero-probability cells")


def goodness_of_fit(counts: torch.Tensor, probs: torch.Tensor, alpha: float = ALPHA) -> Fit:
    """Observed `counts` against target `probs` (same shape, any), n = counts.sum().

    Cells with probability 0 are not part of the statistic: any sample there is a failure of its
    own. Cells expected below MIN_EXPECTED samples are pooled into one cell (merged into the
    smallest regular cell if even the pool stays below it); dof = cells - 1.
    """
    c = counts.flatten().double()
    p = probs.flatten().double()
    p = p / p.sum()
    n = int(c.sum())
    zero = p == 0
    zero_hits = int(c[zero].sum())
    e = p * n
    big = (e >= MIN_EXPECTED) & ~zero
    small = ~big & ~zero
    obs, exp = c[big].tolist(), e[big].tolist()
    pooled_o, pooled_e = float(c[small].sum()), float(e[small].sum())
    if pooled_e > 0:
        if pooled_e >= MIN_EXPECTED or not exp:
            obs.append(pooled_o)
            exp.append(pooled_e)
        else:
            j = min(range(len(exp)), key=exp.__getitem__)
            obs[j] += pooled_o
            exp[j] += pooled_e
    stat = sum((o - x) ** 2 / x for o, x in zip(obs, exp))
    dof = max(len(exp) - 1, 1)
    return Fit(stat, dof, chi2_quantile(1 - alpha, dof), zero_hits, n)
