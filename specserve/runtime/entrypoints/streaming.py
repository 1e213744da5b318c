"""Running tm generations for HTTP handlers: concurrency, client disconnects, SSE.

The rule everywhere: a tm generator that is not run to its end is closed (`aclose`), because
closing it is what aborts the request on the scheduler and frees its KV.
"""

from __future__ import annotations

import asyncio
import logging
from collections.abc import AsyncIterator, Awaitable, Coroutine
from typing import Any, TypeVar

import msgspec
from starlette.requests import Request
from starlette.responses import StreamingResponse
from starlette.types import Receive, Scope, Send

from specserve.runtime.entrypoints.protocol import error_for

logger = logging.getLogger(__name__)
T = TypeVar("T")
DISCONNECT_POLL_S = 0.2
SSE_DONE = "data: [DONE]\n\n"


class ClientDisconnected(Exception):
    """The client went away before its (non-streaming) response was ready."""


_JSON = msgspec.json.Encoder()


class StreamCursor:
    """Where one stream's chunks got to, for --incremental-streaming-output: `cut` turns a
    cumulative /generate chunk dict into what is new since the previous one (text,
    output_ids, and the output-side logprob lists: SGLang's set of fields; the prompt's
    logprobs stay whole; `spec_trace`, by steps). The cumulative text only grows (the
    detokenizer holds back what a stop string could cut), so the pieces concatenate to the
    final text."""

    META = ("output_token_logprobs", "output_top_logprobs")

    def __init__(self) -> None:
        self.chars = self.ids = self.steps = 0

    def cut(self, out: dict) -> dict:
        text, ids, meta = out["text"], out["output_ids"], out["meta_info"]
        meta = {k: v[self.ids:] if k in self.META else v for k, v in meta.items()}
        trace = meta.get("spec_trace")
        if trace is not None:  # (steps, not tokens)
            meta["spec_trace"] = trace[self.steps:]
            self.steps = len(trace)
        cut = {**out, "text": text[self.chars:], "output_ids": ids[self.ids:], "meta_info": meta}
        self.chars, self.ids = len(text), len(ids)
        return cut


def sse(payload: dict) -> str:
    """One `data:` event. msgspec's encoder, not json.dumps: a /generate stream with logprobs
    sends every logprob so far in each chunk (as SGLang does), and json.dumps took ~0.65 ms a
    chunk at 128 tokens with 5 alternatives, ~1 ms of CPU per token beside a 2-thread engine;
    msgspec ~18x less (docs/architecture.md, "Logprobs")."""
    return f"data: {_JSON.encode(payload).decode()}\n\n"


async def gather_all(coros: list[Coroutine[Any, Any, T]]) -> list[T]:
    """Run concurrently; when one fails (or we are cancelled) the others are cancelled too."""
    tasks = [asyncio.ensure_future(c) for c in coros]
    try:
        return list(await asyncio.gather(*tasks))
    finally:
        for task in tasks:
            task.cancel()
        await asyncio.gather(*tasks, return_exceptions=True)


async def until_disconnect(request: Request, work: Awaitable[T]) -> T:
    """Await `work`, cancelling it if the client disconnects first.

    Non-streaming responses have no send to fail on, so we poll the connection.
    """
    task = asyncio.ensure_future(work)
    try:
        while True:
            done, _ = await asyncio.wait({task}, timeout=DISCONNECT_POLL_S)
            if done:
                return task.result()
            if await request.is_disconnected():
                raise ClientDisconnected()
    finally:
        if not task.done():
            task.cancel()
            await asyncio.gather(task, return_exceptions=True)


async def last_chunk(gen: AsyncIterator[T]) -> T:
    """The final item of a generator (the tm yields only the final chunk when not streaming)."""
    last = None
    try:
        async for item in gen:
            last = item
    finally:
        await gen.aclose()
    assert last is not None, "a tm generation yields at least its final chunk"
    return last


async def first_chunks(request: Request, gens: list[AsyncIterator[T]]) -> list[AsyncIterator[T]]:
    """Start every generator and wait for its first chunk before any HTTP header is sent, so a
    validation error is still a 400 and not a broken stream. Returns generators that replay it."""
    try:
        firsts = await until_disconnect(request, gather_all([_first(g) for g in gens]))
    except BaseException:
        for gen in gens:
            await gen.aclose()
        raise
    return [_prepend(first, gen) for first, gen in zip(firsts, gens)]


async def _first(gen: AsyncIterator[T]) -> tuple[bool, T | None]:
    try:
        return True, await gen.__anext__()
    except StopAsyncIteration:
        return False, None


async def _prepend(first: tuple[bool, T | None], gen: AsyncIterator[T]) -> AsyncIterator[T]:
    try:
        has_first, item = first
        if not has_first:
            return
        yield item
        async for item in gen:
            yield item
    finally:
        await gen.aclose()


async def merge(gens: list[AsyncIterator[T]]) -> AsyncIterator[tuple[int, T]]:
    """Interleave several generators as `(index, item)` in arrival order."""
    pending: dict[asyncio.Future, int] = {}
    try:
        for i, gen in enumerate(gens):
            pending[asyncio.ensure_future(gen.__anext__())] = i
        while pending:
            done, _ = await asyncio.wait(pending, return_when=asyncio.FIRST_COMPLETED)
            for task in sorted(done, key=pending.__getitem__):
                i = pending.pop(task)
                try:
                    item = task.result()
                except StopAsyncIteration:
                    continue
                pending[asyncio.ensure_future(gens[i].__anext__())] = i
                yield i, item
    finally:
        # Cancel first: aclose() on a generator whose __anext__ is still running is an error.
        for task in pending:
            task.cancel()
        await asyncio.gather(*pending, return_exceptions=True)
        for gen in gens:
            await gen.aclose()


async def sse_events(events: AsyncIterator[dict]) -> AsyncIterator[str]:
    """`data: {json}` per event, then `data: [DONE]`; an error after the headers went out can
    only be reported in the stream, as one `{"error": ...}` event."""
    try:
        async for payload in events:
            yield sse(payload)
    except Exception as exc:  # noqa: BLE001 - the status line is already sent
        status, body = error_for(exc)
        if status >= 500:
            logger.warning("stream failed: %r", exc)
        yield sse(body)
    finally:
        await events.aclose()
    yield SSE_DONE


class SSEResponse(StreamingResponse):
    """A server-sent-event stream that always closes its body iterator.

    Starlette stops iterating when the client disconnects but leaves the iterator suspended
    (finalised only by the garbage collector); closing it here aborts the requests at once.
    """

    media_type = "text/event-stream"

    def __init__(self, content: AsyncIterator[str]) -> None:
        super().__init__(content, headers={"Cache-Control": "no-cache",
                                           "X-Accel-Buffering": "no"})

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        try:
            await super().__call__(scope, receive, send)
        finally:
            await self.body_iterator.aclose()
