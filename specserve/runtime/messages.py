"""Typed IPC messages, grouped by the process that receives them, encoded with msgpack.

No pickle crosses a socket: every message is a `msgspec.Struct` with a tag, decoded against the
union its receiver accepts. Sampling parameters and logprob options travel typed (msgspec encodes
their dataclasses field by field and decodes them back, so they are parsed and validated once, by
the front end). Token ids travel as lists of ints; bulk KV slot lists travel as raw
little-endian int64 bytes (`pack_ints` / `unpack_ints`).
"""

from __future__ import annotations

import sys

import msgspec
import numpy as np
import torch

from specserve.runtime.sampling.logprobs import LogprobOptions
from specserve.runtime.sampling.sampling_params import SamplingParams

_LITTLE = sys.byteorder == "little"


def pack_ints(t: torch.Tensor) -> bytes:
    if _LITTLE and t.dtype == torch.int64 and t.device.type == "cpu":
        return t.numpy().tobytes()  # (each torch call saved counts: see ForwardBatch.build)
    return t.to(torch.int64).cpu().numpy().astype("<i8", copy=False).tobytes()


def unpack_ints(b: bytes) -> torch.Tensor:
    return torch.from_numpy(np.frombuffer(b, dtype="<i8").copy())


class Msg(msgspec.Struct, tag=True, array_like=False):
    pass


class GrammarPayload(msgspec.Struct):
    """A compiled grammar on its way from the tokenizer process (which compiled it) to the model
    runner: the backend's own bytes (xgrammar: its JSON serialization) zlib-compressed, never
    pickled.
    `key` names it in both processes' caches (specserve/runtime/constrained/)."""

    key: str
    kind: str  # the sampling parameter it came from: json_schema | regex | ebnf | structural_tag
    data: bytes


# ---- received by the scheduler (from the tokenizer process / Engine) -------------------------
class GenerateReq(Msg):
    rid: str
    input_ids: list[int]
    sampling_params: SamplingParams  # validated by the front end
    stream: bool = False
    logprobs: LogprobOptions | None = None  # when the client wants logprobs
    # under --enable-priority-scheduling (validated by the front end); None: the client gave
    # none (the least urgent, as SGLang)
    priority: int | None = None
    grammar: GrammarPayload | None = None  # the compiled grammar the output must match
    spec_trace: bool = False  # report every step's draft tree and outcome (`TraceStep`)
    disable_speculation: bool = False  # decode plainly (the output is the same either way)


class AbortReq(Msg):
    rid: str


class FlushCacheReq(Msg):
    req_id: str


class GetInfoReq(Msg):
    req_id: str


class SpecStep(msgspec.Struct, omit_defaults=True):
    """What a verify step did for one request that asked for a trace: the tree the target
    verified (nodes in topological order, node 0 the root), the accepted path and the bonus
    token. `draft_probs[i]`: the drafter's probability of node i's token at its parent (1.0 for
    the root); None where the drafter is deterministic (n-gram)."""

    tokens: list[int]
    parents: list[int]
    accepted: list[int]  # node indices, root first
    bonus: int
    draft_probs: list[float] | None = None
    draft_s: float = 0.0  # the step's drafting time (every request's trees)


class TraceStep(msgspec.Struct, omit_defaults=True):
    """One step that gave a traced request tokens: `output` (after any stop cut) starts at
    output index `start`; `tree` is None for a plain step (no draft)."""

    start: int
    output: list[int]
    step_s: float  # the model runner's time for the whole step
    batch_size: int
    tree: SpecStep | None = None


# ---- received by the tokenizer process / Engine (from the scheduler) -------------------------
class TokenOut(Msg):
    """New tokens for some requests. `finish_reasons[i]` is None while request i runs."""

    rids: list[str]
    new_token_ids: list[list[int]]
    finish_reasons: list[dict | None]
    meta_infos: list[dict]
    # per request, for those that asked: the new tokens' logprobs
    # (specserve/runtime/sampling/logprobs.py)
    logprobs: list[dict | None] | None = None
    # per request, for those that asked: the steps that gave it these tokens
    spec_trace: list[list[TraceStep] | None] | None = None


class InfoOut(Msg):
    req_id: str
    info: dict


class ReadyOut(Msg):
    """Sent once by the scheduler when it and the model runner are ready."""

    info: dict


