"""Online serving benchmark: stream requests to a running server and measure TTFT, TPOT, ITL,
E2E latency and throughput the way SGLang's bench_serving defines them (`serving_metrics`).

    python -m launch_server &                                # or any OpenAI-compatible server
    python -m benchmark.bench_serving --dataset rewrite --split heldout --num-prompts 20
    python -m benchmark.bench_serving --backend openai --endpoint chat \\
        --base-url http://127.0.0.1:8000 --dataset sharegpt --request-rate 2

- `--backend specserve`: POST /generate, SSE lines `data: {json}` with cumulative `text` and
  `meta_info` (`completion_tokens`, `prompt_tokens`, `finish_reason`, `spec_accept_length`),
  ending `data: [DONE]`; afterwards GET /server_info for `avg_spec_accept_length`.
- `--backend openai`: POST /v1/chat/completions or /v1/completions with `stream: true` and
  `stream_options.include_usage`, so token counts come from the server's `usage`.
Output tokens are the server's count when it reports one, else the generated text tokenized.
Failed requests (HTTP errors, error chunks, broken streams) are counted, not fatal.
Prints a table last and writes full JSON, per-request records included (`--output`).
"""

from __future__ import annotations

import argparse
import asyncio
import json
import logging
import math
import random
import time
from dataclasses import asdict, dataclass, replace
from typing import Any

import httpx
import msgspec
from tqdm import tqdm

from benchmark.common import machine_info, write_json
from benchmark.serving_metrics import RequestRecord, compute_metrics, format_report
from specserve.corpora.datasets import (
    DATASETS,
    SPLITS,
    BenchRequest,
    Tokenizer,
    chat_prompt_ids,
    load_bench_tokenizer,
    sample_requests,
)

logger = logging.getLogger(__name__)
WARMUP_MAX_NEW_TOKENS = 16
_decode = msgspec.json.Decoder().decode


@dataclass(frozen=True)
class BenchConfig:
    base_url: str = "http://127.0.0.1:30000"
    backend: str = "specserve"  # "specserve" | "openai"
    endpoint: str = "chat"  # openai only: "chat" | "completions"
    api_key: str | None = None
    model: str | None = None  # openai only; None: the first id of GET /v1/models
    request_rate: float = math.inf  # requests/s, Poisson arrivals; inf sends all at once
    max_concurrency: int | None = None
    temperature: float = 0.0
    ignore_eos: bool = False
    warmup_requests: int = 1
    seed: int = 0
    disable_tqdm: bool = False
    request_timeout_s: float = 600.0
    # ask for each output token's logprob and this many alternatives (None: no logprobs)
    logprobs: int | None = None
    spec_trace: bool = False  # ask for the speculation trace (its cost: docs/benchmarks.md)


@dataclass(slots=True)
class _Call:
    req: BenchRequest
    path: str
    payload: dict[str, Any]


def build_call(req: BenchRequest, cfg: BenchConfig, tokenizer: Tokenizer, model: str) -> _Call:
    """The HTTP path and JSON body of one request for the configured backend."""
    if cfg.backend == "specserve":
        if req.messages is not None:
            prompt: dict[str, Any] = {"input_ids": chat_prompt_ids(tokenizer, req.messages)}
        elif req.prompt is not None:
            prompt = {"text": req.prompt}
        else:
            prompt = {"input_ids": req.input_ids}
        params = {"max_new_tokens": req.max_new_tokens, "temperature": cfg.temperature,
                  "ignore_eos": cfg.ignore_eos}
        if "json_schema" in req.extra:  # a constrained request (the extraction dataset)
            params["json_schema"] = json.dumps(req.extra["json_schema"])
        extra = {} if cfg.logprobs is None else {"return_logprob": True,
                                                 "top_logprobs_num": cfg.logprobs}
        if cfg.spec_trace:
            extra["return_spec_trace"] = True
        return _Call(req, "/generate", {**prompt, "sampling_params": params, "stream": True,
                                        **extra})
    body: dict[str, Any] = {
        "model": model, "max_tokens": req.max_new_tokens, "temperature": cfg.temperature,
        "stream": True, "stream_options": {"include_usage": True},
    }
    if cfg.ignore_eos:
        body["ignore_eos"] = True  # a vLLM / SGLang extension of the OpenAI API
    if cfg.spec_trace:
        body["return_spec_trace"] = True  # ours
    if "json_schema" in req.extra:  # OpenAI's structured output, as llama-server takes it too
        body["response_format"] = {"type": "json_schema", "json_schema": {
            "name": "extraction", "schema": req.extra["json_schema"], "strict": True}}
    if cfg.endpoint == "chat":
        messages = req.messages or [
            {"role": "user", "content": req.prompt or tokenizer.decode(req.input_ids or [])}
        ]
        if cfg.logprobs is not None:
            body.update(logprobs=True, top_logprobs=cfg.logprobs)
        return _Call(req, "/v1/chat/completions", {**body, "messages": messages})
    if cfg.logprobs is not None:
        body["logprobs"] = cfg.logprobs
    if req.messages is not None:
        text = tokenizer.apply_chat_template(req.messages, tokenize=False,
                                             add_generation_prompt=True)
        return _Call(req, "/v1/completions", {**body, "prompt": text})
    return _Call(req, "/v1/completions", {**body, "prompt": req.prompt or req.input_ids})


