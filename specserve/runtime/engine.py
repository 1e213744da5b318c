"""`Engine`: the serving system without HTTP, for Python users, tests and benchmarks.

    with Engine(model_path="default") as engine:
        out = engine.generate("The capital of France is", {"max_new_tokens": 16, "temperature": 0})
        print(out["text"])

It starts the same scheduler and model-runner processes as the server; the tokenizer manager
runs on a private event loop thread in the caller's process. This class serves plain decoding
with the server's own options; `specserve.launch.Engine` takes the speculative options too (it
builds the `Speculation` this class is handed).
"""

from __future__ import annotations

import asyncio
import dataclasses
import logging
import threading
from collections.abc import AsyncIterator, Iterator
from typing import Any

from specserve.runtime.entrypoints.logprob_format import SglangLogprobs
from specserve.runtime.entrypoints.native_api import parallel_samples
from specserve.runtime.entrypoints.streaming import StreamCursor
from specserve.runtime.processes import Backend
from specserve.runtime.sampling.logprobs import LogprobOptions
from specserve.runtime.sampling.sampling_params import SamplingParams
from specserve.runtime.server_args import BaseServerArgs
from specserve.runtime.speculation import Speculation
from specserve.runtime.tokenizer.tokenizer_manager import GenerateChunk, TokenizerManager

logger = logging.getLogger(__name__)


def chunk_to_dict(chunk: GenerateChunk, lp: SglangLogprobs | None = None) -> dict[str, Any]:
    """`lp`: the request's logprob fields, formatted as its chunks arrive."""
    meta = chunk.meta_info
    if lp is not None and chunk.logprobs is not None:
        meta = {**meta, **lp.meta(chunk.logprobs, chunk.output_ids)}
    return {"text": chunk.text, "output_ids": chunk.output_ids, "meta_info": meta}


