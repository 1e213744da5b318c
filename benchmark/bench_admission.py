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
Then, with `--n-samples N` (4; 0 skips it): one /v1/completions request for N samples
(T = 0.8, `--sample-tokens` each) of a fresh prompt of `--prompt-words` random words (a new one
every round, the cache flushed before it), timed end to end, with the prompt tokens the
server took from its prefix cache meanwhile (`cached_tokens` of /server_info): the samples
after the first should find the prompt cached instead of prefilling it again.
Prints a table last (medians over rounds) and writes JSON.
"""

from __future__ import annotations

import argparse
import random
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


WORDS = ("river stone light paper garden window music silver orange market engine forest "
         "letter winter candle bridge yellow planet number circle thunder kitchen").split()


def n_samples_round(url: str, n: int, words: int, tokens: int, seed: int) -> dict[str, Any]:
    rng = random.Random(seed)
    prompt = " ".join(rng.choice(WORDS) for _ in range(words))
    with httpx.Client(base_url=url, timeout=3600) as c:
        c.post("/flush_cache")
        before = c.get("/server_info").json()
        t0 = time.perf_counter()
        r = c.post("/v1/completions", json={"prompt": prompt, "n": n, "max_tokens": tokens,
                                            "temperature": 0.8, "ignore_eos": True})
        seconds = time.perf_counter() - t0
        after = c.get("/server_info").json()
    return {"status": r.status_code, "s": seconds,
            "prompt_tokens": after["prompt_tokens"] - before["prompt_tokens"],
            "cached_tokens": after["cached_tokens"] - before["cached_tokens"]}


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__,
                                 formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--batch-sizes", type=int, nargs="*", default=[256, 1024, 5000],
                    help="batch sizes to time (none: skip)")
    ap.add_argument("--config", action="append", type=parse_config, default=None,
                    help="LABEL=SERVER ARGS, repeatable (default: default=)")
    ap.add_argument("--rounds", type=int, default=3)
    ap.add_argument("--probe-delay", type=float, default=0.5,
                    help="seconds between the batch and the probe")
    ap.add_argument("--probe-tokens", type=int, default=8)
    ap.add_argument("--n-samples", type=int, default=4)
    ap.add_argument("--prompt-words", type=int, default=400)
    ap.add_argument("--sample-tokens", type=int, default=16)
    ap.add_argument("--output", default="results/bench_admission.json")
    args = ap.parse_args()
    stop_children_on_sigterm()
    configs = args.config or [("default", [])]
    Path("results").mkdir(exist_ok=True)
    results: list[dict[str, Any]] = []
    samples: list[dict[str, Any]] = []
    total = len(configs) * (len(args.batch_sizes) + 1 + (args.n_samples > 0)) * args.rounds
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
            if args.n_samples > 0:
                rounds = []
                for k in range(args.rounds):
                    rounds.append(n_samples_round(url, args.n_samples, args.prompt_words,
                                                  args.sample_tokens, seed=k))
                    bar.update()
                samples.append({"config": label, "rounds": rounds,
                                "status": sorted({r["status"] for r in rounds}),
                                "s": statistics.median(r["s"] for r in rounds),
                                "prompt_tokens": rounds[0]["prompt_tokens"],
                                "cached_tokens": statistics.median(
                                    r["cached_tokens"] for r in rounds)})
    bar.close()
    path = write_json(args.output, {"machine": machine_info(), "args": vars(args),
                                    "results": results, "n_samples": samples})
    print(f"\nwrote {path}")
    if results:
        print(f"\none batch of one-word prompts, then a probe {args.probe_delay} s later; "
              f"medians over {args.rounds} rounds")
        print(format_table(
            ["config", "batch", "batch HTTP", "batch s", "probe HTTP", "probe s",
             "probe alone s"],
            [[r["config"], r["batch"], "/".join(map(str, r["batch_status"])),
              f"{r['batch_s']:.2f}", "/".join(map(str, r["probe_status"])),
              f"{r['probe_s']:.2f}", f"{r['probe_alone_s']:.2f}"] for r in results]))
    if samples:
        print(f"\n{args.n_samples} samples of one {args.prompt_words}-word prompt "
              f"(/v1/completions n = {args.n_samples}), medians over {args.rounds} rounds")
        print(format_table(["config", "HTTP", "s", "prompt tokens (all samples)",
                            "from the cache"],
                           [[r["config"], "/".join(map(str, r["status"])), f"{r['s']:.2f}",
                             r["prompt_tokens"], r["cached_tokens"]] for r in samples]))

if __name__ == "__main__":
    main()
