"""Shared benchmark helpers: timing, medians, tables, JSON output."""

from __future__ import annotations

import contextlib
import json
import platform
import signal
import statistics
import subprocess
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

import httpx
import torch

from specserve.runtime.proc_utils import free_port  # noqa: F401 - the benchmarks' import


def median_time(fn: Callable[[], Any], reps: int, warmup: int = 1) -> float:
    """Median wall time of `fn` in seconds over `reps` runs after `warmup` runs."""
    for _ in range(warmup):
        fn()
    times = []
    for _ in range(reps):
        t0 = time.perf_counter()
        fn()
        times.append(time.perf_counter() - t0)
    return statistics.median(times)


def parse_engine_spec(spec: str) -> tuple[str, int | None, str | None, str | None]:
    """`FMT[:DIGITS][@ISA][/KV]` (e.g. `auto`, `auto:1`, `auto@avx512`, `auto/float16`) as
    (weight format, activation digits, CPU instruction set, KV cache dtype), None where unset."""
    rest, _, kv = spec.partition("/")
    rest, _, isa = rest.partition("@")
    fmt, _, digits = rest.partition(":")
    return fmt, int(digits) if digits else None, isa or None, kv or None


def machine_info() -> dict[str, Any]:
    return {
        "platform": platform.platform(),
        "processor": platform.processor(),
        "torch": torch.__version__,
        "threads": torch.get_num_threads(),
        "cuda": torch.cuda.get_device_name(0) if torch.cuda.is_available() else None,
    }


def format_table(headers: list[str], rows: list[list[Any]]) -> str:
    cells = [[f"{c:.2f}" if isinstance(c, float) else str(c) for c in row] for row in rows]
    widths = [max(len(h), *(len(r[i]) for r in cells)) for i, h in enumerate(headers)]
    line = "  ".join(h.rjust(w) for h, w in zip(headers, widths))
    out = [line, "-" * len(line)]
    out += ["  ".join(c.rjust(w) for c, w in zip(r, widths)) for r in cells]
    return "\n".join(out)


def write_json(path: str | Path, data: dict[str, Any]) -> Path:
    path = Path(path)
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text(json.dumps(data, indent=2))
    return path


def wait_healthy(url: str, proc: subprocess.Popen, timeout_s: float = 300,
                 interval_s: float = 0.5, log: str | Path | None = None) -> float:
    """Poll `url`/health until it answers 200 while `proc` (the server) runs; the seconds it
    took. RuntimeError if the server exits or `timeout_s` passes first (naming `log`, the
    server's log file, when given).

    One `httpx.Client` for every poll: a bare `httpx.get` builds a client and its SSL context
    per call, ~35 ms of CPU on the 2-core machines here, so polling every 0.5 s took ~7% of a
    core (every 50 ms: ~70%) from the server being waited for, whose model runner is timing
    its verify-cost curve at that moment (docs/benchmarks.md, "Start-up")."""
    t0 = time.monotonic()
    where = f"; log: {log}" if log else ""
    with httpx.Client(timeout=1) as client:
        while True:
            if proc.poll() is not None:
                raise RuntimeError(f"server exited during start-up (exit code "
                                   f"{proc.returncode}){where}")
            with contextlib.suppress(httpx.HTTPError):
                if client.get(f"{url}/health").status_code == 200:
                    return time.monotonic() - t0
            if time.monotonic() - t0 > timeout_s:
                raise RuntimeError(f"server at {url} not healthy after {timeout_s:.0f}s{where}")
            time.sleep(interval_s)


def stop_server(proc: subprocess.Popen, sig: int = signal.SIGTERM, wait_s: float = 30) -> None:
    """Stop a server child with `sig`, SIGKILL if it has not exited after `wait_s` seconds."""
    if proc.poll() is None:
        proc.send_signal(sig)
        try:
            proc.wait(wait_s)
        except subprocess.TimeoutExpired:
            proc.kill()
            proc.wait()


def stop_children_on_sigterm() -> None:
    """Make SIGTERM raise SystemExit, so a benchmark that is stopped (`kill`, a CI timeout)
    still runs its `finally` blocks and stops the servers it started: Python's default
    SIGTERM ends the process on the spot and left them running (seen with `sweep_serving`)."""

    def _exit(signum, frame):
        raise SystemExit(128 + signum)

    signal.signal(signal.SIGTERM, _exit)