class _StreamState:
    """What one stream has told us so far; `update` says whether a chunk carried tokens."""

    def __init__(self, backend: str) -> None:
        self.backend = backend
        self.text = ""
        self.completion_tokens: int | None = None
        self.prompt_tokens: int | None = None
        self.finish_reason: str | None = None
        self.spec_accept_length: float | None = None

    def update(self, chunk: dict[str, Any]) -> bool:
        if self.backend == "specserve":
            meta = chunk.get("meta_info") or {}
            text = chunk.get("text") or ""
            ct = meta.get("completion_tokens")
            ids = chunk.get("output_ids")
            if ct is not None and ids is not None and len(ids) < ct:
                # fewer ids than generated: an --incremental-streaming-output chunk (new only)
                grew = bool(text)
                self.text += text
            else:  # cumulative chunks (the default)
                grew = len(text) > len(self.text)
                self.text = text if grew else self.text
            if ct is not None:
                grew = grew or ct > (self.completion_tokens or 0)
                self.completion_tokens = ct
            self.prompt_tokens = meta.get("prompt_tokens", self.prompt_tokens)
            reason = meta.get("finish_reason")
            if reason is not None:  # SGLang sends {"type": "length", ...}
                self.finish_reason = reason.get("type") if isinstance(reason, dict) else reason
            self.spec_accept_length = meta.get("spec_accept_length", self.spec_accept_length)
            return grew
        usage = chunk.get("usage")
        if usage:
            self.completion_tokens = usage.get("completion_tokens", self.completion_tokens)
            self.prompt_tokens = usage.get("prompt_tokens", self.prompt_tokens)
        grew = False
        for choice in chunk.get("choices") or []:
            delta = choice.get("text") if "text" in choice else (choice.get("delta") or {}).get(
                "content")
            if delta:
                self.text += delta
                grew = True
            self.finish_reason = choice.get("finish_reason") or self.finish_reason
        return grew


async def send_request(
    client: httpx.AsyncClient, call: _Call, backend: str, headers: dict[str, str], t_zero: float
) -> RequestRecord:
    rec = RequestRecord(id=call.req.id, prompt_len=call.req.prompt_len)
    state = _StreamState(backend)
    t0 = time.perf_counter()
    rec.start = t0 - t_zero
    last = None
    try:
        async with client.stream("POST", call.path, json=call.payload, headers=headers) as resp:
            if resp.status_code != 200:
                body = (await resp.aread()).decode(errors="replace")
                rec.error = f"HTTP {resp.status_code}: {body[:300]}"
                return rec
            async for line in resp.aiter_lines():
                if not line.startswith("data:"):
                    continue  # blank separators, SSE comments, event names
                data = line[5:].strip()
                if data == "[DONE]":
                    break
                now = time.perf_counter()
                # (msgspec: a chunk with logprobs holds all of them so far, and json.loads
                # of them cost this client ~0.3 ms a chunk on the cores the server runs on)
                chunk = _decode(data)
                if chunk.get("error"):
                    rec.error = f"error chunk: {str(chunk['error'])[:300]}"
                    return rec
                rec.num_chunks += 1
                if state.update(chunk):
                    if last is None:
                        rec.ttft = now - t0
                    else:
                        rec.itl.append(now - last)
                    last = now
    except (httpx.HTTPError, json.JSONDecodeError, AttributeError, TypeError) as exc:
        rec.error = f"{type(exc).__name__}: {exc}"
        return rec
    rec.e2e = time.perf_counter() - t0
    if last is None:
        rec.ttft = rec.e2e
    rec.success = True
    rec.generated_text = state.text
    rec.finish_reason = state.finish_reason
    rec.spec_accept_length = state.spec_accept_length
    if state.prompt_tokens is not None:
        rec.prompt_len = state.prompt_tokens
    if state.completion_tokens is not None:
        rec.output_len, rec.output_len_source = state.completion_tokens, "server"
    return rec


