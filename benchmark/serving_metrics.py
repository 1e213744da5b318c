"""Per-request records of a serving benchmark and the metrics SGLang's bench_serving reports.

Definitions (times in seconds in records, milliseconds in metrics):
- TTFT: request sent -> first chunk that carries generated tokens.
- ITL: gaps between consecutive token-carrying chunks, pooled over all requests (with
  speculative decoding one chunk may carry several tokens, so ITL >= TPOT there).
- TPOT: (e2e - ttft) / (output_len - 1) per request with output_len > 1.
- E2E: request sent -> stream finished.
- Throughputs: totals of successful requests / benchmark duration; concurrency = sum(e2e) /
  duration (the mean number of requests in flight).
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any

import numpy as np

from benchmark.common import format_table


@dataclass(slots=True)
class RequestRecord:
    id: str
    prompt_len: int  # the dataset's count, or the server's when it reports one
    success: bool = False
    error: str = ""
    output_len: int = 0  # server-reported completion tokens, else counted by tokenizing
    output_len_source: str = ""  # "server" | "tokenizer"
    output_len_retokenized: int = 0
    ttft: float = 0.0
    e2e: float = 0.0
    itl: list[float] = field(default_factory=list)
    start: float = 0.0  # seconds since the benchmark started
    num_chunks: int = 0
    finish_reason: str | None = None
    generated_text: str = ""
    spec_accept_length: float | None = None  # specserve meta_info, when speculating


def distribution(values_s: list[float]) -> dict[str, float]:
    """mean / median / p90 / p99 in milliseconds (zeros for no values, as SGLang prints)."""
    if not values_s:
        return {"mean": 0.0, "median": 0.0, "p90": 0.0, "p99": 0.0}
    ms = np.asarray(values_s, dtype=np.float64) * 1000.0
    return {
        "mean": float(ms.mean()),
        "median": float(np.median(ms)),
        "p90": float(np.percentile(ms, 90)),
        "p99": float(np.percentile(ms, 99)),
    }


def tpot(rec: RequestRecord) -> float | None:
    if not rec.success or rec.output_len <= 1:
        return None
    return (rec.e2e - rec.ttft) / (rec.output_len - 1)


def compute_metrics(records: list[RequestRecord], duration_s: float) -> dict[str, Any]:
    ok = [r for r in records if r.success]
    total_in = sum(r.prompt_len for r in ok)
    total_out = sum(r.output_len for r in ok)
    dur = max(duration_s, 1e-9)
    accept = [r.spec_accept_length for r in ok if r.spec_accept_length is not None]
    return {
        "duration_s": duration_s,
        "completed": len(ok),
        "failed": len(records) - len(ok),
        "total_input_tokens": total_in,
        "total_output_tokens": total_out,
        "total_output_tokens_retokenized": sum(r.output_len_retokenized for r in ok),
        "request_throughput": len(ok) / dur,
        "input_throughput": total_in / dur,
        "output_throughput": total_out / dur,
        "total_throughput": (total_in + total_out) / dur,
        "concurrency": sum(r.e2e for r in ok) / dur,
        "ttft_ms": distribution([r.ttft for r in ok]),
        "tpot_ms": distribution([t for r in ok if (t := tpot(r)) is not None]),
        "itl_ms": distribution([g for r in ok for g in r.itl]),
        "e2e_ms": distribution([r.e2e for r in ok]),
        "mean_spec_accept_length": sum(accept) / len(accept) if accept else None,
    }


def format_report(metrics: dict[str, Any], title: str = "") -> str:
    """Two tables: totals and throughputs, then the latency distributions in ms."""
    rows: list[list[Any]] = [
        ["completed / failed", f"{metrics['completed']} / {metrics['failed']}"],
        ["duration (s)", metrics["duration_s"]],
        ["input / output tokens",
         f"{metrics['total_input_tokens']} / {metrics['total_output_tokens']}"],
        ["request throughput (req/s)", metrics["request_throughput"]],
        ["input throughput (tok/s)", metrics["input_throughput"]],
        ["output throughput (tok/s)", metrics["output_throughput"]],
        ["concurrency", metrics["concurrency"]],
    ]
    for key, label in (("mean_spec_accept_length", "mean accept length (requests)"),
                       ("avg_spec_accept_length", "avg accept length (server)")):
        if metrics.get(key) is not None:
            rows.append([label, metrics[key]])
    lat_rows = [
        [name, *(metrics[key][s] for s in ("mean", "median", "p90", "p99"))]
        for name, key in (("TTFT", "ttft_ms"), ("TPOT", "tpot_ms"), ("ITL", "itl_ms"),
                          ("E2E", "e2e_ms"))
    ]
    parts = [title] if title else []
    parts += [format_table(["metric", "value"], rows), "",
              format_table(["latency (ms)", "mean", "median", "p90", "p99"], lat_rows)]
    return "\n".join(parts)
