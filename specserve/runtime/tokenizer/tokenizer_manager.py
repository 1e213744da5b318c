"""`TokenizerManager`: request state in the tokenizer process (HTTP server or `Engine`).

It turns prompts into ids, validates, sends `GenerateReq` to the scheduler, and turns the
scheduler's `TokenOut` messages back into text per request (incrementally, no broken UTF-8,
stop strings cut). It never touches tensors. All methods run on one asyncio loop.
"""

from __future__ import annotations

import asyncio
import logging
import time
import uuid
from collections.abc import AsyncIterator
from dataclasses import dataclass, field

import msgspec
import zmq
import zmq.asyncio

from specserve.runtime.constrained import GrammarSpec, create_backend
from specserve.runtime.constrained.compiler import GrammarCompiler
from specserve.runtime.entrypoints.logprob_format import TokenTexts
from specserve.runtime.errors import InvalidRequestError, QueueFullError, SpecserveError
from specserve.runtime.ipc import ipc_addr
from specserve.runtime.messages import (
    TO_TOKENIZER,
    AbortReq,
    FlushCacheReq,
    GenerateReq,
    GetInfoReq,
    GrammarPayload,
    InfoOut,
    TokenOut,
)
from specserve.runtime.model_loader.tokenizer import apply_chat_template, load_tokenizer
from specserve.runtime.sampling import logprobs as lp_payload
from specserve.runtime.sampling.logprobs import LogprobOptions
from specserve.runtime.sampling.sampling_params import SamplingParams
from specserve.runtime.tokenizer.chat_templates import NAMED, read_template
from specserve.runtime.tokenizer.detokenizer import IncrementalText
from specserve.runtime.tokenizer.metrics import ServingMetrics
from specserve.runtime.tokenizer.spec_trace import TokenPieces, step_json
from specserve.runtime.tool_calls.formats import ToolFormat, tool_format

logger = logging.getLogger(__name__)

# a request's `priority` (int32, as vLLM and SGLang carry it)
PRIORITY_MIN, PRIORITY_MAX = -(2**31), 2**31 - 1


class BackendDeadError(SpecserveError):
    """A server process died; requests in flight cannot complete."""


@dataclass(frozen=True)
class GenerateChunk:
    rid: str
    text: str  # cumulative text so far (final text at finish)
    output_ids: list[int]  # cumulative output ids
    finished: bool
    finish_reason: dict | None
    meta_info: dict
    # when asked for: the logprobs so far, cumulative like the ids
    # (specserve/runtime/sampling/logprobs.py payload: "lp"/"top_ids"/"top_lp" per output token,
    # "in_"-prefixed for the prompt)
    logprobs: dict | None = None


@dataclass
class _ReqState:
    rid: str
    detok: IncrementalText
    prompt_tokens: int
    created: float = field(default_factory=time.perf_counter)
    event: asyncio.Event = field(default_factory=asyncio.Event)
    finished: bool = False
    finish_reason: dict | None = None
    meta: dict = field(default_factory=dict)
    first_token_at: float | None = None
    last_token_at: float | None = None
    error: str | None = None
    logprobs: dict | None = None  # cumulative, when the request asked for them
    # when the request asked for a trace: its steps so far (spec_trace.step_json), and the
    # text of each of its tokens
    trace: list[dict] | None = None
    pieces: TokenPieces | None = None


