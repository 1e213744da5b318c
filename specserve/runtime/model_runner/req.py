"""`RunnerReq`: the model runner's one record of a request."""

from __future__ import annotations

from concurrent.futures import Future
from dataclasses import dataclass, field
from typing import TYPE_CHECKING

import torch

from specserve.runtime.sampling.logprobs import LogprobOptions
from specserve.runtime.sampling.sampling_params import SamplingParams

if TYPE_CHECKING:
    from specserve.runtime.constrained import Matcher


@dataclass(eq=False)
class RunnerReq:
    """What the runner keeps of a request between steps (its parameters, token history and a
    copy of its KV slot list), plus what the current step gave it. The speculative worker and
    drafters read it as it is (`tokens`, `budget`, `prefix_slots`, ...)."""

    rid: str
    params: SamplingParams
    prompt_ids: list[int]
    output_ids: list[int] = field(default_factory=list)
    slots: torch.Tensor = field(default_factory=lambda: torch.empty(0, dtype=torch.int64))
    logprobs: LogprobOptions | None = None  # the client wants logprobs back
    input_logprobs_done: bool = False  # the prompt's logprobs went out (not again on re-prefill)
    spec_trace: bool = False  # report each verify step's tree and outcome (messages.SpecStep)
    # prompt_ids + output_ids, grown in place: a speculative step reads the whole history, and
    # a fresh concatenation per request per step cost ~80 us of a ~6 ms step at c = 1 on
    # 500-token prompts. Drafters may keep a reference; it only ever grows.
    tokens: list[int] = field(init=False, repr=False)
    # the grammar its output follows: loading (a future of the compiled grammar) until its
    # first token is sampled, then its matcher, advanced on every committed token
    grammar_loading: Future | None = None
    grammar: Matcher | None = None
    grammar_failed: bool = False
    # ---- this step (set by the runner before a speculative step) ----
    prefix_len: int = 0  # tokens with KV; tokens[-1] (the root) has none yet
    # tree nodes the drafter may propose, root included; the fresh slots may be more (a
    # constrained request's grammar-forced tokens take them: specserve/speculative/worker.py)
    budget: int = 1
    confident_only: bool = False  # draft only what the drafter is sure of
    explore: bool = False  # a probe of the verify cost: the whole budget, uncut by cost

    def __post_init__(self) -> None:
        self.tokens = self.prompt_ids + self.output_ids

    @property
    def constrained(self) -> bool:
        return self.grammar is not None or self.grammar_loading is not None

    @classmethod
    def drafting(cls, rid: str, tokens: list[int], budget: int,
                 params: SamplingParams | None = None, slots: torch.Tensor | None = None,
                 confident_only: bool = False) -> RunnerReq:
        """A request as a drafter sees it in a step, outside a runner (benchmarks, tests):
        history `tokens` (the last one the root, without KV), `budget` tree nodes; `slots`
        [len(tokens) - 1 + budget] (default: 0, 1, 2, ...)."""
        prefix = len(tokens) - 1
        if slots is None:
            slots = torch.arange(prefix + budget)
        assert slots.numel() == prefix + budget, "slots: the prefix's, then one per node"
        req = cls(rid, params or SamplingParams(temperature=0.0), list(tokens), slots=slots,
                  budget=budget, confident_only=confident_only)
        req.prefix_len = prefix
        return req

    def append(self, new: list[int]) -> None:
        self.output_ids.extend(new)
        self.tokens.extend(new)

    @property
    def prefix_slots(self) -> torch.Tensor:
        """[prefix_len] KV slots of the committed tokens."""
        return self.slots[: self.prefix_len]

    @property
    def fresh_slots(self) -> torch.Tensor:
        """[>= budget] this step's fresh KV slots: tree node i's target KV goes to slot i."""
        return self.slots[self.prefix_len :]

    def input_logprob_rows(self, prefix_len: int, n: int) -> list[int]:
        """Which of a prefill chunk's rows (offsets in [0, n)) give prompt-token logprobs: row
        at position q scores prompt token q + 1, for q + 1 >= the asked start."""
        lp = self.logprobs
        if lp is None or lp.input_from is None or self.input_logprobs_done:
            return []
        first = max(lp.input_from - 1, 0, prefix_len)
        last = min(prefix_len + n, len(self.prompt_ids) - 1)  # exclusive
        return list(range(first - prefix_len, last - prefix_len))
