"""Speculation beside noisy neighbours, in one run: servers started together, each timing its
verify-cost curve while the others load, then served one at a time.

    python -m benchmark.bench_cost_learning --trials 3 --num-prompts 24 --max-new-tokens 128 \\
        --output results/bench_cost_learning.json

Parts (`--parts`):
- together: each trial starts three servers at once from this checkout (plain, NGRAM, SUFFIX),
  then sends held-out rewrite prompts (the answer repeats the prompt's passage) to each in turn,
  one request at a time, the order rotating prompt by prompt. Per server: output tok/s
  (completion tokens over the requests' wall time), its ratio to plain in the same trial, the
  accept length (tokens per verify step, /metrics), whether every output equals plain's token
  for token, and C(4) / C(8) of its start-up curve and of the curve it learned (/server_info).
- dp: `--dp-size 2 --speculative-algorithm NGRAM` behind sglang-router, the same prompts two at
  a time; each replica's accept length from its own /metrics.
- sweep: NGRAM served by this checkout and by `--baseline-checkout` (the current main, say),
  started together, taking turns at each `--concurrency` (ShareGPT held-out, `--rounds`
  rounds): output tok/s, and the median over rounds of this checkout's over the baseline's.
Prints a table last and writes every figure to the JSON.
"""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import re
import statistics
import subprocess
import sys
import time
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path
from typing import Any

import httpx

from benchmark.bench_data_parallel import cpu_model, replica_urls
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
from benchmark.sweep_serving import _flush
from specserve.corpora.datasets import chat_prompt_ids, load_bench_tokenizer, sample_requests

ROOT = Path(__file__).resolve().parents[1]
TOGETHER = {"plain": [], "NGRAM": ["--speculative-algorithm", "NGRAM"],
            "SUFFIX": ["--speculative-algorithm", "SUFFIX"]}


@contextlib.contextmanager
def servers_together(configs: dict[str, tuple[list[str], Path]], log_dir: Path):
    """Every configuration's `launch_server` started at once (label -> (flags, checkout)),
    then waited for; their URLs by label. Stopped on exit, whatever happens."""
    procs, urls, logs = {}, {}, []
    log_dir.mkdir(parents=True, exist_ok=True)
    try:
        for label, (flags, checkout) in configs.items():
            port = free_port()
            log = open(log_dir / f"{label}.log", "w")
            logs.append(log)
            procs[label] = subprocess.Popen(
                [sys.executable, "-m", "launch_server", "--port", str(port), "--enable-metrics",
                 *flags], cwd=checkout, stdout=log, stderr=subprocess.STDOUT)
            urls[label] = f"http://127.0.0.1:{port}"
        for label, proc in procs.items():
            wait_healthy(urls[label], proc, 900, log=log_dir / f"{label}.log")
        yield urls
    finally:
        for proc in procs.values():
            stop_server(proc)
        for log in logs:
            log.close()


def generate(url: str, ids: list[int], max_new_tokens: int) -> tuple[list[int], float]:
    """One greedy request: its output token ids and wall seconds."""
    t0 = time.perf_counter()
    r = httpx.post(f"{url}/generate", timeout=600, json={
        "input_ids": ids, "sampling_params": {"max_new_tokens": max_new_tokens,
                                              "temperature": 0.0}})
    r.raise_for_status()
    return r.json()["output_ids"], time.perf_counter() - t0


def spec_counters(url: str) -> tuple[float, float]:
    """(verify steps, accepted drafts) so far, from a server's /metrics."""
    text = httpx.get(f"{url}/metrics", timeout=30).text
    out = []
    for name in ("specserve_spec_decode_num_drafts", "specserve_spec_decode_num_accepted_tokens"):
        m = re.search(rf"^{name}(?:_total)?\{{[^}}]*\}} (\S+)$", text, re.M)
        out.append(float(m.group(1)) if m else 0.0)
    return out[0], out[1]


