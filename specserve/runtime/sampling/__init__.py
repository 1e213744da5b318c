"""Sampling: per-request params, batched logits processing and token sampling."""

from __future__ import annotations

from specserve.runtime.sampling.argmax import argmax_rows
from specserve.runtime.sampling.penalties import RowHistory, apply_penalties
from specserve.runtime.sampling.sampler import (
    SamplingBatchInfo,
    expand,
    process_logits,
    sample,
    sample_from_probs,
    uniform_per_row,
)
from specserve.runtime.sampling.sampling_params import MAX_STOP_STRINGS, SamplingParams
from specserve.runtime.sampling.seeded import seeded_sample

__all__ = [
    "MAX_STOP_STRINGS",
    "RowHistory",
    "SamplingBatchInfo",
    "SamplingParams",
    "apply_penalties",
    "argmax_rows",
    "expand",
    "process_logits",
    "sample",
    "sample_from_probs",
    "seeded_sample",
    "uniform_per_row",
]
