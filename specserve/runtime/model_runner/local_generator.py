"""In-process generation over `ModelRunner`: prefill + decode of a static batch.

The serving scheduler does the same bookkeeping with continuous batching; this small loop is for
Python users without a server, tests (greedy equivalence with HF) and `bench_one_batch`.
"""

from __future__ import annotations

import time
from dataclasses import dataclass, field

import torch

from specserve.runtime.forward_batch import ForwardBatch, ForwardMode
from specserve.runtime.mem_cache import TokenSlotAllocator
from specserve.runtime.model_runner.model_runner import ModelRunner
from specserve.runtime.sampling.sampler import SamplingBatchInfo, sample
from specserve.runtime.sampling.sampling_params import SamplingParams


@dataclass
class LocalRequest:
    prompt_ids: list[int]
    params: SamplingParams
    output_ids: list[int] = field(default_factory=list)
    slots: torch.Tensor = field(default_factory=lambda: torch.empty(0, dtype=torch.int64))
    finished: bool = False
    # per-step logits rows when `keep_logits` is on: [vocab] float32 each
    logits: list[torch.Tensor] = field(default_factory=list)


@dataclass
class GenerateTimings:
    prefill_s: float = 0.0
    decode_s: float = 0.0
    decode_steps: int = 0


class LocalGenerator:
    def __init__(self, runner: ModelRunner) -> None:
        self.runner = runner
        self.allocator = TokenSlotAllocator(runner.kv_capacity)
        self.eos = set(runner.model_config.eos_token_ids)

    def _finish_check(self, req: LocalRequest) -> None:
        last = req.output_ids[-1]
        p = req.params
        if len(req.output_ids) >= p.max_new_tokens:
            req.finished = True
        elif (last in self.eos and not p.ignore_eos) or last in p.stop_token_ids:
            req.finished = True

    def _step(self, reqs: list[LocalRequest], mode: ForwardMode, keep_logits: bool) -> None:
        if mode == ForwardMode.EXTEND:
            new_tokens = [r.prompt_ids for r in reqs]
            prefix_lens = [0] * len(reqs)
        else:
            new_tokens = [[r.output_ids[-1]] for r in reqs]
            prefix_lens = [r.slots.numel() for r in reqs]
        for r, toks in zip(reqs, new_tokens):
            r.slots = torch.cat([r.slots, self.allocator.alloc(len(toks))])
        batch = ForwardBatch.build(mode, new_tokens, [r.slots for r in reqs], prefix_lens)
        logits = self.runner.forward(batch).logits  # [B, vocab]
        info = SamplingBatchInfo.from_params([r.params for r in reqs], logits.shape[-1],
                                             logits.device)
        # a seeded request's token is keyed by its absolute position
        # (specserve/runtime/sampling/seeded.py)
        next_ids = sample(
            logits, info, [r.prompt_ids for r in reqs], [r.output_ids for r in reqs],
            positions=[len(r.prompt_ids) + len(r.output_ids) for r in reqs],
        ).tolist()
        for i, (r, tok) in enumerate(zip(reqs, next_ids)):
            if keep_logits:
                r.logits.append(logits[i].cpu())
            r.output_ids.append(tok)
            self._finish_check(r)

    def generate(
        self,
        prompts: list[list[int]],
        params: list[SamplingParams] | SamplingParams,
        keep_logits: bool = False,
        timings: GenerateTimings | None = None,
    ) -> list[LocalRequest]:
        """Generate for every prompt (one static batch); KV is freed before returning."""
        if isinstance(params, SamplingParams):
            params = [params] * len(prompts)
        for p in params:
            p.validate(self.runner.vocab_size)
        reqs = [LocalRequest(list(ids), p) for ids, p in zip(prompts, params)]
        timings = timings or GenerateTimings()
        try:
            t0 = time.perf_counter()
            self._step(reqs, ForwardMode.EXTEND, keep_logits)
            timings.prefill_s += time.perf_counter() - t0
            while True:
                running = [r for r in reqs if not r.finished]
                if not running:
                    break
                t0 = time.perf_counter()
                self._step(running, ForwardMode.DECODE, keep_logits)
                timings.decode_s += time.perf_counter() - t0
                timings.decode_steps += 1
        finally:
            for r in reqs:
                self.allocator.free(r.slots)
                r.slots = r.slots[:0]
        return reqs