async def _discover_model(client: httpx.AsyncClient, headers: dict[str, str]) -> str:
    try:
        resp = await client.get("/v1/models", headers=headers)
        return resp.json()["data"][0]["id"]
    except (httpx.HTTPError, ValueError, KeyError, IndexError, TypeError):
        return "default"


async def fetch_server_info(
    client: httpx.AsyncClient, headers: dict[str, str] | None = None
) -> dict[str, Any] | None:
    try:
        resp = await client.get("/server_info", headers=headers or {})
        return resp.json() if resp.status_code == 200 else None
    except (httpx.HTTPError, ValueError) as exc:
        logger.warning("GET /server_info failed: %s", exc)
        return None


def avg_spec_accept_length(info: dict[str, Any] | None) -> float | None:
    """SGLang reports it per scheduler in `internal_states[]`; accept it at top level too."""
    if not info:
        return None
    if info.get("avg_spec_accept_length") is not None:
        return float(info["avg_spec_accept_length"])
    values = [s["avg_spec_accept_length"] for s in info.get("internal_states") or []
              if isinstance(s, dict) and s.get("avg_spec_accept_length") is not None]
    return sum(values) / len(values) if values else None


async def run_benchmark(
    requests: list[BenchRequest], cfg: BenchConfig, tokenizer: Tokenizer
) -> dict[str, Any]:
    """Warm up, send every request (Poisson arrivals, bounded concurrency), and measure.

    Returns {"metrics", "server_info", "records"}; raises RuntimeError when every warm-up
    request fails (no server, wrong backend)."""
    headers = {"Authorization": f"Bearer {cfg.api_key}"} if cfg.api_key else {}
    timeout = httpx.Timeout(cfg.request_timeout_s, connect=30.0, pool=None)
    limits = httpx.Limits(max_connections=cfg.max_concurrency, max_keepalive_connections=64)
    async with httpx.AsyncClient(base_url=cfg.base_url, timeout=timeout, limits=limits) as client:
        model = cfg.model or ""
        if cfg.backend == "openai" and not model:
            model = await _discover_model(client, headers)
        calls = [build_call(r, cfg, tokenizer, model) for r in requests]
        if cfg.warmup_requests > 0 and calls:
            warm = [replace(calls[i % len(calls)], payload=_capped(calls[i % len(calls)], cfg))
                    for i in range(cfg.warmup_requests)]
            t = time.perf_counter()
            done = await asyncio.gather(*(send_request(client, c, cfg.backend, headers, t)
                                          for c in warm))
            if not any(r.success for r in done):
                raise RuntimeError(f"every warm-up request failed: {done[0].error}")

        sem = asyncio.Semaphore(cfg.max_concurrency) if cfg.max_concurrency else None
        bar = tqdm(total=len(calls), disable=cfg.disable_tqdm, desc="requests")
        rng = random.Random(cfg.seed)

        async def one(call: _Call, t_zero: float) -> RequestRecord:
            if sem is None:
                rec = await send_request(client, call, cfg.backend, headers, t_zero)
            else:
                async with sem:
                    rec = await send_request(client, call, cfg.backend, headers, t_zero)
            bar.update(1)
            return rec

        t_zero = time.perf_counter()
        tasks = []
        for i, call in enumerate(calls):
            if i > 0 and math.isfinite(cfg.request_rate):
                await asyncio.sleep(rng.expovariate(cfg.request_rate))
            tasks.append(asyncio.create_task(one(call, t_zero)))
        records = list(await asyncio.gather(*tasks))
        duration = time.perf_counter() - t_zero
        bar.close()
        server_info = None
        if cfg.backend == "specserve":
            server_info = await fetch_server_info(client, headers)

    for rec in records:  # tokenize after the run so it never delays a stream's timestamps
        if rec.success:
            rec.output_len_retokenized = len(
                tokenizer.encode(rec.generated_text, add_special_tokens=False))
            if not rec.output_len_source:
                rec.output_len, rec.output_len_source = rec.output_len_retokenized, "tokenizer"
    metrics = compute_metrics(records, duration)
    metrics["avg_spec_accept_length"] = avg_spec_accept_length(server_info)
    return {"metrics": metrics, "server_info": server_info, "records": records}


