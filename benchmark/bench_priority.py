"""What an urgent request waits behind a full server, with and without priority scheduling.

    python -m benchmark.bench_priority --config fcfs= \\
        --config priority="--enable-priority-scheduling" \\
        --common-args "--max-running-requests 16" --rounds 2

Each configuration's server starts here (all at once; an idle server costs memory, not CPU)
and the configurations take turns, `--rounds` rounds, the first rotating, each run from a
flushed server. A run: `--background` closed-loop clients stream ShareGPT prompts at
`--background-priority` (`--background-tokens` new tokens, EOS ignored, so the load stays the
same), more than the server seats, so a queue forms; after `--settle` seconds, `--probes`
short requests (ShareGPT prompts, `--probe-tokens` new tokens) arrive as a Poisson stream at
`--probe-rate` per second with `--probe-priority`, and are timed as bench_serving times a
request (TTFT, TPOT, end to end). The background's output tok/s is counted over the same
window; the run ends when the last probe finishes, the background clients disconnect (which
aborts their requests) and the server drains. Every configuration receives the same requests,
priority fields included: a server without --enable-priority-scheduling ignores them.

A probe the server refuses (a 503 at a full `--max-queued-requests` queue) counts as failed;
latencies are of the probes served. A refused background client retries after 0.5 s.
Prints a table last (each configuration's median round, by probe TTFT p50; every round's
figures are in the JSON) and writes JSON.
"""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import json
import random
import shlex
import statistics
import time
from pathlib import Path
from typing import Any

import httpx
from tqdm import tqdm

from benchmark.bench_serving import (
    BenchConfig,
    _StreamState,
    build_call,
    fetch_server_info,
    send_request,
)
from benchmark.common import format_table, machine_info, stop_children_on_sigterm, write_json
from benchmark.serving_metrics import compute_metrics
from benchmark.sweep_serving import _flush, parse_config, server
from specserve.corpora.datasets import load_bench_tokenizer, sample_requests


async def _background(client: httpx.AsyncClient, calls: list, counter: dict[str, int],
                      start: int) -> None:
    """One closed-loop client: request after request until cancelled, counting every output
    token the server reports."""
    k = start
    while True:
        call = calls[k % len(calls)]
        k += 1
        state = _StreamState("specserve")
        seen = 0
        ok = False
        with contextlib.suppress(httpx.HTTPError, ValueError):
            async with client.stream("POST", call.path, json=call.payload) as resp:
                async for line in resp.aiter_lines():
                    if not line.startswith("data:") or line.endswith("[DONE]"):
                        continue
                    state.update(json.loads(line[5:]))
                    ct = state.completion_tokens or 0
                    counter["tokens"] += ct - seen
                    seen = ct
                ok = resp.status_code == 200
        if not ok:
            counter["errors"] += 1
            await asyncio.sleep(0.5)  # (no tight loop against a refusing server)


async def _drained(client: httpx.AsyncClient, timeout_s: float = 120) -> None:
    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline:
        info = await fetch_server_info(client) or {}
        if info.get("num_running_reqs") == 0 and info.get("num_waiting_reqs") == 0:
            return
        await asyncio.sleep(0.2)
    raise RuntimeError("the server did not drain after the run")


