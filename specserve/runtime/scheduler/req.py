"""`Req`: the scheduler's view of one request."""

from __future__ import annotations

import time
from dataclasses import dataclass, field
from typing import Any

import torch

from specserve.runtime.messages import GrammarPayload
from specserve.runtime.sampling.logprobs import LogprobOptions
from specserve.runtime.sampling.sampling_params import SamplingParams


@dataclass(eq=False)
class Req:
    rid: str
    prompt_ids: list[int]
    params: SamplingParams
    stream: bool = False
    output_ids: list[int] = field(default_factory=list)
    # KV slots of the first `kv_len` tokens of `fill_ids` (prefix first). The first
    # `cache_len` of them belong to the radix cache (locked through `cache_node`).
    kv_slots: torch.Tensor = field(default_factory=lambda: torch.empty(0, dtype=torch.int64))
    cache_node: Any = None
    cache_len: int = 0
    cached_tokens: int = 0  # prompt tokens reused from the cache at first admission (reported)
    finish_reason: dict | None = None
    runner_knows: bool = False  # the runner holds our sampling state
    arrival: float = field(default_factory=time.monotonic)
    num_retractions: int = 0
    prompt_cached: bool = False  # the prompt's KV went to the radix cache once prefilled
    waited_for_prefix: bool = False  # waited for another's prefill of a shared prefix
    priority: int | None = None  # (priority scheduling) the client's; None: least urgent
    spec_verify_ct: int = 0
    spec_drafted: int = 0
    spec_accept_hist: list[int] = field(default_factory=list)  # [k] = steps accepting k drafts
    # the speculation controller's record of it (specserve/speculative/controller.py)
    spec: Any = None
    # the first `runner_kv_len` of `kv_slots` are in the model runner's own table
    runner_kv_len: int = 0
    logprobs: LogprobOptions | None = None  # the client wants logprobs back
    # prompt logprobs computed by prefill chunks that sampled nothing yet: sent with the next
    # tokens (specserve/runtime/sampling/logprobs.py payload)
    pending_logprobs: dict | None = None
    # the compiled grammar its output must match, until the runner has it (its first entry);
    # `constrained` stays: such a request does not draft
    grammar: GrammarPayload | None = None
    constrained: bool = False
    # the client asked for a trace: the steps not yet sent (messages.TraceStep); None: not asked
    spec_trace: list | None = None
    disable_speculation: bool = False  # the client asked for plain decoding
    planned_nodes: int = 0  # tree nodes its last decode step was given (1: no draft)

    @property
    def fill_ids(self) -> list[int]:
        """Every token whose KV the request needs before its next token: prompt + outputs."""
        return self.prompt_ids + self.output_ids

    def fill_slice(self, start: int, end: int) -> list[int]:
        """fill_ids[start:end] without building fill_ids (a decode step needs one token of
        it; the concatenation touched every token of a long prompt each step)."""
        n = len(self.prompt_ids)
        if start >= n:
            return self.output_ids[start - n : end - n]
        if end <= n:
            return self.prompt_ids[start:end]
        return self.prompt_ids[start:] + self.output_ids[: end - n]

    @property
    def kv_len(self) -> int:
        return self.kv_slots.numel()

    @property
    def num_pending(self) -> int:
        """Tokens of `fill_ids` without KV yet; the step that feeds them all samples the next
        token. 1 in decode (the last sampled token); more in prefill or after a retraction."""
        return len(self.prompt_ids) + len(self.output_ids) - self.kv_len

    @property
    def finished(self) -> bool:
        return self.finish_reason is not None
