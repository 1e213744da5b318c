"""The verify-cost curve C(n) = T(n) / T(1): what one target forward over n rows costs, in units
of a one-row (decode) forward. Speculation is planned with it everywhere (the scheduler's
speculation controller, specserve/speculative/controller.py, and a drafter that sizes its trees by
cost).

The curve belongs to the machine, not to the code: on the CPU engine T(1) streams the weights
(memory-bound, and memory bandwidth here swings 2x between hours and machines) while each extra
row costs compute, so C(4) was 1.33 on one machine and 2.15 on another. So the
runner measures it at start-up (`measure_verify_cost`: a few seconds of verify forwards over
a 256-token prefix) and every planner uses that; the stored tables below are the
fallback (`--speculative-verify-cost table`, and code that runs without a runner).
"""

from __future__ import annotations

import bisect
import dataclasses
import json
import statistics
import time
from dataclasses import dataclass

import torch


@dataclass(frozen=True)
class VerifyCost:
    """T(n)/T(1) of one forward over n rows; piecewise linear between the measured points,
    linear past the last one (the compute-bound slope)."""

    rows: tuple[int, ...]
    ratios: tuple[float, ...]
    source: str = ""
    # seconds of the one-row forward where the curve was measured on this machine (None for
    # the stored tables): the controller's plain-step cost before any plain step has run
    t1_s: float | None = None

    def __post_init__(self) -> None:
        assert self.rows[0] == 1 and self.ratios[0] == 1.0, "the curve starts at T(1)/T(1) = 1"
        assert list(self.rows) == sorted(set(self.rows)) and len(self.rows) == len(self.ratios)
        assert len(self.rows) >= 2, "a curve needs two points to extrapolate"

    def __call__(self, n: int) -> float:
        rows, ratios = self.rows, self.ratios
        if n <= rows[0]:
            return ratios[0] * n / rows[0]
        j = min(bisect.bisect_left(rows, n), len(rows) - 1)
        x0, x1, y0, y1 = rows[j - 1], rows[j], ratios[j - 1], ratios[j]
        return y0 + (y1 - y0) * (n - x0) / (x1 - x0)

    def to_dict(self) -> dict:
        return {"rows": list(self.rows), "ratios": [round(r, 4) for r in self.ratios],
                "source": self.source, "t1_s": self.t1_s}

    @classmethod
    def from_dict(cls, d: dict) -> VerifyCost:
        t1 = d.get("t1_s")
        return cls(tuple(int(n) for n in d["rows"]), tuple(float(r) for r in d["ratios"]),
                   str(d.get("source", "")), None if t1 is None else float(t1))


# Stored curves (the fallback): `python -m benchmark.bench_one_batch --engines <engine>
# --verify-prefix 256 --verify-ns 1,2,3,4,6,8,12,16,24,32,48,64 --batch-sizes 1`.
VERIFY_COST = {
    "cpu": VerifyCost((1, 2, 3, 4, 6, 8, 16, 32, 64),
                      (1.0, 1.21, 1.40, 1.33, 2.16, 2.27, 4.26, 8.1, 15.5),
                      "CPU engine, default model, 256-token prefix (bench_one_batch, 2026-11-23)"),
    "torch": VerifyCost((1, 2, 4, 8, 16, 32, 64),
                        (1.0, 1.06, 1.04, 1.15, 1.38, 2.08, 3.36),
                        "torch engine, default model fp32, 512-token prefix (bench_one_batch)"),
}

DEFAULT_NS = (1, 2, 3, 4, 5, 6, 8, 12, 16, 24, 32, 48, 64)
MEASURE_PREFIX = 256  # tokens of context the timed forwards attend to


def stored_verify_cost(engine: str) -> VerifyCost:
    return VERIFY_COST.get(engine, VERIFY_COST["torch"])