class Engine:
    def __init__(self, args: BaseServerArgs | None = None,
                 speculation: Speculation | None = None, **server_args: Any) -> None:
        """Keyword arguments are `BaseServerArgs` fields (every server `--flag` with
        underscores); or `args`, resolved already (and the launcher's `speculation`)."""
        if args is None:
            known = {f.name for f in dataclasses.fields(BaseServerArgs)}
            unknown = sorted(set(server_args) - known)
            if unknown:
                raise TypeError(f"Engine() got unknown argument(s) {unknown}")
            args = BaseServerArgs(**server_args).resolve()
        self.server_args = args
        self.backend = Backend(self.server_args, speculation)
        self._loop = asyncio.new_event_loop()
        self._thread = threading.Thread(target=self._loop.run_forever, name="engine-loop",
                                        daemon=True)
        self._closed = False
        try:
            info = self.backend.start()
            self._thread.start()
            self.tm = TokenizerManager(self.server_args, self.backend.ipc_dir, info,
                                       self.backend.tokenizer)
            self._run(self.tm.start())
        except BaseException:
            self.backend.shutdown()
            raise
        self._watch = threading.Thread(target=self._watchdog, name="engine-watchdog", daemon=True)
        self._watch.start()

    def _run(self, coro):
        return asyncio.run_coroutine_threadsafe(coro, self._loop).result()

    def _watchdog(self) -> None:
        while not self._closed:
            dead = self.backend.dead_process()
            if dead:
                logger.error("%s died; failing requests in flight", dead)
                self._loop.call_soon_threadsafe(self.tm.mark_dead, f"{dead} died")
                return
            threading.Event().wait(0.5)

    # ---- inputs -----------------------------------------------------------------------
    def _inputs(self, prompt, input_ids, sampling_params) -> tuple[list[list[int]], list, bool]:
        if (prompt is None) == (input_ids is None):
            raise ValueError("pass exactly one of prompt and input_ids")
        if prompt is not None:
            single = isinstance(prompt, str)
            ids = [self.tm.tokenize(p) for p in ([prompt] if single else prompt)]
        else:
            single = bool(input_ids) and isinstance(input_ids[0], int)
            ids = [list(input_ids)] if single else [list(x) for x in input_ids]
        sp = sampling_params if isinstance(sampling_params, list) else [sampling_params] * len(ids)
        # SGLang's `n`: samples of each prompt, prompt-major
        n, sp = parallel_samples([p or {} for p in sp])
        params = [SamplingParams.from_dict(p, self.tm.vocab_size) for p in sp]
        if n > 1:
            ids = [i for i in ids for _ in range(n)]
            params = [p.for_sample(j) for p in params for j in range(n)]
        return ids, params, single and n == 1

    def _logprobs(self, ids: list[list[int]], return_logprob: bool,
                  logprob_start_len: int | None, top_logprobs_num: int | None,
                  return_text_in_logprobs: bool) -> list[SglangLogprobs | None]:
        """SGLang's logprob arguments, one formatter per prompt (None: not asked for)."""
        if not return_logprob:
            return [None] * len(ids)
        text_of = self.tm.token_texts if return_text_in_logprobs else None
        out = []
        for i in ids:
            opts = LogprobOptions.from_sglang(top_logprobs_num, logprob_start_len, len(i))
            out.append(SglangLogprobs(i, opts.input_from, opts.top, text_of))
        return out

    # ---- generation -------------------------------------------------------------------
    async def _collect(self, ids, params, lp: SglangLogprobs | None = None,
                       priority: int | None = None, grammar=None) -> dict:
        last = None
        async for chunk in self.tm.generate(ids, params, stream=False,
                                            logprobs=None if lp is None else lp.options,
                                            priority=priority, grammar=grammar):
            last = chunk
        return chunk_to_dict(last, lp)

    def generate(
        self, prompt: str | list[str] | None = None, sampling_params: dict | list | None = None,
        input_ids: list[int] | list[list[int]] | None = None, stream: bool = False,
        return_logprob: bool = False, logprob_start_len: int | None = None,
        top_logprobs_num: int | None = None, return_text_in_logprobs: bool = False,
        priority: int | None = None,
    ) -> dict | list[dict] | Iterator[dict]:
        """Generate for one prompt (dict) or several (list of dicts, run concurrently).
        `sampling_params` may set one grammar the output must match (SGLang's `json_schema`,
        `regex`, `ebnf`, `structural_tag`; docs/structured_output.md).

        With `stream=True` (one prompt), returns an iterator of cumulative chunks. The logprob
        arguments are SGLang's: meta_info then holds `output_token_logprobs` (and
        `input_token_logprobs` from `logprob_start_len` on, the `*_top_logprobs` lists with
        `top_logprobs_num`); docs/architecture.md, "Logprobs". `priority` is SGLang's (used
        under --enable-priority-scheduling), for every prompt.
        """
        priority = self.tm.check_priority(priority)
        ids, params, single = self._inputs(prompt, input_ids, sampling_params)
        self.tm.admit(len(ids), per_request_cap=False)  # --max-queued-requests, if set
        lps = self._logprobs(ids, return_logprob, logprob_start_len, top_logprobs_num,
                             return_text_in_logprobs)
        if stream:
            if not single:
                raise ValueError("stream=True takes a single prompt")
            return self._stream_sync(ids[0], params[0], lps[0], priority)
        # every grammar compiled (or refused: InvalidRequestError) before any prompt starts
        grammars = self._run(self.tm.compile_grammars(params))

        async def run_all():
            return await asyncio.gather(*(self._collect(i, p, lp, priority, g)
                                          for i, p, lp, g in zip(ids, params, lps, grammars)))

        outs = self._run(run_all())
        return outs[0] if single else outs

    def _chunk(self, chunk: GenerateChunk, lp: SglangLogprobs | None,
               cursor: StreamCursor) -> dict:
        out = chunk_to_dict(chunk, lp)
        return cursor.cut(out) if self.server_args.incremental_streaming_output else out

    def _stream_sync(self, ids, params, lp: SglangLogprobs | None = None,
                     priority: int | None = None) -> Iterator[dict]:
        agen = self.tm.generate(ids, params, stream=True,
                                logprobs=None if lp is None else lp.options, priority=priority)
        cursor = StreamCursor()
        try:
            while True:
                try:
                    chunk = self._run(agen.__anext__())
                except StopAsyncIteration:
                    return
                yield self._chunk(chunk, lp, cursor)
        finally:
            self._run(agen.aclose())

    async def async_generate(
        self, prompt: str | None = None, sampling_params: dict | None = None,
        input_ids: list[int] | None = None, stream: bool = False,
        return_logprob: bool = False, logprob_start_len: int | None = None,
        top_logprobs_num: int | None = None, return_text_in_logprobs: bool = False,
        priority: int | None = None,
    ) -> dict | AsyncIterator[dict]:
        """Awaitable from any event loop; `stream=True` gives an async iterator of chunks.
        The logprob and priority arguments are `generate`'s."""
        priority = self.tm.check_priority(priority)
        ids, params, _ = self._inputs(prompt, input_ids, sampling_params)
        if len(ids) != 1:
            raise ValueError("async_generate takes one prompt and n = 1 (generate takes more)")
        self.tm.admit(1, per_request_cap=False)
        lp = self._logprobs(ids[:1], return_logprob, logprob_start_len, top_logprobs_num,
                            return_text_in_logprobs)[0]
        if not stream:
            fut = asyncio.run_coroutine_threadsafe(
                self._collect(ids[0], params[0], lp, priority), self._loop)
            return await asyncio.wrap_future(fut)
        return self._stream_async(ids[0], params[0], lp, priority)

    async def _stream_async(self, ids, params, lp: SglangLogprobs | None = None,
                            priority: int | None = None) -> AsyncIterator[dict]:
        agen = self.tm.generate(ids, params, stream=True,
                                logprobs=None if lp is None else lp.options, priority=priority)
        cursor = StreamCursor()
        try:
            while True:
                fut = asyncio.run_coroutine_threadsafe(agen.__anext__(), self._loop)
                try:
                    chunk = await asyncio.wrap_future(fut)
                except StopAsyncIteration:
                    return
                yield self._chunk(chunk, lp, cursor)
        finally:
            await asyncio.wrap_future(asyncio.run_coroutine_threadsafe(agen.aclose(), self._loop))

    def server_info(self) -> dict:
        return self._run(self.tm.server_info())

    def flush_cache(self) -> bool:
        return self._run(self.tm.flush_cache())

    def shutdown(self) -> None:
        if self._closed:
            return
        self._closed = True
        try:
            self._run(self.tm.stop())
        finally:
            self._loop.call_soon_threadsafe(self._loop.stop)
            self._thread.join(2.0)
            self.backend.shutdown()

    def __enter__(self) -> Engine:
        return self

    def __exit__(self, *exc) -> None:
        self.shutdown()