async def one_run(url: str, args: argparse.Namespace, background: list, probes: list,
                  seed: int) -> dict[str, Any]:
    timeout = httpx.Timeout(3600, connect=30.0, pool=None)
    limits = httpx.Limits(max_connections=args.background + args.probes + 4)
    async with httpx.AsyncClient(base_url=url, timeout=timeout, limits=limits) as client:
        before = await fetch_server_info(client) or {}
        counter = {"tokens": 0, "errors": 0}
        bg = [asyncio.create_task(_background(client, background, counter, i * 7))
              for i in range(args.background)]
        await asyncio.sleep(args.settle)
        loaded = await fetch_server_info(client) or {}
        tokens0, t0 = counter["tokens"], time.perf_counter()
        rng = random.Random(seed)
        tasks = []
        for i, call in enumerate(probes):
            if i > 0:
                await asyncio.sleep(rng.expovariate(args.probe_rate))
            tasks.append(asyncio.create_task(send_request(client, call, "specserve", {}, t0)))
        records = list(await asyncio.gather(*tasks))
        window = time.perf_counter() - t0
        bg_tokens = counter["tokens"] - tokens0
        for task in bg:
            task.cancel()
        await asyncio.gather(*bg, return_exceptions=True)
        await _drained(client)
        after = await fetch_server_info(client) or {}
    m = compute_metrics(records, window)
    return {
        "probe_metrics": m, "window_s": window, "background_tokens": bg_tokens,
        "background_tok_s": bg_tokens / window,
        "queue_when_probes_began": loaded.get("num_waiting_reqs"),
        "running_when_probes_began": loaded.get("num_running_reqs"),
        "preempted": after.get("preempted", 0) - before.get("preempted", 0),
        "retracted": after.get("retracted", 0) - before.get("retracted", 0),
        "failed_probes": sum(not r.success for r in records),
        "background_errors": counter["errors"],
    }


def _calls(reqs: list, priority: int, tokenizer, ignore_eos: bool) -> list:
    cfg = BenchConfig(ignore_eos=ignore_eos)
    out = []
    for r in reqs:
        call = build_call(r, cfg, tokenizer, "")
        call.payload["priority"] = priority
        out.append(call)
    return out


def _ms(m: dict[str, Any], key: str, stat: str) -> str:
    v = (m.get(key) or {}).get(stat)
    return "-" if v is None else f"{v:.0f}"


def report(results: dict[str, Any]) -> str:
    labels = list(results["configs"])
    base = results["configs"][labels[0]]["median"]
    rows = []
    for label in labels:
        cell = results["configs"][label]
        med = cell["median"]
        m = med["probe_metrics"]
        ttft = m["ttft_ms"]["median"]
        rows.append([
            label, _ms(m, "ttft_ms", "median"), _ms(m, "ttft_ms", "p90"),
            _ms(m, "ttft_ms", "p99"), _ms(m, "e2e_ms", "median"),
            _ms(m, "tpot_ms", "median"), f"{med['background_tok_s']:.1f}",
            f"{base['probe_metrics']['ttft_ms']['median'] / ttft:.1f}x" if ttft else "-",
            f"{med['background_tok_s'] / base['background_tok_s']:.2f}x"
            if base["background_tok_s"] else "-",
            " / ".join(f"{r['probe_metrics']['ttft_ms']['median']:.0f}" for r in cell["rounds"]),
            " / ".join(str(r["preempted"]) for r in cell["rounds"]),
            " / ".join(str(r.get("failed_probes", 0)) for r in cell["rounds"]),
            " / ".join(str(r.get("background_errors", 0)) for r in cell["rounds"]),
        ])
    a = results["args"]
    head = (f"{a['probes']} probes ({a['probe_tokens']} new tokens, priority "
            f"{a['probe_priority']}, {a['probe_rate']}/s) behind {a['background']} background "
            f"streams ({a['background_tokens']} new tokens, priority "
            f"{a['background_priority']}); common server args: {a['common_args']!r}; the "
            f"median round of {a['rounds']} (by probe TTFT p50), ms")
    return head + "\n" + format_table(
        ["config", "probe TTFT p50", "p90", "p99", "probe e2e p50", "probe TPOT p50",
         "background tok/s", f"TTFT gain vs {labels[0]}", f"background vs {labels[0]}",
         "TTFT p50 by round", "preempted by round", "probes refused by round",
         "background refusals by round"], rows)