# ---- received by the model runner (from the scheduler) --------------------------------------
class ReqBatchEntry(Msg):
    rid: str
    new_token_ids: list[int]
    prefix_len: int
    # pack_ints(slots[slots_start:seq_len]): the runner keeps each request's slot list and
    # replaces what follows its first `slots_start` entries with these (prefix then new tokens)
    kv_slots: bytes
    slots_start: int = 0
    # sent once, when the runner first sees the request: its parameters and whole prompt
    # (token history for penalties and drafters; chunks and cache hits send only new tokens)
    sampling_params: SamplingParams | None = None
    prompt_ids: list[int] | None = None
    logprobs: LogprobOptions | None = None  # also sent once
    # False for a prefill chunk that does not end the prompt: nothing is sampled
    needs_token: bool = True
    # speculative decode steps: draft only what the drafter is sure of (the controller kept
    # this request from drafting; specserve/speculative/controller.py)
    confident_only: bool = False
    # nodes the drafter may propose, root included (0: every fresh slot; a constrained request
    # may get more slots than that, for the tokens its grammar forces)
    draft_nodes: int = 0
    # a probe of the verify cost: draft the whole budget, uncut by the drafter's cost estimate
    explore: bool = False
    grammar: GrammarPayload | None = None  # also sent once, with the parameters
    spec_trace: bool = False  # also sent once: report its verify steps (`SpecStep`)


class RunBatch(Msg):
    batch_id: int
    mode: str  # ForwardMode value
    reqs: list[ReqBatchEntry]
    released_rids: list[str] = []  # requests the runner can forget (finished or aborted)
    reset_drafter: bool = False  # flush_cache: drop the drafter's learned state too
    # speculative decode steps, from the controller's plan (specserve/runtime/speculation.py:
    # StepPlan): nobody drafts now or in the next few steps (the step may skip the drafter), and
    # drafting does not pay on the current traffic
    drafter_idle: bool = False
    traffic_off: bool = False
    speculative: bool = False  # the controller planned this decode step (else it is plain)
    # the verify-cost curve the controller plans with, when it moved (`VerifyCost.to_dict()`):
    # a drafter that cuts its trees by cost cuts them by it from this step on
    verify_cost: dict | None = None
    # with no request: time the verify-cost curve at these row counts over the scratch KV
    # slots `measure_slots` (pack_ints), and answer with it (`BatchResult.verify_cost`)
    measure_rows: list[int] | None = None
    measure_slots: bytes = b""


class ShutdownReq(Msg):
    pass


# ---- received by the scheduler (from the model runner) --------------------------------------
class BatchResult(Msg):
    batch_id: int
    # per request: tokens to append (1 for plain decode; accepted + bonus when speculative)
    next_token_ids: list[list[int]]
    # per request, speculative only: slots of the committed tokens / slots to free
    spec_info: list[dict] | None = None
    forward_s: float = 0.0
    # per request, for those that asked: logprobs of its new tokens (and of the prompt tokens
    # this step computed), specserve/runtime/sampling/logprobs.py
    logprobs: list[dict | None] | None = None
    # per request when some follow a grammar: "" (still matching, or none), GRAMMAR_END (its
    # grammar is complete: the request is done), GRAMMAR_REJECTED (a token it could not match)
    grammar_states: list[str] | None = None
    # speculative steps in which a traced request drafted: its `SpecStep`, by request id
    spec_trace: dict[str, SpecStep] | None = None
    # the step's target forward when it ran one (decode or verify: the speculation controller
    # learns the verify-cost curve from them): its rows, summed over the batch, and seconds
    forward_rows: int = 0
    target_s: float = 0.0
    # the curve timed for `RunBatch.measure_rows` (`VerifyCost.to_dict()`)
    verify_cost: dict | None = None
    # what the runner keeps per request after this batch (RunnerWorker.held)
    held: dict[str, int] | None = None


class RunnerReady(Msg):
    info: dict


class RunnerError(Msg):
    message: str


GRAMMAR_END = "end"
GRAMMAR_REJECTED = "rejected"

TO_SCHEDULER = GenerateReq | AbortReq | FlushCacheReq | GetInfoReq
TO_TOKENIZER = TokenOut | InfoOut | ReadyOut
TO_RUNNER = RunBatch | ShutdownReq
FROM_RUNNER = BatchResult | RunnerReady | RunnerError