def accept_length(before: tuple[float, float], after: tuple[float, float]) -> float | None:
    steps, accepted = after[0] - before[0], after[1] - before[1]
    return (steps + accepted) / steps if steps else None


def curve_points(url: str) -> dict[str, Any]:
    """C(4) and C(8) of the start-up curve and of the curve the server plans with now."""
    info = httpx.get(f"{url}/server_info", timeout=30).json()
    out = {}
    for key in ("verify_cost_prior", "verify_cost"):
        c = info.get(key)
        if c:
            pts = dict(zip(c["rows"], c["ratios"]))
            out[key] = {n: pts.get(n) for n in (4, 8)}
            out[key + "_source"] = c.get("source", "")
    return out


def trial(k: int, prompts: list[list[int]], args, log_dir: Path) -> dict[str, Any]:
    configs = {label: (flags, ROOT) for label, flags in TOGETHER.items()}
    with servers_together(configs, log_dir / f"trial{k}") as urls:
        before = {label: spec_counters(u) for label, u in urls.items() if label != "plain"}
        tokens = {label: 0 for label in urls}
        secs = {label: 0.0 for label in urls}
        outputs: dict[str, list[list[int]]] = {label: [] for label in urls}
        order = list(urls)
        for i, ids in enumerate(prompts):
            for label in order[i % 3:] + order[:i % 3]:
                out, s = generate(urls[label], ids, args.max_new_tokens)
                outputs[label].append(out)
                tokens[label] += len(out)
                secs[label] += s
        res = {label: {"tok_s": tokens[label] / secs[label]} for label in urls}
        for label in before:
            res[label].update(
                speedup=res[label]["tok_s"] / res["plain"]["tok_s"],
                accept_length=accept_length(before[label], spec_counters(urls[label])),
                identical=outputs[label] == outputs["plain"], **curve_points(urls[label]))
        return res


def part_together(args, log_dir: Path) -> list[dict[str, Any]]:
    tok = load_bench_tokenizer(None)
    reqs = sample_requests("rewrite", args.num_prompts, tok, args.seed, args.max_new_tokens,
                           split="heldout")
    prompts = [chat_prompt_ids(tok, r.messages) for r in reqs]
    return [trial(k, prompts, args, log_dir) for k in range(args.trials)]


def part_dp(args, log_dir: Path) -> dict[str, Any]:
    tok = load_bench_tokenizer(None)
    reqs = sample_requests("rewrite", args.num_prompts, tok, args.seed + 1, args.max_new_tokens,
                           split="heldout")
    prompts = [chat_prompt_ids(tok, r.messages) for r in reqs]
    flags = ["--dp-size", "2", "--speculative-algorithm", "NGRAM"]
    with servers_together({"dp": (flags, ROOT)}, log_dir / "dp") as urls:
        replicas = replica_urls(urls["dp"])
        before = {u: spec_counters(u) for u in replicas}
        with ThreadPoolExecutor(2) as pool:
            list(pool.map(lambda ids: generate(urls["dp"], ids, args.max_new_tokens), prompts))
        return {u: {"accept_length": accept_length(before[u], spec_counters(u)),
                    "verify_steps": spec_counters(u)[0] - before[u][0], **curve_points(u)}
                for u in replicas}


def part_sweep(args, log_dir: Path) -> dict[str, Any]:
    tok = load_bench_tokenizer(None)
    configs = {"baseline": (TOGETHER["NGRAM"], Path(args.baseline_checkout)),
               "this": (TOGETHER["NGRAM"], ROOT)}
    out: dict[str, Any] = {}
    with servers_together(configs, log_dir / "sweep") as urls:
        for c in args.concurrency:
            n = max(args.sweep_prompts, c)
            reqs = sample_requests("sharegpt", n, tok, args.seed, args.sweep_max_new_tokens,
                                   split="heldout")
            runs: dict[str, list[float]] = {label: [] for label in urls}
            for r in range(args.rounds):
                for label in list(urls)[r % 2:] + list(urls)[:r % 2]:
                    _flush(urls[label])
                    cfg = BenchConfig(base_url=urls[label], max_concurrency=c, seed=args.seed,
                                      disable_tqdm=True, warmup_requests=min(c, 2))
                    m = asyncio.run(run_benchmark(reqs, cfg, tok))["metrics"]
                    runs[label].append(m["output_throughput"])
            ratios = [b / a for a, b in zip(runs["baseline"], runs["this"])]
            out[str(c)] = {"tok_s": runs, "paired_ratio": statistics.median(ratios),
                           "round_ratios": ratios}
    return out


