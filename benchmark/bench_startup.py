"""How long a server takes to start, then to answer its first one-token request, for each
configuration, rounds interleaved. `--via engine` (default): `specserve.launch.Engine(...)` from the
call to ready (the model runner loaded, the verify-cost curve timed for a speculative configuration,
both tokenizers loaded). `--via launcher`: what a user of `python -m launch_server` waits for, from
starting the interpreter to the first 200 from /health (polled every 50 ms), the request over HTTP,
and SIGTERM to exit.

    python -m benchmark.bench_startup --algorithms none SUFFIX EAGLE3 --rounds 3
    python -m benchmark.bench_startup --via launcher --algorithms none SUFFIX --rounds 3

The model is the default one unless `--model-path`; the CPU extension is built beforehand (its
first build takes a minute and is not start-up). Prints the median of the rounds per
configuration, the table last, and writes JSON (`--output`).
"""

from __future__ import annotations

import argparse
import statistics
import subprocess
import sys
import time
from pathlib import Path

import httpx
from tqdm import tqdm

from benchmark.common import (
    format_table,
    free_port,
    machine_info,
    stop_server,
    wait_healthy,
    write_json,
)


def start_once(algorithm: str | None, model_path: str | None) -> dict[str, float]:
    from specserve.launch import Engine

    kw = {"speculative_algorithm": algorithm} if algorithm else {}
    if model_path:
        kw["model_path"] = model_path
    t0 = time.perf_counter()
    with Engine(log_level="warning", **kw) as eng:
        ready = time.perf_counter() - t0
        eng.generate("Hello", sampling_params={"max_new_tokens": 1, "temperature": 0})
        first = time.perf_counter() - t0
    return {"ready_s": ready, "first_token_s": first, "stop_s": time.perf_counter() - t0 - first}


def launch_once(algorithm: str | None, model_path: str | None, log_path: Path,
                timeout_s: float = 300) -> dict[str, float]:
    from benchmark.sweep_serving import ROOT

    port = free_port()
    cmd = [sys.executable, "-m", "launch_server", "--port", str(port), "--log-level", "warning"]
    cmd += ["--speculative-algorithm", algorithm] if algorithm else []
    cmd += ["--model-path", model_path] if model_path else []
    url = f"http://127.0.0.1:{port}"
    with open(log_path, "w") as log:
        t0 = time.perf_counter()
        proc = subprocess.Popen(cmd, cwd=ROOT, stdout=log, stderr=subprocess.STDOUT)
        try:
            wait_healthy(url, proc, timeout_s, interval_s=0.05, log=log_path)
            ready = time.perf_counter() - t0
            r = httpx.post(f"{url}/generate", timeout=60, json={
                "text": "Hello", "sampling_params": {"max_new_tokens": 1, "temperature": 0}})
            r.raise_for_status()
            first = time.perf_counter() - t0
        finally:
            t_stop = time.perf_counter()
            stop_server(proc)
    return {"ready_s": ready, "first_token_s": first, "stop_s": time.perf_counter() - t_stop}


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--algorithms", nargs="+", default=["none", "SUFFIX"],
                   help="speculative algorithms ('none': plain decoding)")
    p.add_argument("--rounds", type=int, default=3)
    p.add_argument("--model-path", default=None)
    p.add_argument("--via", choices=("engine", "launcher"), default="engine",
                   help="specserve.launch.Engine in this process, or `python -m launch_server` "
                   "(HTTP)")
    p.add_argument("--output", default="results/bench_startup.json")
    args = p.parse_args(argv)
    from specserve.kernels import cpu

    cpu.available()  # build (or find) the extension before anything is timed
    algos = [None if a.lower() == "none" else a for a in args.algorithms]
    runs: dict[str, list[dict[str, float]]] = {a or "none": [] for a in algos}
    with tqdm(total=args.rounds * len(algos), desc="start-ups", unit="start") as bar:
        for _ in range(args.rounds):
            for a in algos:
                if args.via == "launcher":
                    log = Path(args.output).with_suffix(f".{a or 'none'}.log")
                    log.parent.mkdir(parents=True, exist_ok=True)
                    runs[a or "none"].append(launch_once(a, args.model_path, log))
                else:
                    runs[a or "none"].append(start_once(a, args.model_path))
                bar.update()
    rows, summary = [], {}
    for label, rs in runs.items():
        med = {k: statistics.median(r[k] for r in rs) for k in rs[0]}
        summary[label] = {"median": med, "rounds": rs}
        rows.append([label, med["ready_s"], med["first_token_s"], med["stop_s"],
                     " / ".join(f"{r['ready_s']:.1f}" for r in rs)])
    path = write_json(args.output, {"machine": machine_info(), "config": vars(args),
                                    "results": summary})
    print(f"\nJSON: {path}\n")
    print(f"seconds, median of {args.rounds} rounds, via {args.via}")
    print(format_table(["config", "ready s", "first token s", "stop s", "ready by round"], rows))
    return 0


if __name__ == "__main__":
    sys.exit(main())
