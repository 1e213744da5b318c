"""Sampling: per-request params, batched logits processing and token sampling."""

from __future__ import annotations

from runtime.sampling.sampler import (
    SamplingBatchInfo,
    apply_penalties,
    expand,
    make_generator,
    process_logits,
    sample,
    sample_from_probs,
    uniform_per_row,
)
from runtime.sampling.sampling_params import MAX_STOP_STRINGS, SamplingParams

__all__ = [
    "MAX_STOP_STRINGS",
    "SamplingBatchInfo",
    "SamplingParams",
    "apply_penalties",
    "expand",
    "make_generator",
    "process_logits",
    "sample",
    "sample_from_probs",
    "uniform_per_row",
]