@torch.inference_mode()
def measure_verify_times(runner, prefix: int = MEASURE_PREFIX, ns: tuple[int, ...] = DEFAULT_NS,
                         reps: int = 3, warmup: int = 2,
                         slots: torch.Tensor | None = None) -> dict[int, float]:
    """Median seconds of one TARGET_VERIFY forward of an n-node chain over a `prefix`-token
    prompt, for each n (n = 1: a DECODE forward, what a plain step runs). Each n runs in a block
    (`warmup` forwards, then `reps` timed), the sizes once largest first and once smallest first,
    so a drift of the machine's speed lands on every n alike, and each size is timed after
    forwards of its own size, as serving steps follow steps of similar size. (Timed right after
    the largest size, as a round over every n in turn did, one row read ~2x its steady decode
    time on the AMX machine, which halved every ratio: T(8)/T(1) 1.7 against 2.9.) Uses KV
    slots 1..prefix + max(ns) of `runner`'s pool: call it when no request holds them (start-up),
    or on a runner of its own; or pass `slots`, scratch slots lent by the scheduler."""
    from specserve.runtime.forward_batch import ForwardBatch, ForwardMode

    room = min(runner.kv_capacity, getattr(runner, "context_length", runner.kv_capacity))
    if slots is not None:
        room = min(room, slots.numel())
    ns = tuple(sorted(n for n in ns if n < room)) or (1,)
    prefix = max(1, min(prefix, room - max(ns)))
    if slots is None:
        slots = torch.arange(1, prefix + max(ns) + 1, dtype=torch.int64)
    gen = torch.Generator().manual_seed(0)
    vocab = runner.model_config.vocab_size
    prompt = torch.randint(0, vocab, (prefix + max(ns),), generator=gen).tolist()
    runner.forward(ForwardBatch.build(ForwardMode.EXTEND, [prompt[:prefix]], [slots[:prefix]],
                                      [0]))

    def batch(n: int) -> ForwardBatch:
        if n == 1:
            return ForwardBatch.build(ForwardMode.DECODE, [prompt[prefix : prefix + 1]],
                                      [slots[: prefix + 1]], [prefix])
        return ForwardBatch.build(
            ForwardMode.TARGET_VERIFY, [prompt[prefix : prefix + n]], [slots[: prefix + n]],
            [prefix], positions=[torch.arange(prefix, prefix + n)],
            custom_masks=[torch.tril(torch.ones(n, n, dtype=torch.bool))], logits="all")

    times: dict[int, list[float]] = {n: [] for n in ns}
    for order in (ns[::-1], ns):
        for n in order:
            for i in range(warmup + reps):
                b = batch(n)
                t0 = time.perf_counter()
                runner.forward(b)
                if i >= warmup:
                    times[n].append(time.perf_counter() - t0)
    return {n: statistics.median(v) for n, v in times.items()}


def measure_verify_cost(runner, prefix: int = MEASURE_PREFIX, ns: tuple[int, ...] = DEFAULT_NS,
                        reps: int = 3, slots: torch.Tensor | None = None,
                        when: str = "at start-up") -> VerifyCost:
    """This machine's curve, now (see the module docstring)."""
    t = measure_verify_times(runner, prefix, tuple(sorted(set(ns) | {1})), reps, slots=slots)
    ns = tuple(sorted(t))
    if len(ns) < 2:  # a context too short to measure a curve in
        return stored_verify_cost(runner.engine)
    return VerifyCost(ns, tuple([1.0] + [t[n] / t[1] for n in ns[1:]]),
                      f"measured {when}: {runner.engine} engine, {prefix}-token prefix, "
                      f"T(1) = {t[1] * 1e3:.2f} ms", t[1])


def extend_curve(measured: VerifyCost, old: VerifyCost) -> VerifyCost:
    """`measured` (a new timing of the first rows), continued past its last row by `old`'s
    shape, scaled to meet it there."""
    last = measured.rows[-1]
    scale = measured(last) / old(last)
    beyond = [(n, r * scale) for n, r in zip(old.rows, old.ratios) if n > last]
    return VerifyCost(measured.rows + tuple(n for n, _ in beyond),
                      measured.ratios + tuple(r for _, r in beyond), measured.source,
                      measured.t1_s)


def load_verify_cost(path: str) -> VerifyCost:
    """A curve saved as JSON (`VerifyCost.to_dict()`, as /server_info shows it)."""
    with open(path) as f:
        cost = VerifyCost.from_dict(json.load(f))
    return dataclasses.replace(cost, source=f"{cost.source} (from {path})")