def _capped(call: _Call, cfg: BenchConfig) -> dict[str, Any]:
    payload = json.loads(json.dumps(call.payload))
    if cfg.backend == "specserve":
        payload["sampling_params"]["max_new_tokens"] = WARMUP_MAX_NEW_TOKENS
    else:
        payload["max_tokens"] = WARMUP_MAX_NEW_TOKENS
    return payload


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    d = BenchConfig()
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--base-url", default=d.base_url)
    p.add_argument("--backend", choices=("specserve", "openai"), default=d.backend)
    p.add_argument("--endpoint", choices=("chat", "completions"), default=d.endpoint)
    p.add_argument("--api-key", default=d.api_key)
    p.add_argument("--model", default=d.model, help="openai backend: the model name to send")
    p.add_argument("--tokenizer", default=None, help="model dir (default: embedded model)")
    p.add_argument("--dataset", choices=DATASETS, default="sharegpt")
    p.add_argument("--dataset-path", default=None)
    p.add_argument("--split", choices=SPLITS, default="all")
    p.add_argument("--num-prompts", type=int, default=20)
    p.add_argument("--random-input-len", type=int, default=256)
    p.add_argument("--random-output-len", type=int, default=128)
    p.add_argument("--random-range-ratio", type=float, default=0.0)
    p.add_argument("--shared-prefix-len", type=int, default=512,
                   help="shared-prefix: tokens of each group's system prompt (questions: "
                   "--random-input-len, outputs: --random-output-len)")
    p.add_argument("--shared-prefix-groups", type=int, default=4)
    p.add_argument("--request-rate", type=float, default=d.request_rate)
    p.add_argument("--max-concurrency", type=int, default=d.max_concurrency)
    p.add_argument("--max-new-tokens", type=int, default=None, help="cap on output lengths")
    p.add_argument("--ignore-eos", action="store_true")
    p.add_argument("--temperature", type=float, default=d.temperature)
    p.add_argument("--seed", type=int, default=d.seed)
    p.add_argument("--warmup-requests", type=int, default=d.warmup_requests)
    p.add_argument("--request-timeout", type=float, default=d.request_timeout_s)
    p.add_argument("--output", default="results/bench_serving.json")
    p.add_argument("--disable-tqdm", action="store_true")
    p.add_argument("--spec-trace", action="store_true",
                   help="requests ask for the speculation trace (return_spec_trace)")
    p.add_argument("--logprobs", type=int, default=None, metavar="N",
                   help="ask for every output token's logprob and N alternatives")
    return p.parse_args(argv)


def main(argv: list[str] | None = None) -> int:
    logging.basicConfig(level=logging.INFO, format="%(levelname)s %(name)s: %(message)s")
    args = parse_args(argv)
    cfg = BenchConfig(
        base_url=args.base_url, backend=args.backend, endpoint=args.endpoint,
        api_key=args.api_key, model=args.model, request_rate=args.request_rate,
        max_concurrency=args.max_concurrency, temperature=args.temperature,
        ignore_eos=args.ignore_eos, warmup_requests=args.warmup_requests, seed=args.seed,
        disable_tqdm=args.disable_tqdm, request_timeout_s=args.request_timeout,
        logprobs=args.logprobs, spec_trace=args.spec_trace,
    )
    tokenizer = load_bench_tokenizer(args.tokenizer)
    requests = sample_requests(
        args.dataset, args.num_prompts, tokenizer, args.seed, args.max_new_tokens,
        dataset_path=args.dataset_path, split=args.split, random_input_len=args.random_input_len,
        random_output_len=args.random_output_len, random_range_ratio=args.random_range_ratio,
        shared_prefix_len=args.shared_prefix_len, shared_prefix_groups=args.shared_prefix_groups,
    )
    try:
        result = asyncio.run(run_benchmark(requests, cfg, tokenizer))
    except RuntimeError as exc:
        logger.error("%s (is a %s server listening at %s?)", exc, cfg.backend, cfg.base_url)
        return 2
    path = write_json(args.output, {
        "config": {**vars(args), "request_rate": str(args.request_rate)},
        "machine": machine_info(),
        "metrics": result["metrics"],
        "server_info": result["server_info"],
        "requests": [asdict(r) for r in result["records"]],
    })
    title = (f"bench_serving  backend={cfg.backend}  dataset={args.dataset}  "
             f"rate={args.request_rate}  json={path}")
    print(format_report(result["metrics"], title))
    return 0 if result["metrics"]["completed"] else 1


if __name__ == "__main__":
    raise SystemExit(main())
