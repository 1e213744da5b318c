"""How bench_speculative talks to what it measures: an in-process `Engine` or a running server's
native `/generate` over HTTP, and one pass of requests with bounded concurrency."""

from __future__ import annotations

import asyncio
import contextlib
import json
import logging
import time
from collections.abc import AsyncIterator, Callable
from typing import Any, Protocol
from urllib.parse import urlparse

import httpx
from tqdm import tqdm

from benchmark.spec_metrics import SpecRecord
from specserve.corpora.datasets import BenchRequest

logger = logging.getLogger("bench_speculative")


class Target(Protocol):
    """Something that generates: an in-process Engine or a server over HTTP."""

    def session(self) -> contextlib.AbstractAsyncContextManager[Any]: ...
    async def generate(self, input_ids: list[int], params: dict[str, Any]) -> dict[str, Any]: ...
    def server_info(self) -> dict[str, Any] | None: ...


class EngineTarget:
    def __init__(self, engine: Any) -> None:
        self.engine = engine

    @contextlib.asynccontextmanager
    async def session(self) -> AsyncIterator[EngineTarget]:
        yield self

    async def generate(self, input_ids: list[int], params: dict[str, Any]) -> dict[str, Any]:
        return await self.engine.async_generate(input_ids=input_ids, sampling_params=params)

    def server_info(self) -> dict[str, Any] | None:
        return self.engine.server_info()


class HttpTarget:
    """A running server's native `/generate` (specserve or SGLang), non-streaming."""

    def __init__(self, base_url: str, api_key: str | None, timeout_s: float) -> None:
        self.base_url = base_url.rstrip("/")
        self.headers = {"Authorization": f"Bearer {api_key}"} if api_key else {}
        self.timeout = httpx.Timeout(timeout_s, connect=30.0, pool=None)
        self._client: httpx.AsyncClient | None = None

    @contextlib.asynccontextmanager
    async def session(self) -> AsyncIterator[HttpTarget]:
        async with httpx.AsyncClient(base_url=self.base_url, timeout=self.timeout,
                                     headers=self.headers) as client:
            self._client = client
            try:
                yield self
            finally:
                self._client = None

    async def generate(self, input_ids: list[int], params: dict[str, Any]) -> dict[str, Any]:
        assert self._client is not None, "generate() outside session()"
        resp = await self._client.post("/generate", json={"input_ids": input_ids,
                                                          "sampling_params": params})
        if resp.status_code != 200:
            raise RuntimeError(f"HTTP {resp.status_code}: {resp.text[:300]}")
        return resp.json()

    def _get(self, path: str, method: str = "GET") -> dict[str, Any] | None:
        try:
            resp = httpx.request(method, self.base_url + path, headers=self.headers, timeout=30)
            return resp.json() if resp.status_code == 200 else None
        except (httpx.HTTPError, ValueError) as exc:
            logger.warning("%s %s failed: %s", method, path, exc)
            return None

    def server_info(self) -> dict[str, Any] | None:
        return self._get("/server_info")

    def flush_cache(self) -> None:
        self._get("/flush_cache", method="POST")

    def label(self) -> str:
        info = self.server_info() or {}
        algo = info.get("speculative_algorithm")
        if algo and info.get("speculative_num_draft_tokens"):
            algo = f"{algo}:num_draft_tokens={info['speculative_num_draft_tokens']}"
        return f"{algo or 'no-spec'}@{urlparse(self.base_url).netloc}"


def sampling_params(req: BenchRequest, temperature: float, seed: int | None,
                    filters: dict[str, Any] | None = None) -> dict[str, Any]:
    """`seed` None: an unseeded sampled request (speculative sampling's rejection path);
    `filters` (top_p, top_k, ...) apply to sampled requests only, those named "all:<name>"
    (penalties) to every request."""
    params: dict[str, Any] = {"max_new_tokens": req.max_new_tokens, "temperature": temperature}
    if "json_schema" in req.extra:  # a constrained request (the extraction dataset)
        params["json_schema"] = json.dumps(req.extra["json_schema"])
    filters = filters or {}
    params.update({k[4:]: v for k, v in filters.items() if k.startswith("all:")})
    if temperature > 0:
        params.update({k: v for k, v in filters.items() if not k.startswith("all:")})
        if seed is not None:
            # per request: sampled runs are reproducible and, seeded, equal to the baseline's
            params["seed"] = seed
    return params


def fill_record(rec: SpecRecord, out: dict[str, Any], e2e_s: float) -> None:
    meta = out.get("meta_info") or {}
    reason = meta.get("finish_reason")
    rec.finish_reason = reason.get("type") if isinstance(reason, dict) else reason
    rec.output_ids = [int(t) for t in out.get("output_ids") or []]
    rec.completion_tokens = int(meta.get("completion_tokens", len(rec.output_ids)))
    rec.e2e_s = e2e_s
    rec.spec_verify_ct = meta.get("spec_verify_ct")
    rec.spec_accept_length = meta.get("spec_accept_length")
    rec.spec_accept_histogram = meta.get("spec_accept_histogram")
    if rec.finish_reason == "abort":
        rec.error = f"aborted: {reason}"
    else:
        rec.success = True


async def run_requests(
    target: Target, reqs: list[BenchRequest], prompts: list[list[int]], concurrency: int,
    temperature: float, seed: int | None, desc: str, disable_tqdm: bool,
    filters: dict[str, Any] | None = None,
) -> tuple[list[SpecRecord], float]:
    """Every request with at most `concurrency` in flight (request i seeded with seed + i, none
    when `seed` is None); returns (records, wall seconds)."""
    sem = asyncio.Semaphore(concurrency)  # FIFO: with 1, requests run in dataset order
    bar = tqdm(total=len(reqs), desc=desc, disable=disable_tqdm, leave=False, unit="req")

    async def one(i: int, req: BenchRequest, ids: list[int], t_zero: float) -> SpecRecord:
        rec = SpecRecord(req.id, req.kind, len(ids), req.max_new_tokens)
        async with sem:
            t0 = time.perf_counter()
            rec.start_s = t0 - t_zero
            try:
                out = await target.generate(
                    ids, sampling_params(req, temperature, None if seed is None else seed + i,
                                         filters))
            except Exception as exc:  # noqa: BLE001 - a failed request is counted, not fatal
                rec.error = f"{type(exc).__name__}: {exc}"
            else:
                fill_record(rec, out, time.perf_counter() - t0)
        bar.update(1)
        return rec

    async with target.session():
        t_zero = time.perf_counter()
        records = await asyncio.gather(*(one(i, r, p, t_zero)
                                         for i, (r, p) in enumerate(zip(reqs, prompts))))
        wall = time.perf_counter() - t_zero
    bar.close()
    return list(records), wall


def render_prompts(
    reqs: list[BenchRequest], chat_ids: Callable[[list[dict]], list[int]],
    tokenize: Callable[[str], list[int]],
) -> list[list[int]]:
    out = []
    for r in reqs:
        if r.messages is not None:
            out.append(chat_ids(r.messages))
        elif r.prompt is not None:
            out.append(tokenize(r.prompt))
        else:
            out.append(list(r.input_ids or []))
    return out