def build_parser() -> argparse.ArgumentParser:
    ap = argparse.ArgumentParser(description=__doc__,
                                 formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--config", action="append", type=parse_config, default=None,
                    help="LABEL=SERVER ARGS, repeatable (default: fcfs= and priority="
                    "'--enable-priority-scheduling')")
    ap.add_argument("--common-args", default="--max-running-requests 16",
                    help="server args every configuration gets")
    ap.add_argument("--rounds", type=int, default=2)
    ap.add_argument("--background", type=int, default=32, help="closed-loop background clients")
    ap.add_argument("--background-tokens", type=int, default=256)
    ap.add_argument("--background-priority", type=int, default=0)
    ap.add_argument("--probes", type=int, default=16)
    ap.add_argument("--probe-tokens", type=int, default=32)
    ap.add_argument("--probe-priority", type=int, default=100)
    ap.add_argument("--probe-rate", type=float, default=0.2, help="probes per second")
    ap.add_argument("--settle", type=float, default=10.0,
                    help="seconds of background load before the first probe")
    ap.add_argument("--dataset", default="sharegpt")
    ap.add_argument("--split", default="heldout")
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--output", default="results/bench_priority.json")
    return ap


def main(argv: list[str] | None = None) -> int:
    args = build_parser().parse_args(argv)
    if args.rounds < 1 or args.probes < 1 or args.background < 0 or args.probe_rate <= 0:
        raise SystemExit("--rounds and --probes must be >= 1, --background >= 0, "
                         "--probe-rate > 0")
    stop_children_on_sigterm()
    configs = args.config or [("fcfs", []), ("priority", ["--enable-priority-scheduling"])]
    Path(args.output).parent.mkdir(parents=True, exist_ok=True)
    tokenizer = load_bench_tokenizer(None)
    bg_reqs = sample_requests(args.dataset, max(args.background * 2, 1), tokenizer, args.seed,
                              args.background_tokens, split=args.split)
    probe_reqs = sample_requests(args.dataset, args.probes, tokenizer, args.seed + 1,
                                 args.probe_tokens, split=args.split)
    background = _calls(bg_reqs, args.background_priority, tokenizer, ignore_eos=True)
    probes = _calls(probe_reqs, args.probe_priority, tokenizer, ignore_eos=True)
    labels = [label for label, _ in configs]
    runs: dict[str, list[dict[str, Any]]] = {label: [] for label in labels}
    with contextlib.ExitStack() as stack:
        urls = {}
        for label, sargs in tqdm(configs, desc="starting servers", unit="server"):
            log = Path(args.output).with_suffix(f".{label}.log")
            urls[label] = stack.enter_context(
                server([*sargs, *shlex.split(args.common_args)], log))
        bar = tqdm(total=args.rounds * len(labels), desc="runs", unit="run")
        for r in range(args.rounds):
            first = r % len(labels)
            for label in labels[first:] + labels[:first]:
                _flush(urls[label])
                bar.set_postfix_str(f"round {r + 1} {label}")
                out = asyncio.run(one_run(urls[label], args, background, probes, args.seed + r))
                runs[label].append(out)
                m = out["probe_metrics"]
                tqdm.write(f"{label} round {r + 1}: probe TTFT p50 "
                           f"{m['ttft_ms']['median']:.0f} ms, background "
                           f"{out['background_tok_s']:.1f} tok/s, preempted "
                           f"{out['preempted']}, failed probes {out['failed_probes']}")
                bar.update()
        bar.close()
    results: dict[str, Any] = {"machine": machine_info(), "args": vars(args), "configs": {}}
    for label, sargs in configs:
        rounds = runs[label]
        ttfts = [o["probe_metrics"]["ttft_ms"]["median"] for o in rounds]
        median = sorted(range(len(rounds)), key=lambda i: ttfts[i])[(len(rounds) - 1) // 2]
        results["configs"][label] = {"server_args": sargs, "rounds": rounds,
                                     "median": rounds[median],
                                     "median_ttft_p50_ms": statistics.median(ttfts)}
    path = write_json(args.output, results)
    print(f"\nwrote {path}\n")
    print(report(results))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
