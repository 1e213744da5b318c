"""bench_serving at several concurrencies, for one or more server configurations, each server
started and stopped here (one at a time), so a sweep is one command and leaves nothing running.

    python -m benchmark.sweep_serving --concurrency 1 4 8 16 32 64 --max-new-tokens 128 \\
        --config none= --config NGRAM="--speculative-algorithm NGRAM" \\
        --output results/sweep_serving.json

Every configuration sees the same prompts at a given concurrency (`--num-prompts` per level:
at least `--prompts-per-slot` × concurrency). Prints a table last (output tok/s, TTFT, ITL p99,
and each configuration's ratio to the first one at the same concurrency), writes the JSON and a
plot beside it.

`--rounds R` (R >= 1) interleaves instead: every configuration's server starts at once (an
idle server blocks in its polls: memory, no CPU), and at each concurrency the configurations
take turns, R rounds, the first to run rotating; each run starts from a flushed server (radix
cache and drafter state, so no run drafts from an earlier run's answers to the same prompts).
A cell reports its median round (by output tok/s; every round's figure is in the JSON). This
machine's speed drifts by 10-20% over the minutes a sequential sweep takes, which one config
after another turns into its ratios; taking turns puts the drift into every configuration alike.
The table then also gives each configuration's paired ratio: the median over rounds of its
tok/s over the baseline's in the same round (the runs of a round are a minute apart, the rounds
several), which is less exposed to the drift between rounds than the ratio of the medians,
and the range of those per-round ratios ("round ratios", lowest-highest): a cell whose range
straddles a bar (0.95x, say) is not resolved by the run, however its median falls.

`--report JSON` prints the table of an earlier run's JSON again (no servers).
"""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import json
import os
import shlex
import statistics
import subprocess
import sys
import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import httpx

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
from specserve.corpora.datasets import load_bench_tokenizer, sample_requests

ROOT = Path(__file__).resolve().parents[1]


@contextlib.contextmanager
def server(args: list[str], log_path: Path, timeout_s: float = 300,
           checkout: Path = ROOT) -> Iterator[str]:
    """A `launch_server` child on a free port, run from `checkout` (this repository, or another
    checkout of it: its code serves); SIGTERM (then SIGKILL) on exit, whatever happens."""
    port = free_port()
    cmd = [sys.executable, "-m", "launch_server", "--port", str(port), *args]
    log = open(log_path, "w")
    proc = subprocess.Popen(cmd, cwd=checkout, stdout=log, stderr=subprocess.STDOUT)
    url = f"http://127.0.0.1:{port}"
    try:
        wait_healthy(url, proc, timeout_s, log=log_path)
        yield url
    finally:
        stop_server(proc)
        log.close()


def parse_config(text: str) -> tuple[str, list[str]]:
    label, _, args = text.partition("=")
    if not label:
        raise argparse.ArgumentTypeError(f"--config wants LABEL=ARGS, got {text!r}")
    return label, shlex.split(args)


def parse_checkout(text: str) -> tuple[str, Path]:
    label, _, path = text.partition("=")
    if not label or not (Path(path) / "launch_server.py").is_file():
        raise argparse.ArgumentTypeError(f"--checkout wants LABEL=DIR of a checkout, got {text!r}")
    return label, Path(path).resolve()


def _level_requests(args: argparse.Namespace, tokenizer, c: int) -> list:
    """The requests of concurrency level c: `--num-prompts`, at least `--prompts-per-slot` x c."""
    n = max(args.num_prompts, args.prompts_per_slot * c)
    return sample_requests(args.dataset, n, tokenizer, args.seed, args.max_new_tokens,
                           split=args.split, random_input_len=args.random_input_len,
                           shared_prefix_len=args.shared_prefix_len,
                           shared_prefix_groups=args.shared_prefix_groups)


def parse_logprobs(text: str) -> tuple[str, int]:
    label, _, n = text.partition("=")
    if not label or not n.isdigit():
        raise argparse.ArgumentTypeError(f"--logprobs wants LABEL=N, got {text!r}")
    return label, int(n)


def _bench(url: str, c: int, reqs: list, tokenizer, seed: int,
           logprobs: int | None = None, spec_trace: bool = False) -> dict[str, Any]:
    cfg = BenchConfig(base_url=url, max_concurrency=c, seed=seed, disable_tqdm=True,
                      warmup_requests=min(c, 4), logprobs=logprobs, spec_trace=spec_trace)
    return asyncio.run(run_benchmark(reqs, cfg, tokenizer))


def run_sweep(args: argparse.Namespace) -> dict[str, Any]:
    tokenizer = load_bench_tokenizer(None)
    results: dict[str, Any] = {}
    for label, server_args in args.config:
        results[label] = {"server_args": server_args, "levels": {}}
        log = Path(args.output).with_suffix(f".{label}.log")
        with server([*server_args, *shlex.split(args.common_args)], log,
                    checkout=dict(args.checkout).get(label, ROOT)) as url:
            for c in args.concurrency:
                reqs = _level_requests(args, tokenizer, c)
                n = len(reqs)
                out = _bench(url, c, reqs, tokenizer, args.seed, args.logprobs.get(label),
                             label in args.spec_trace)
                m = out["metrics"]
                results[label]["levels"][str(c)] = {"metrics": m,
                                                   "server_info": out["server_info"]}
                print(f"{label} c={c}: {m['output_throughput']:.1f} tok/s, "
                      f"{m['completed']}/{n} ok", flush=True)
    return results