class TokenizerManager:
    def __init__(self, server_args, ipc_dir: str, ready_info: dict, tokenizer=None) -> None:
        """`tokenizer`: the model's, if already loaded (`Backend.start` loads it)."""
        self.server_args = server_args
        self.model_name = server_args.served_model_name
        self.tokenizer = tokenizer if tokenizer is not None else load_tokenizer(
            server_args.model_path)
        self.token_texts = TokenTexts(self.tokenizer)  # each id's text, for logprob responses
        self.chat_template = read_template(server_args.chat_template)
        self.context_length = int(ready_info["context_length"])
        self.vocab_size = int(ready_info["vocab_size"])
        self.ready_info = ready_info
        self.metrics = ServingMetrics(self.model_name)
        self.grammars = self._grammar_compiler()
        self.metrics.watch_grammars(self.grammars)
        self.tool_format: ToolFormat = tool_format(server_args.tool_call_parser,
                                                   self.template_renders_tools)
        self.healthy = True
        self.dead_reason: str | None = None
        self._ipc_dir = ipc_dir
        self._states: dict[str, _ReqState] = {}
        self._info_waiters: dict[str, asyncio.Future] = {}
        self._enc = msgspec.msgpack.Encoder()
        self._dec = msgspec.msgpack.Decoder(TO_TOKENIZER)
        self._recv_task: asyncio.Task | None = None

    # ---- lifecycle ---------------------------------------------------------------------
    async def start(self) -> None:
        """Open sockets and start the receive loop; call from the serving event loop."""
        ctx = zmq.asyncio.Context.instance()
        self._send = ctx.socket(zmq.PUSH)
        self._send.setsockopt(zmq.LINGER, 0)
        self._send.connect(ipc_addr(self._ipc_dir, "scheduler_in"))
        self._recv = ctx.socket(zmq.PULL)
        self._recv.setsockopt(zmq.LINGER, 0)
        self._recv.bind(ipc_addr(self._ipc_dir, "tokenizer_in"))
        self._recv_task = asyncio.get_running_loop().create_task(self._recv_loop())

    def _grammar_compiler(self) -> GrammarCompiler | None:
        """The grammar compiler (None with --grammar-backend none); its backend is built in a
        worker thread from now on, so the first request with a grammar rarely waits for it."""
        args = self.server_args
        if args.grammar_backend == "none":
            return None
        eos = self.ready_info.get("eos_token_ids") or [self.tokenizer.eos_token_id]

        def make():
            return create_backend(args.grammar_backend, self.tokenizer, self.vocab_size,
                                  [int(t) for t in eos if t is not None],
                                  not args.constrained_json_disable_any_whitespace)

        return GrammarCompiler(make, args.grammar_compile_timeout,
                               self.metrics.grammar_compile_s.observe)

    async def stop(self) -> None:
        if self.grammars is not None:
            self.grammars.shutdown()
        if self._recv_task is not None:
            self._recv_task.cancel()
        for sock in (getattr(self, "_send", None), getattr(self, "_recv", None)):
            if sock is not None:
                sock.close(0)

    def mark_dead(self, reason: str) -> None:
        """A child process died: fail every request in flight and turn /health to 503."""
        self.healthy = False
        self.dead_reason = reason
        for st in self._states.values():
            st.error = reason
            st.event.set()
        for fut in self._info_waiters.values():
            if not fut.done():
                fut.set_exception(BackendDeadError(reason))

    async def _recv_loop(self) -> None:
        while True:
            msg = self._dec.decode(await self._recv.recv())
            if isinstance(msg, TokenOut):
                self._on_tokens(msg)
            elif isinstance(msg, InfoOut):
                fut = self._info_waiters.pop(msg.req_id, None)
                if fut is not None and not fut.done():
                    fut.set_result(msg.info)

    def _on_tokens(self, msg: TokenOut) -> None:
        now = time.perf_counter()
        lps = msg.logprobs or [None] * len(msg.rids)
        for rid, ids, reason, meta, lp in zip(
            msg.rids, msg.new_token_ids, msg.finish_reasons, msg.meta_infos, lps
        ):
            st = self._states.get(rid)
            if st is None:
                continue  # aborted by us already
            if lp is not None and st.logprobs is not None:
                lp_payload.extend(st.logprobs, lp)
            if ids:
                st.detok.extend(ids)
                if st.first_token_at is None:
                    st.first_token_at = now
                    self.metrics.ttft.observe(now - st.created)
                else:
                    self.metrics.itl.observe(now - st.last_token_at)
                st.last_token_at = now
            if reason is not None:
                st.finished, st.finish_reason, st.meta = True, reason, meta
                self._count_finished(st, now)
            st.event.set()
        if msg.spec_trace is not None:
            self._on_trace(msg)

    def _on_trace(self, msg: TokenOut) -> None:
        for rid, steps in zip(msg.rids, msg.spec_trace):
            st = self._states.get(rid)
            if not steps or st is None or st.trace is None:
                continue
            for step in steps:
                pieces = st.pieces.extend(step.output)
                st.trace.append(step_json(step, pieces, self.token_texts))

    def _count_finished(self, st: _ReqState, now: float) -> None:
        m = self.metrics
        if _refusal(st) is not None:
            m.rejected.inc()
            return
        if st.finish_reason.get("type") == "abort":
            m.aborted.inc()
            return
        m.requests.inc()
        m.prompt_tokens.inc(st.meta.get("prompt_tokens", 0))
        m.generation_tokens.inc(st.meta.get("completion_tokens", 0))
        m.cached_tokens.inc(st.meta.get("cached_tokens", 0))
        m.e2e.observe(now - st.created)

    # ---- prompts -----------------------------------------------------------------------
    def tokenize(self, text: str) -> list[int]:
        """A completion prompt's ids, with the tokens the tokenizer adds to a text (e.g. the
        <bos> Gemma starts every text with, as llama.cpp and SGLang add it)."""
        return self.tokenizer.encode(text, add_special_tokens=True)

    @property
    def template_renders_tools(self) -> bool:
        """Whether the chat template shows the model `tools` itself (it reads the variable)."""
        template = self.chat_template or getattr(self.tokenizer, "chat_template", None) or ""
        return isinstance(template, str) and "tools" in template

    def chat_ids(self, messages: list[dict], add_generation_prompt: bool = True,
                 tools: list[dict] | None = None) -> list[int]:
        if not self.chat_template and not getattr(self.tokenizer, "chat_template", None):
            raise InvalidRequestError(
                "messages", "this model has no chat template: use /v1/completions or "
                "/generate, or start the server with --chat-template (a file, a template, or "
                f"one of {', '.join(NAMED)})")
        try:
            return apply_chat_template(
                self.tokenizer, messages, add_generation_prompt, self.chat_template, tools
            )
        except SpecserveError:
            raise
        except Exception as exc:  # noqa: BLE001 - a template error is the caller's input
            raise InvalidRequestError("messages", f"cannot apply the chat template: {exc}") from exc

    def check_prompt(self, input_ids: list[int], params: SamplingParams,
                     max_new_tokens_given: bool = False) -> None:
        """Validate a prompt and its parameters; fit `max_new_tokens` to the context.

        As SGLang: a `max_new_tokens` the client gave that does not fit beside the prompt in
        the context is a 400 (so a client learns its request cannot run as asked); the default
        is cut to the room left, and the scheduler stops every request at the context length."""
        if not input_ids:
            raise InvalidRequestError("prompt", "the prompt is empty")
        if any(type(t) is not int or t < 0 or t >= self.vocab_size for t in input_ids):
            raise InvalidRequestError("input_ids", f"token ids must be in [0, {self.vocab_size})")
        if len(input_ids) >= self.context_length:
            raise InvalidRequestError(
                "prompt", f"the prompt has {len(input_ids)} tokens; this server's context length "
                f"is {self.context_length}, and at least one token must be generated",
            )
        params.validate(self.vocab_size)
        total = len(input_ids) + params.max_new_tokens
        if max_new_tokens_given and total > self.context_length:
            raise InvalidRequestError(
                "max_new_tokens", "Requested token count exceeds the model's maximum context "
                f"length of {self.context_length} tokens. You requested a total of {total} "
                f"tokens: {len(input_ids)} tokens from the input messages and "
                f"{params.max_new_tokens} tokens for the completion. Please reduce the number "
                "of tokens in the input messages or the completion to fit within the limit.")
        params.max_new_tokens = min(params.max_new_tokens, self.context_length - len(input_ids))

    def check_priority(self, priority: int | None) -> int | None:
        """The priority to schedule a request at: under --enable-priority-scheduling the
        client's, None when it gave none (the scheduler ranks those last, as SGLang does).
        Without it, None: a priority is ignored, as SGLang does, or refused with
        --abort-on-priority-when-disabled."""
        if priority is None:
            return None
        if type(priority) is not int or not PRIORITY_MIN <= priority <= PRIORITY_MAX:
            raise InvalidRequestError("priority", f"must be an integer in [{PRIORITY_MIN}, "
                                      f"{PRIORITY_MAX}]")
        if self.server_args.enable_priority_scheduling:
            return priority
        if self.server_args.abort_on_priority_when_disabled:
            raise InvalidRequestError("priority", "this server does not schedule by priority "
                                      "(start it with --enable-priority-scheduling); send the "
                                      "request without one")
        return None

    # ---- admission ---------------------------------------------------------------------
    def admit(self, count: int, per_request_cap: bool = True) -> None:
        """Refuse, before any of them starts, a request of `count` sequences that is larger
        than one request may be (`--max-sequences-per-request`: a 400; `per_request_cap`
        False for in-process `Engine` batches) or that would queue more than
        `--max-queued-requests` requests behind the running ones (a 503). Every request in
        flight is running or queued, so the queue is what is in flight beyond
        `--max-running-requests`; the scheduler can run fewer when KV is short, so this
        bounds the queue from below, as SGLang's check at admission does. Under
        --enable-priority-scheduling the scheduler bounds the queue instead, per sequence:
        a more urgent request may take the place of a queued one there (SGLang's rule)."""
        cap = self.server_args.max_sequences_per_request
        if per_request_cap and count > cap:
            raise InvalidRequestError(
                "prompt", f"this request asks for {count} sequences (prompts x n); this server "
                f"takes at most {cap} in one request (--max-sequences-per-request)")
        limit = self.server_args.max_queued_requests
        if self.server_args.enable_priority_scheduling:
            limit = None  # (the scheduler's check: Scheduler._queue_admits)
        in_flight = len(self._states)
        if limit is not None and \
                in_flight + count - self.server_args.max_running_requests > limit:
            self.metrics.rejected.inc(count)
            raise QueueFullError("The request queue is full.")

    # ---- grammars ----------------------------------------------------------------------
    async def compile_grammar(self, params: SamplingParams) -> GrammarPayload | None:
        """The compiled grammar `params` asks for (None: unconstrained), compiled in a thread
        or taken from the cache; a grammar that does not compile is an InvalidRequestError
        naming its sampling parameter (specserve/runtime/constrained/compiler.py)."""
        spec = params.grammar
        return None if spec is None else await self._compile(spec)

    async def _compile(self, spec: GrammarSpec) -> GrammarPayload:
        if self.grammars is None:
            raise InvalidRequestError(spec.kind, "this server runs without a grammar backend "
                                      "(--grammar-backend none)")
        return await self.grammars.compile(spec)

    async def compile_grammars(self, params: list[SamplingParams]
                               ) -> list[GrammarPayload | None]:
        """`compile_grammar` for each, before any request starts: a bad grammar in a batch
        refuses the batch. Distinct grammars compile concurrently, each once."""
        distinct = list(dict.fromkeys(p.grammar for p in params if p.grammar is not None))
        done = dict(zip(distinct, await asyncio.gather(*(self._compile(g) for g in distinct))))
        return [done.get(p.grammar) for p in params]

    # ---- requests ----------------------------------------------------------------------
    async def generate(
        self, input_ids: list[int], params: SamplingParams, stream: bool = False,
        rid: str | None = None, logprobs: LogprobOptions | None = None,
        priority: int | None = None, grammar: GrammarPayload | None = None,
        spec_trace: bool = False, disable_speculation: bool = False,
    ) -> AsyncIterator[GenerateChunk]:
        """Yield chunks (each new step when `stream`, else only the final one); with
        `logprobs`, each chunk carries the logprobs so far. `priority` as `check_priority`
        returned it; `grammar` as `compile_grammar` returned it for `params` (compiled here
        when not given). `spec_trace`: each chunk's `meta_info["spec_trace"]` lists the steps
        so far (specserve/runtime/tokenizer/spec_trace.py). `disable_speculation`: decode plainly
        (the same output: speculation is lossless).

        If the consumer stops early (client disconnect → cancellation), the request is aborted
        on the scheduler and its KV freed.
        """
        if not self.healthy:
            raise BackendDeadError(self.dead_reason or "server is shutting down")
        if grammar is None:
            grammar = await self.compile_grammar(params)
        rid = rid or uuid.uuid4().hex
        if rid in self._states:
            raise InvalidRequestError("rid", f"request id {rid!r} is already running")
        self.check_prompt(input_ids, params)
        st = _ReqState(rid, IncrementalText(self.tokenizer, params.stop), len(input_ids))
        if logprobs is not None:
            logprobs.validate(len(input_ids))
            st.logprobs = {}
        if spec_trace:
            st.trace, st.pieces = [], TokenPieces(self.tokenizer)
        self._states[rid] = st
        self._send.send(self._enc.encode(GenerateReq(
            rid=rid, input_ids=list(input_ids), sampling_params=params,
            stream=stream, logprobs=logprobs,
            priority=priority, grammar=grammar,
            spec_trace=spec_trace, disable_speculation=disable_speculation,
        )))
        try:
            while True:
                await st.event.wait()
                st.event.clear()
                if st.error is not None:
                    raise BackendDeadError(st.error)
                if st.finished:
                    refusal = _refusal(st)
                    if refusal is not None:  # (counted as rejected by _count_finished)
                        raise QueueFullError(refusal)
                    yield self._chunk(st, final=True)
                    return
                if stream:
                    yield self._chunk(st, final=False)
        finally:
            if not st.finished and st.error is None:
                self.abort(rid)
            self._states.pop(rid, None)

    def _chunk(self, st: _ReqState, final: bool) -> GenerateChunk:
        text = st.detok.finalize(st.finish_reason) if final else st.detok.visible()
        meta = {"id": st.rid, "prompt_tokens": st.prompt_tokens,
                "completion_tokens": len(st.detok.ids), **st.meta}
        if final:
            meta["finish_reason"] = st.finish_reason
            meta["e2e_latency"] = time.perf_counter() - st.created
        if st.trace is not None:
            meta["spec_trace"] = list(st.trace)
        return GenerateChunk(st.rid, text, list(st.detok.ids), final, st.finish_reason, meta,
                             None if st.logprobs is None else lp_payload.concat([st.logprobs]))

    def abort(self, rid: str) -> None:
        if self.healthy:
            self._send.send(self._enc.encode(AbortReq(rid=rid)))

    async def _ask(self, msg, req_id: str, timeout: float = 30.0) -> dict:
        if not self.healthy:
            raise BackendDeadError(self.dead_reason or "server is shutting down")
        fut = asyncio.get_running_loop().create_future()
        self._info_waiters[req_id] = fut
        self._send.send(self._enc.encode(msg))
        try:
            return await asyncio.wait_for(fut, timeout)
        finally:
            self._info_waiters.pop(req_id, None)

    async def flush_cache(self) -> bool:
        req_id = uuid.uuid4().hex
        return bool((await self._ask(FlushCacheReq(req_id=req_id), req_id))["success"])

    async def server_info(self) -> dict:
        req_id = uuid.uuid4().hex
        info = await self._ask(GetInfoReq(req_id=req_id), req_id)
        info["open_requests"] = len(self._states)
        if self.grammars is not None:
            info["grammar"] = {"backend": self.server_args.grammar_backend,
                               **self.grammars.info()}
        self.metrics.update_from_server_info(info)
        return info


def _refusal(st: _ReqState) -> str | None:
    """The scheduler's message when it refused the request before it produced anything (a
    full queue under priority scheduling: an abort with status 503), else None."""
    r = st.finish_reason
    if r is None or r.get("type") != "abort" or r.get("status_code") != 503 or st.detok.ids:
        return None
    return r.get("message") or "The request queue is full."



