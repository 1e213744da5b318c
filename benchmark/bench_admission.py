"""What one large batch request does to the requests that arrive after it, and what the
admission limits change (--max-sequences-per-request, --max-queued-requests).

    python -m benchmark.bench_admission --batch-sizes 256 1024 5000 \\
        --config default= --config queue64="--max-queued-requests 64"

For each configuration a server is started; for each batch size B, `--rounds` times: one
/generate request with B one-word prompts (`max_new_tokens` 1) is sent, and `--probe-delay`
seconds later a probe (a short greedy request, `--probe-tokens` new tokens) is sent from
another client. Recorded: the batch's HTTP status and time, the probe's latency, and the
probe's latency with no batch (the baseline). FCFS scheduling serves the probe after every
queued prompt of the batch, so a batch the server takes delays the probe by its length.
Prints a table last (medians over rounds) and writes JSON.
"""

from __future__ import annotations

import argparse
import statistics
import threading
import time
from pathlib import Path
from typing import Any

import httpx
from tqdm import tqdm

from benchmark.common import format_table, machine_info, stop_children_on_sigterm, write_json
from benchmark.sweep_serving import parse_config, server

PROBE = "The capital of France is"


def post(url: str, body: dict, timeout: float = 3600) -> tuple[int, float]:
    """(HTTP status, seconds) of one /generate request."""
    t0 = time.perf_counter()
    with httpx.Client(base_url=url, timeout=timeout) as c:
        r = c.post("/generate", json=body)
    return r.status_code, time.perf_counter() - t0


def one_round(url: str, batch: int, probe_delay: float, probe_tokens: int) -> dict[str, Any]:
    probe = {"text": PROBE, "sampling_params": {"max_new_tokens": probe_tokens,
                                                "temperature": 0}}
    out: dict[str, Any] = {}

    def send_batch():
        out["batch_status"], out["batch_s"] = post(url, {
            "text": ["a"] * batch, "sampling_params": {"max_new_tokens": 1, "temperature": 0}})

    th = threading.Thread(target=send_batch)
    th.start()
    time.sleep(probe_delay)
    out["probe_status"], out["probe_s"] = post(url, probe)
    th.join()
    return out


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__,
                                 formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--batch-sizes", type=int, nargs="+", default=[256, 1024, 5000])
    ap.add_argument("--config", action="append", type=parse_config, default=None,
                    help="LABEL=SERVER ARGS, repeatable (default: default=)")
    ap.add_argument("--rounds", type=int, default=3)
    ap.add_argument("--probe-delay", type=float, default=0.5,
                    help="seconds between the batch and the probe")
    ap.add_argument("--probe-tokens", type=int, default=8)
    ap.add_argument("--output", default="results/bench_admission.json")
    args = ap.parse_args()
    stop_children_on_sigterm()
    configs = args.config or [("default", [])]
    Path("results").mkdir(exist_ok=True)
    results: list[dict[str, Any]] = []
    total = len(configs) * (len(args.batch_sizes) + 1) * args.rounds
    bar = tqdm(total=total, desc="rounds", unit="round")
    for label, server_args in configs:
        with server(server_args, Path(f"results/bench_admission_{label}.log")) as url:
            post(url, {"text": PROBE, "sampling_params": {"max_new_tokens": 2}})  # warm
            alone = []
            for _ in range(args.rounds):
                alone.append(post(url, {"text": PROBE, "sampling_params": {
                    "max_new_tokens": args.probe_tokens, "temperature": 0}})[1])
                bar.update()
            for b in args.batch_sizes:
                rounds = []
                for _ in range(args.rounds):
                    rounds.append(one_round(url, b, args.probe_delay, args.probe_tokens))
                    bar.update()
                results.append({
                    "config": label, "server_args": server_args, "batch": b, "rounds": rounds,
                    "probe_alone_s": statistics.median(alone),
                    "batch_status": sorted({r["batch_status"] for r in rounds}),
                    "batch_s": statistics.median(r["batch_s"] for r in rounds),
                    "probe_s": statistics.median(r["probe_s"] for r in rounds),
                    "probe_status": sorted({r["probe_status"] for r in rounds})})
    bar.close()
    path = write_json(args.output, {"machine": machine_info(), "args": vars(args),
                                    "results": results})
    rows = [[r["config"], r["batch"], "/".join(map(str, r["batch_status"])),
             f"{r['batch_s']:.2f}", "/".join(map(str, r["probe_status"])),
             f"{r['probe_s']:.2f}", f"{r['probe_alone_s']:.2f}"] for r in results]
    print(f"\nwrote {path}; medians over {args.rounds} rounds, probe sent "
          f"{args.probe_delay} s after the batch")
    print(format_table(["config", "batch", "batch HTTP", "batch s", "probe HTTP", "probe s",
                        "probe alone s"], rows))


if __name__ == "__main__":
    main()
