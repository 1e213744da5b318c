"""Data parallelism on one machine, in one run: what sglang-router costs a request, and what
`--dp-size 2` gains over one server on the same cores.

    python -m benchmark.bench_data_parallel --output results/bench_data_parallel.json

Three servers run at once (started and stopped here):
- `one`: `python -m launch_server --num-threads <cores>`, the baseline of both parts;
- `routed`: sglang-router in front of `one`, with the command line `--dp-size` gives its
  router (specserve/launch/router.py);
- `dp`: `python -m launch_server --dp-size 2` (two replicas of cores/2 threads, its router).

After a warm-up run each (not timed): router overhead at each `--latency-concurrency` (1
and 8): `one` is asked directly and through `routed` by turns, `--rounds` rounds (the first to
go alternating), each run from flushed caches on the same ShareGPT chat requests (OpenAI chat
API, streamed, greedy, each `--latency-max-new-tokens` long: the same tokens both ways).
Reported: the median E2E latency and TTFT of each, and the median over requests of the routed
request's latency less the direct one's (paired by request and round), in ms.
Throughput: at `--throughput-concurrency` (16), `one` (DP = 1) and `dp` (DP = 2) by turns the
same way; output tok/s of the median round each, the median of the per-round ratios, and how
many requests each replica served.
Prints the table last and writes every run's metrics to the JSON.
"""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import re
import statistics
import subprocess
import time
from pathlib import Path
from typing import Any

import httpx
from tqdm import tqdm

from benchmark.bench_serving import BenchConfig, run_benchmark
from benchmark.common import (
    format_table,
    free_port,
    machine_info,
    stop_children_on_sigterm,
    stop_server,
    wait_healthy,
    write_json,
)
from benchmark.sweep_serving import _flush, server
from specserve.corpora.datasets import load_bench_tokenizer, sample_requests
from specserve.launch.router import router_command


def cpu_model() -> str:
    with contextlib.suppress(OSError, subprocess.SubprocessError):
        for line in subprocess.run(["lscpu"], capture_output=True, text=True).stdout.splitlines():
            if line.startswith("Model name:"):
                return line.split(":", 1)[1].strip()
    return "unknown"


@contextlib.contextmanager
def router_in_front(url: str, log_path: Path):
    port = free_port()
    cmd = router_command([url], "127.0.0.1", port, free_port(), None, "warning")
    with open(log_path, "w") as log:
        proc = subprocess.Popen(cmd, stdout=log, stderr=subprocess.STDOUT)
        routed = f"http://127.0.0.1:{port}"
        try:
            wait_healthy(routed, proc, 120, log=log_path)
            yield routed
        finally:
            stop_server(proc)


def replica_urls(url: str) -> list[str]:
    """The replicas behind a router (its /workers), or [url] for a server."""
    try:
        return [w["url"] for w in httpx.get(f"{url}/workers", timeout=10).json()["workers"]]
    except (httpx.HTTPError, ValueError, KeyError, TypeError):
        return [url]


def requests_served(url: str) -> list[float]:
    """Finished requests so far (`/metrics`) of a server, or of each replica behind a router."""
    out = []
    for u in replica_urls(url):
        m = re.search(r"^specserve_requests_total\{[^}]*\} (\S+)$",
                      httpx.get(f"{u}/metrics", timeout=10).text, re.M)
        out.append(float(m.group(1)) if m else 0.0)
    return out


def chat_requests(n: int, tokenizer, seed: int, max_new_tokens: int) -> list:
    """n ShareGPT chat requests the router takes: it refuses (400) a message with empty
    content, which a server answers."""
    reqs = sample_requests("sharegpt", 2 * n, tokenizer, seed, max_new_tokens)
    return [r for r in reqs if all(m["content"].strip() for m in r.messages)][:n]