def _flush(url: str, tries: int = 50) -> None:
    for _ in range(tries):
        with contextlib.suppress(httpx.HTTPError):
            if httpx.post(f"{url}/flush_cache", timeout=30).status_code == 200:
                return
        time.sleep(0.2)
    raise RuntimeError(f"{url}: flush_cache refused {tries} times")


def run_interleaved(args: argparse.Namespace) -> dict[str, Any]:
    """Every server at once; per concurrency, `args.rounds` rounds in which each configuration
    serves the level's requests from a flushed server, in rotating order; a cell keeps the
    round with the median output tok/s."""
    from tqdm import tqdm

    tokenizer = load_bench_tokenizer(None)
    labels = [label for label, _ in args.config]
    results: dict[str, Any] = {label: {"server_args": sargs, "levels": {}}
                               for label, sargs in args.config}
    with contextlib.ExitStack() as stack:
        urls = {}
        for label, server_args in tqdm(args.config, desc="starting servers", unit="server"):
            log = Path(args.output).with_suffix(f".{label}.log")
            urls[label] = stack.enter_context(
                server([*server_args, *shlex.split(args.common_args)], log,
                       checkout=dict(args.checkout).get(label, ROOT)))
        bar = tqdm(total=len(args.concurrency) * args.rounds * len(labels), desc="sweep",
                   unit="run")
        for li, c in enumerate(args.concurrency):
            reqs = _level_requests(args, tokenizer, c)
            n = len(reqs)
            runs: dict[str, list[dict[str, Any]]] = {label: [] for label in labels}
            for r in range(args.rounds):
                first = (li + r) % len(labels)
                for label in labels[first:] + labels[:first]:
                    _flush(urls[label])
                    runs[label].append(_bench(urls[label], c, reqs, tokenizer, args.seed,
                                              args.logprobs.get(label),
                                              label in args.spec_trace))
                    bar.set_postfix_str(f"c={c} round {r + 1} {label}")
                    bar.update()
            for label in labels:
                tps = [o["metrics"]["output_throughput"] for o in runs[label]]
                median = sorted(range(len(tps)), key=lambda i: tps[i])[(len(tps) - 1) // 2]
                out = runs[label][median]
                results[label]["levels"][str(c)] = {
                    "metrics": out["metrics"], "server_info": out["server_info"],
                    "rounds_output_throughput": tps}
                tqdm.write(f"{label} c={c}: {' / '.join(f'{t:.1f}' for t in tps)} tok/s "
                           f"(rounds), {out['metrics']['completed']}/{n} ok")
        bar.close()
    return results


def round_ratios(rounds: list[float], base_rounds: list[float]) -> list[float] | None:
    """Each round's tok/s over the baseline's in the same round (None unless both ran the
    same rounds)."""
    if not rounds or len(rounds) != len(base_rounds) or not all(base_rounds):
        return None
    return [a / b for a, b in zip(rounds, base_rounds)]


def paired_ratio(rounds: list[float], base_rounds: list[float]) -> float | None:
    """Median of the per-round ratios (`round_ratios`)."""
    ratios = round_ratios(rounds, base_rounds)
    return None if ratios is None else statistics.median(ratios)


def paired_range(rounds: list[float], base_rounds: list[float]) -> tuple[float, float] | None:
    """(lowest, highest) of the per-round ratios (`round_ratios`)."""
    ratios = round_ratios(rounds, base_rounds)
    return None if ratios is None else (min(ratios), max(ratios))


def report(results: dict[str, Any]) -> str:
    labels = list(results)
    base = labels[0]
    interleaved = any("rounds_output_throughput" in lvl for res in results.values()
                      for lvl in res["levels"].values())
    rows = []
    for label in labels:
        for c, lvl in results[label]["levels"].items():
            m = lvl["metrics"]
            ref_lvl = results[base]["levels"].get(c, {})
            ref = ref_lvl.get("metrics", {}).get("output_throughput")
            ratio = m["output_throughput"] / ref if ref else float("nan")
            acc = (lvl.get("server_info") or {}).get("avg_spec_accept_length")
            ttft, itl = m["ttft_ms"], m["itl_ms"]
            row = [label, c, f"{m['output_throughput']:.1f}", f"{ratio:.2f}x"]
            if interleaved:
                mine = lvl.get("rounds_output_throughput", [])
                theirs = ref_lvl.get("rounds_output_throughput", [])
                pr, rng = paired_ratio(mine, theirs), paired_range(mine, theirs)
                row.append("-" if pr is None else f"{pr:.2f}x")
                row.append("-" if rng is None else f"{rng[0]:.2f}-{rng[1]:.2f}")
            tpot = (m.get("tpot_ms") or {}).get("median")
            rows.append(row + [f"{ttft['median']:.0f}", f"{ttft['p99']:.0f}",
                               "-" if tpot is None else f"{tpot:.1f}",
                               f"{itl['median']:.0f}", f"{itl['p99']:.0f}",
                               f"{m['completed']}/{m['completed'] + m['failed']}",
                               "" if acc is None else f"{acc:.2f}"])
    head = ["config", "conc", "out tok/s", f"vs {base}"]
    if interleaved:
        head += ["paired", "round ratios"]
    return format_table(head + ["TTFT med ms", "TTFT p99 ms", "TPOT med ms", "ITL med ms",
                                "ITL p99 ms", "ok",
                                "accept len"], rows)


def plot(results: dict[str, Any], path: Path) -> Path | None:
    try:
        import matplotlib
        matplotlib.use("Agg")
        import matplotlib.pyplot as plt
    except ImportError:
        return None
    fig, ax = plt.subplots(1, 2, figsize=(10, 4))
    for label, res in results.items():
        cs = [int(c) for c in res["levels"]]
        ms = [lvl["metrics"] for lvl in res["levels"].values()]
        ax[0].plot(cs, [m["output_throughput"] for m in ms], marker="o", label=label)
        ax[1].plot(cs, [m["itl_ms"]["p99"] for m in ms], marker="o", label=label)
    for a, title in zip(ax, ("output tok/s", "ITL p99 ms")):
        a.set_xscale("log", base=2)
        a.set_xlabel("concurrency")
        a.set_title(title)
        a.grid(alpha=0.3)
    ax[0].legend()
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)
    return path