def report(res: dict[str, Any]) -> str:
    rows = []
    for k, t in enumerate(res.get("together", [])):
        for label in ("NGRAM", "SUFFIX"):
            r = t[label]
            prior, live = r.get("verify_cost_prior", {}), r.get("verify_cost", {})
            rows.append([f"together, trial {k + 1}", label, f"{r['speedup']:.2f}x",
                         _num(r["accept_length"]), "yes" if r["identical"] else "NO",
                         f"{_num(prior.get(4))} / {_num(prior.get(8))}",
                         f"{_num(live.get(4))} / {_num(live.get(8))}"])
    for i, r in enumerate(res.get("dp", {}).values()):
        rows.append([f"dp 2, replica {i}", "NGRAM", "", _num(r["accept_length"]), "",
                     f"{_num(r.get('verify_cost_prior', {}).get(4))} / "
                     f"{_num(r.get('verify_cost_prior', {}).get(8))}",
                     f"{_num(r.get('verify_cost', {}).get(4))} / "
                     f"{_num(r.get('verify_cost', {}).get(8))}"])
    for c, s in res.get("sweep", {}).items():
        lo, hi = min(s["round_ratios"]), max(s["round_ratios"])
        rows.append([f"sweep c={c}", "NGRAM vs baseline", f"{s['paired_ratio']:.2f}x "
                     f"({lo:.2f}-{hi:.2f})", "", "", "", ""])
    return format_table(["run", "server", "vs plain / baseline", "accept len", "same output",
                         "start-up C(4)/C(8)", "learned C(4)/C(8)"], rows)


def _num(x: float | None) -> str:
    return "-" if x is None else f"{x:.2f}"


def build_parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--parts", nargs="+", default=["together", "dp", "sweep"],
                   choices=["together", "dp", "sweep"])
    p.add_argument("--trials", type=int, default=3)
    p.add_argument("--num-prompts", type=int, default=24)
    p.add_argument("--max-new-tokens", type=int, default=128)
    p.add_argument("--concurrency", type=int, nargs="+", default=[1, 32])
    p.add_argument("--sweep-prompts", type=int, default=32,
                   help="requests per sweep run (at least the concurrency)")
    p.add_argument("--sweep-max-new-tokens", type=int, default=64)
    p.add_argument("--rounds", type=int, default=2)
    p.add_argument("--baseline-checkout", default=str(ROOT),
                   help="the checkout the sweep compares against (its code serves)")
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--output", default="results/bench_cost_learning.json")
    return p


def main(argv: list[str] | None = None) -> int:
    args = build_parser().parse_args(argv)
    t0 = time.perf_counter()
    log_dir = Path(args.output).with_suffix("")
    log_dir.mkdir(parents=True, exist_ok=True)
    parts = {"together": part_together, "dp": part_dp, "sweep": part_sweep}
    res = {name: parts[name](args, log_dir) for name in args.parts}
    machine = {**machine_info(), "cpu": cpu_model()}
    path = write_json(args.output, {"config": vars(args), "machine": machine, **res,
                                    "seconds": time.perf_counter() - t0})
    print(f"bench_cost_learning  cpu={machine['cpu']}  json={path}  "
          f"{time.perf_counter() - t0:.0f}s")
    print(report(res))
    return 0


if __name__ == "__main__":
    stop_children_on_sigterm()
    raise SystemExit(main())
