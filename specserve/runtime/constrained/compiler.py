"""Compiling grammars in the tokenizer process, off the event loop and the scheduler's steps.

`GrammarCompiler.compile(spec)` runs the backend's compile in a worker thread (xgrammar
releases the GIL while it compiles, so the HTTP loop keeps serving), bounded by
`--grammar-compile-timeout`, and caches the result by (backend options, kind, text) in an LRU:
a request waits for its own grammar only, and a bad grammar is an `InvalidRequestError` naming
its field before anything is queued. What it returns, a `GrammarPayload`, carries the compiled
grammar as bytes to the model runner, which loads it without compiling again
(specserve/runtime/constrained/runner_grammars.py).

Failures are cached too (a grammar that did not compile will not, and one that took too long
would take as long again), so repeating a bad request costs no compile thread. A compile that
times out cannot be interrupted: its thread finishes it and the result is dropped; two threads
bound what such requests can hold.
"""

from __future__ import annotations

import asyncio
import logging
import time
import zlib
from collections import OrderedDict
from collections.abc import Callable
from concurrent.futures import Future, ThreadPoolExecutor

from specserve.runtime.constrained.base import GrammarBackend, GrammarCompileError
from specserve.runtime.constrained.spec import GrammarSpec
from specserve.runtime.errors import InvalidRequestError
from specserve.runtime.messages import GrammarPayload

logger = logging.getLogger(__name__)

CACHE_ENTRIES = 256
CACHE_BYTES = 512 * 2**20
# a compiled grammar larger than this (zlib-compressed, as shipped) is refused: every request
# carries it to the runner, which inflates and deserializes it (xgrammar: ~20 ms per shipped
# MiB). A JSON schema with a few string maxLength of 100-300 ships ~7.5 MiB (25 MiB inflated).
MAX_COMPILED_BYTES = 32 * 2**20
# level 1: 3.4x smaller xgrammar JSON at ~180 MB/s, once per compile (cached)
ZLIB_LEVEL = 1
COMPILE_THREADS = 2


class GrammarCompiler:
    """The tokenizer process's grammar compiles: threads, an LRU, counters for /metrics."""

    def __init__(self, make_backend: Callable[[], GrammarBackend], timeout_s: float = 10.0,
                 on_compile: Callable[[float], None] | None = None) -> None:
        self._pool = ThreadPoolExecutor(COMPILE_THREADS, thread_name_prefix="grammar")
        # the backend is built in the pool (xgrammar reads the whole vocabulary: ~0.2 s)
        self._backend: Future = self._pool.submit(make_backend)
        self.timeout_s = timeout_s
        self.on_compile = on_compile
        self._cache: OrderedDict[str, GrammarPayload | InvalidRequestError] = OrderedDict()
        self._cache_bytes = 0
        self._inflight: dict[str, asyncio.Task] = {}
        self.stats = {"compiles": 0, "compile_errors": 0, "compile_timeouts": 0,
                      "cache_hits": 0, "cache_misses": 0, "compile_s_total": 0.0,
                      "compile_s_max": 0.0}

    @property
    def backend(self) -> GrammarBackend:
        return self._backend.result()

    def info(self) -> dict:
        """For /server_info: the counters and what the cache holds."""
        return {**self.stats, "cached_grammars": len(self._cache),
                "cached_bytes": self._cache_bytes, "compile_timeout_s": self.timeout_s}

    async def compile(self, spec: GrammarSpec) -> GrammarPayload:
        """The payload of `spec`'s compiled grammar; `InvalidRequestError(spec.kind, ...)` when
        it does not compile, compiles to nothing, to too much, or not within the timeout."""
        backend = await asyncio.wrap_future(self._backend)
        key = spec.key(backend.compile_options)
        hit = self._cache.get(key)
        if hit is not None:
            self._cache.move_to_end(key)
            self.stats["cache_hits"] += 1
            return _result(hit)
        task = self._inflight.get(key)
        if task is None:
            self.stats["cache_misses"] += 1
            # a task of its own: a client that goes away does not cancel the compile that
            # other requests of the same grammar wait for
            task = asyncio.ensure_future(self._compile_and_store(backend, spec, key))
            self._inflight[key] = task
        else:  # the same grammar is compiling for another request: no compile of its own
            self.stats["cache_hits"] += 1
        return _result(await asyncio.shield(task))

    async def _compile_and_store(self, backend: GrammarBackend, spec: GrammarSpec,
                                 key: str) -> GrammarPayload | InvalidRequestError:
        try:
            result = await self._compile(backend, spec, key)
            self._store(key, result)
            return result
        finally:
            self._inflight.pop(key, None)

    async def _compile(self, backend: GrammarBackend, spec: GrammarSpec,
                       key: str) -> GrammarPayload | InvalidRequestError:
        t0 = time.perf_counter()
        work = asyncio.wrap_future(self._pool.submit(_compile_and_dump, backend, spec))
        try:
            data = await asyncio.wait_for(asyncio.shield(work), self.timeout_s)
        except (TimeoutError, asyncio.TimeoutError):
            self.stats["compile_timeouts"] += 1
            work.add_done_callback(_drop)  # (its thread still finishes the compile)
            logger.warning("grammar %s (%s) did not compile within %.1fs", key, spec.kind,
                           self.timeout_s)
            return InvalidRequestError(spec.kind, f"the grammar did not compile within "
                                       f"{self.timeout_s:g} s (--grammar-compile-timeout)")
        except GrammarCompileError as exc:
            self.stats["compile_errors"] += 1
            return InvalidRequestError(spec.kind, f"cannot compile the grammar: {exc}")
        elapsed = time.perf_counter() - t0
        self.stats["compiles"] += 1
        self.stats["compile_s_total"] += elapsed
        self.stats["compile_s_max"] = max(self.stats["compile_s_max"], elapsed)
        if self.on_compile is not None:
            self.on_compile(elapsed)
        if len(data) > MAX_COMPILED_BYTES:
            self.stats["compile_errors"] += 1
            return InvalidRequestError(spec.kind, f"the grammar compiles to {len(data)} bytes; "
                                       f"at most {MAX_COMPILED_BYTES} are served (simplify it: "
                                       "large repetition counts cost the most)")
        return GrammarPayload(key=key, kind=spec.kind, data=data)

    def _store(self, key: str, result: GrammarPayload | InvalidRequestError) -> None:
        self._cache[key] = result
        self._cache_bytes += _size(result)
        while len(self._cache) > CACHE_ENTRIES or self._cache_bytes > CACHE_BYTES:
            _, old = self._cache.popitem(last=False)
            self._cache_bytes -= _size(old)

    def shutdown(self) -> None:
        self._pool.shutdown(wait=False, cancel_futures=True)


def _compile_and_dump(backend: GrammarBackend, spec: GrammarSpec) -> bytes:
    return zlib.compress(backend.dump(backend.compile(spec)), ZLIB_LEVEL)


def _drop(fut: asyncio.Future) -> None:
    if not fut.cancelled():
        fut.exception()  # (retrieved: no "exception was never retrieved" warning)


def _size(entry: GrammarPayload | InvalidRequestError) -> int:
    return len(entry.data) if isinstance(entry, GrammarPayload) else 0


def _result(entry: GrammarPayload | InvalidRequestError) -> GrammarPayload:
    if isinstance(entry, InvalidRequestError):
        raise InvalidRequestError(entry.field, entry.message)
    return entry