def build_parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--config", type=parse_config, action="append", required=True,
                   help="LABEL=SERVER ARGS (repeat; the first is the baseline of the ratios)")
    p.add_argument("--common-args", default="", help="server args for every configuration")
    p.add_argument("--checkout", type=parse_checkout, action="append", default=[],
                   metavar="LABEL=DIR", help="that configuration's server runs the code of "
                   "another checkout of this repository (e.g. a git worktree of an older "
                   "commit): two versions compared in one sweep")
    p.add_argument("--spec-trace", action="append", default=[], metavar="LABEL",
                   help="that configuration's requests ask for the speculation trace")
    p.add_argument("--logprobs", type=parse_logprobs, action="append", default=[],
                   metavar="LABEL=N", help="that configuration's requests ask for logprobs "
                   "with N alternatives per token (the cost of logprobs: two configurations "
                   "with the same server args, one of them with this)")
    p.add_argument("--concurrency", type=int, nargs="+", default=[1, 4, 8, 16, 32, 64])
    p.add_argument("--dataset", default="sharegpt")
    p.add_argument("--split", default="all")
    p.add_argument("--num-prompts", type=int, default=32)
    p.add_argument("--random-input-len", type=int, default=256,
                   help="random: prompt tokens; shared-prefix: question tokens")
    p.add_argument("--shared-prefix-len", type=int, default=512,
                   help="shared-prefix: tokens of each group's system prompt")
    p.add_argument("--shared-prefix-groups", type=int, default=4)
    p.add_argument("--prompts-per-slot", type=int, default=2)
    p.add_argument("--max-new-tokens", type=int, default=128)
    p.add_argument("--seed", type=int, default=1)
    p.add_argument("--rounds", type=int, default=0,
                   help="interleave: all servers at once, configurations taking turns this "
                   "many rounds per concurrency, each from a flushed server (0: one server "
                   "after another, each serving every level once)")
    p.add_argument("--output", default="results/sweep_serving.json")
    p.add_argument("--report", metavar="JSON", help="print the table of an earlier run's JSON "
                   "and exit (no servers; --config not needed)")
    return p


def main(argv: list[str] | None = None) -> int:
    p = build_parser()
    if argv is None:
        argv = sys.argv[1:]
    if "--report" in argv:  # the table of a finished run: no --config required
        r = argparse.ArgumentParser()
        r.add_argument("--report", required=True)
        path = r.parse_known_args(argv)[0].report
        with open(path) as f:
            print(report(json.load(f)["results"]))
        return 0
    args = p.parse_args(argv)
    if args.rounds < 0:
        p.error("--rounds must be >= 0")
    args.logprobs = dict(args.logprobs)
    args.checkout = dict(args.checkout)
    unknown = (set(args.logprobs) | set(args.checkout) | set(args.spec_trace)) - \
        {label for label, _ in args.config}
    if unknown:
        p.error(f"--logprobs / --checkout / --spec-trace name no --config: "
                f"{sorted(unknown)}")
    os.makedirs(Path(args.output).parent, exist_ok=True)
    results = run_interleaved(args) if args.rounds else run_sweep(args)
    path = write_json(args.output, {"config": {**vars(args), "config": args.config,
                                               "checkout": {k: str(v) for k, v in
                                                            args.checkout.items()}},
                                    "machine": machine_info(), "results": results})
    png = plot(results, Path(args.output).with_suffix(".png"))
    print(f"sweep_serving  json={path}  plot={png}")
    print(report(results))
    return 0


if __name__ == "__main__":
    stop_children_on_sigterm()
    raise SystemExit(main())
