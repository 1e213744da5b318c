"""The one accepted excuse for two greedy outputs to differ: a near-tie at the first difference.

Batching, speculation and retraction change the order of floating-point sums, so where the
target's top-two logits are within 1e-4 either token is a correct greedy choice. Anything else is
a bug. The logits are recomputed here with an in-process runner on prompt + common prefix.
"""

from __future__ import annotations

import functools

import torch

from runtime.model_loader.default_model import resolve_model_path
from runtime.model_runner.forward_batch import ForwardBatch, ForwardMode
from runtime.model_runner.model_runner import ModelRunner, RunnerConfig

TIE_EPS = 1e-4


@functools.lru_cache(maxsize=4)
def _runner(model_dir: str) -> ModelRunner:
    return ModelRunner(RunnerConfig(model_dir, "cpu", "float32", max_total_tokens=8192))


def top2_gap(model_dir: str, ids: list[int]) -> float:
    runner = _runner(model_dir)
    slots = torch.arange(1, len(ids) + 1)
    logits = runner.forward(ForwardBatch.build(ForwardMode.EXTEND, [ids], [slots], [0])).logits
    top2 = logits[0].topk(2).values
    return float(top2[0] - top2[1])


def same_or_near_tie(prompt: list[int], a: list[int], b: list[int],
                     model_dir: str | None = None) -> tuple[bool, str]:
    """(ok, explanation) for greedy outputs `a` and `b` of the same prompt."""
    if a == b:
        return True, "identical"
    model_dir = model_dir or str(resolve_model_path(None))
    for i, (x, y) in enumerate(zip(a, b)):
        if x != y:
            gap = top2_gap(model_dir, prompt + a[:i])
            return gap <= TIE_EPS, f"first difference at token {i}: top-two gap {gap:.2e}"
    # one is a prefix of the other: only fine if the shorter stopped for a reason both share
    return False, f"lengths differ ({len(a)} vs {len(b)}) with a common prefix"