def bench(url: str, c: int, reqs: list, tokenizer, seed: int,
          ignore_eos: bool = False) -> dict[str, Any]:
    cfg = BenchConfig(base_url=url, backend="openai", endpoint="chat", max_concurrency=c,
                      seed=seed, disable_tqdm=True, warmup_requests=min(c, 4),
                      ignore_eos=ignore_eos)
    out = asyncio.run(run_benchmark(reqs, cfg, tokenizer))
    failed = out["metrics"]["failed"]
    if failed:
        errors = [r.error for r in out["records"] if not r.success][:3]
        raise RuntimeError(f"{url}: {failed} requests failed: {errors}")
    return out


def by_turns(urls: dict[str, str], c: int, reqs: list, tokenizer, args, bar) -> dict:
    """Each target serves `reqs` at concurrency c from a flushed cache, `args.rounds` rounds,
    the first to go alternating; every run's output kept."""
    runs: dict[str, list] = {label: [] for label in urls}
    labels = list(urls)
    for r in range(args.rounds):
        for label in labels[r % 2:] + labels[:r % 2]:
            for u in replica_urls(urls[label]):
                _flush(u)
            before = requests_served(urls[label])
            runs[label].append(bench(urls[label], c, reqs, tokenizer, args.seed,
                                     ignore_eos="direct" in urls))
            # how the router shared the run out (warm-up requests included)
            runs[label][-1]["served"] = [b - a for a, b in zip(before,
                                                               requests_served(urls[label]))]
            bar.set_postfix_str(f"c={c} round {r + 1} {label}")
            bar.update()
    return runs


def latency_summary(runs: dict[str, list]) -> dict[str, Any]:
    """Median E2E / TTFT (ms) of every request of every round per target, and the median of
    the paired differences (routed less direct, same request, same round)."""
    direct, routed = runs["direct"], runs["routed"]
    out: dict[str, Any] = {}
    for key in ("e2e", "ttft"):
        values = {label: [getattr(rec, key) * 1e3 for run in rs for rec in run["records"]]
                  for label, rs in runs.items()}
        diffs = []
        for d, r in zip(direct, routed):
            d_by_id = {rec.id: getattr(rec, key) for rec in d["records"]}
            diffs += [(getattr(rec, key) - d_by_id[rec.id]) * 1e3 for rec in r["records"]]
        out[key] = {"direct_ms": statistics.median(values["direct"]),
                    "routed_ms": statistics.median(values["routed"]),
                    "paired_diff_ms": statistics.median(diffs)}
    return out


def throughput_summary(runs: dict[str, list]) -> dict[str, Any]:
    tps = {label: [run["metrics"]["output_throughput"] for run in rs]
           for label, rs in runs.items()}
    ratios = [b / a for a, b in zip(tps["dp1"], tps["dp2"])]
    return {"output_tok_s": {label: statistics.median(v) for label, v in tps.items()},
            "rounds_output_tok_s": tps, "paired_ratio": statistics.median(ratios),
            "round_ratios": ratios,
            "requests_per_replica": [run["served"] for run in runs["dp2"]]}


def report(results: dict[str, Any], threads: int) -> str:
    rows = []
    for c, s in results["router_overhead"].items():
        for key, name in (("e2e", "E2E median ms"), ("ttft", "TTFT median ms")):
            m = s[key]
            rows.append([name, c, "direct", f"{m['direct_ms']:.1f}", "via router",
                         f"{m['routed_ms']:.1f}",
                         f"{m['routed_ms'] - m['direct_ms']:+.1f} ms "
                         f"(paired {m['paired_diff_ms']:+.1f})"])
    for c, s in results["throughput"].items():
        t = s["output_tok_s"]
        lo, hi = min(s["round_ratios"]), max(s["round_ratios"])
        rows.append(["output tok/s", c, f"DP=1 x {threads} thr", f"{t['dp1']:.1f}",
                     f"DP=2 x {max(1, threads // 2)} thr", f"{t['dp2']:.1f}",
                     f"{s['paired_ratio']:.2f}x (rounds {lo:.2f}-{hi:.2f})"])
        shares = ["/".join(f"{n:.0f}" for n in run) for run in s["requests_per_replica"]]
        rows.append(["requests per replica", c, "", "", "DP=2", shares[0],
                     "every round" if len(set(shares)) == 1 else "rounds " + " ".join(shares)])
    return format_table(["measure", "conc", "baseline", "value", "candidate", "value",
                         "candidate vs baseline"], rows)


def run(args: argparse.Namespace) -> dict[str, Any]:
    tokenizer = load_bench_tokenizer(None)
    out = Path(args.output)
    out.parent.mkdir(parents=True, exist_ok=True)
    results: dict[str, Any] = {"router_overhead": {}, "throughput": {}, "runs": {}}
    levels = [(c, "latency") for c in args.latency_concurrency] + \
        [(c, "throughput") for c in args.throughput_concurrency]
    with contextlib.ExitStack() as stack:
        bar = stack.enter_context(tqdm(total=len(levels) * 2 * args.rounds + 3, unit="run",
                                       desc="bench_data_parallel"))
        bar.set_postfix_str("starting servers")
        one = stack.enter_context(server(["--num-threads", str(args.threads),
                                          "--enable-metrics"], out.with_suffix(".one.log")))
        bar.update()
        routed = stack.enter_context(router_in_front(one, out.with_suffix(".router.log")))
        bar.update()
        dp = stack.enter_context(server(
            ["--dp-size", "2", "--threads-per-replica", str(max(1, args.threads // 2)),
             "--enable-metrics"], out.with_suffix(".dp.log")))
        bar.update()
        for label, url in (("one", one), ("dp", dp)):  # a first load is slower: not timed
            bar.set_postfix_str(f"warm-up {label}")
            bench(url, 4, chat_requests(8, tokenizer, args.seed + 1, 32), tokenizer, args.seed)
        for c, kind in levels:
            n = max(args.num_prompts, (2 if kind == "latency" else 4) * c)
            reqs = chat_requests(n, tokenizer, args.seed, args.latency_max_new_tokens
                                 if kind == "latency" else args.max_new_tokens)
            urls = {"direct": one, "routed": routed} if kind == "latency" else \
                {"dp1": one, "dp2": dp}
            runs = by_turns(urls, c, reqs, tokenizer, args, bar)
            results["runs"][f"{kind}_c{c}"] = {
                label: [{"metrics": r["metrics"], "requests_per_replica": r["served"]}
                        for r in rs] for label, rs in runs.items()}
            summary = latency_summary(runs) if kind == "latency" else throughput_summary(runs)
            results["router_overhead" if kind == "latency" else "throughput"][str(c)] = summary
            tqdm.write(f"c={c} {kind}: {summary}")
    return results


def build_parser() -> argparse.ArgumentParser:
    import os

    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--latency-concurrency", type=int, nargs="+", default=[1, 8])
    p.add_argument("--throughput-concurrency", type=int, nargs="+", default=[16])
    p.add_argument("--threads", type=int, default=os.cpu_count() or 1,
                   help="the single server's threads (the replicas get half each)")
    p.add_argument("--num-prompts", type=int, default=16,
                   help="requests per run (at least 2x the concurrency for latency, 4x for "
                   "throughput)")
    p.add_argument("--max-new-tokens", type=int, default=128, help="throughput runs: the most "
                   "tokens a request generates (it may stop before)")
    p.add_argument("--latency-max-new-tokens", type=int, default=32, help="latency runs: the "
                   "tokens every request generates (ignore_eos: the same work per request)")
    p.add_argument("--rounds", type=int, default=5)
    p.add_argument("--seed", type=int, default=1)
    p.add_argument("--output", default="results/bench_data_parallel.json")
    return p


def main(argv: list[str] | None = None) -> int:
    args = build_parser().parse_args(argv)
    t0 = time.perf_counter()
    results = run(args)
    machine = {**machine_info(), "cpu": cpu_model()}
    path = write_json(args.output, {"config": vars(args), "machine": machine, **results,
                                    "seconds": time.perf_counter() - t0})
    print(f"bench_data_parallel  cpu={machine['cpu']}  json={path}")
    print(report(results, args.threads))
    return 0


if __name__ == "__main__":
    stop_children_on_sigterm()
    raise SystemExit(main())
