"""Speculative decoding against no speculation, on the same prompts, in the same run.

    python -m benchmark.bench_speculative --dataset rewrite --num-prompts 20 \\
        --configs NGRAM NGRAM:num_draft_tokens=16 --concurrency 1,8 --temperature 0,0.7 \\
        --compare-hf
    python -m benchmark.bench_speculative --base-url http://127.0.0.1:30000 \\
        --baseline-url http://127.0.0.1:30001 --dataset rewrite      # two running servers

- Every dataset × concurrency × config (the baseline included) gets a fresh `Engine`: started,
  warmed up with one short request, measured, shut down. Fresh, because the NGRAM trie is shared
  by all requests of a server: a second pass over the same prompts would draft from the first
  pass's outputs and inflate acceptance. The temperatures of `--temperature` (comma-separated,
  e.g. 0,0.7; sampled requests take `--top-p` / `--top-k`) are measured one after another on
  that engine, with `flush_cache` (radix cache
  and drafter state, the n-gram trie included) before each.
- Interleaved (the default): the baseline's and every config's engines run side by side and
  take turns, request by request at c = 1 (4c requests at a time at concurrency c, the first
  to serve a block rotating). This machine's speed drifts by ±10% over minutes; taking turns
  puts that drift into every config alike instead of into the ratios. An idle engine blocks
  in its polls and costs no CPU, only memory (one model copy per engine). `--no-interleave`:
  one engine at a time, all requests each.
- `--configs`: `ALGO[:key=value,...]`, keys are `speculative_<key>` ServerArgs fields, e.g.
  `NGRAM:num_draft_tokens=16,ngram_match_type=PROB`.
- Concurrency c: c requests in flight (c = 1: one after another).
- Metrics (definitions in `benchmark/spec_metrics.py`): output tokens/s, median per-request
  tokens/s, speedup over the baseline at the same concurrency and temperature (same run), the
  median over requests of each one's own speedup (same prompt, baseline time / config time), mean
  accept length, acceptance rate per draft position, draft tokens per step; at temperature 0 the
  number of requests whose output differs from the baseline's (greedy must match up to
  near-ties). Sampled runs seed each request (`--seed` + its index), the same for every config;
  a seeded request's tokens are keyed by (seed, position), so its output must equal the
  baseline's too (counted as mismatches, like greedy). `--unseeded`: sampled requests without
  seeds (verified by speculative sampling; acceptance differs, outputs are not compared).
- `--compare-hf`: Hugging Face transformers on the same prompts (batch 1, fp32, greedy): plain
  `generate` and prompt lookup; "vs HF PLD" = our tokens/s at c = 1, T = 0 / HF prompt
  lookup's (needs 0 among the temperatures). In the HF rows, "speedup" is prompt lookup over
  plain `generate`.
- `--base-url`: measure an already-running server through HTTP `/generate` (whatever it is
  configured as); speedup needs `--baseline-url` (a server without speculation). The servers'
  radix caches are flushed before each run, their n-gram caches cannot be: with several
  concurrency levels or temperatures, later runs draft from earlier outputs.
- Self-repetition: long greedy answers of a small model can loop on their own text, which
  n-gram drafting accepts wholesale. A table splits each speedup into requests whose baseline
  output repeats itself (share of tokens closing a 16-gram already in that output) under 10%
  and the rest, so a speedup that comes from loops shows as one.
Writes full JSON (per-request records included, `--output`) and a PNG (`--plot`); prints a
table last. `--report results/x.json ...` re-prints the tables of saved runs.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import logging
import math
import os
import time
from dataclasses import asdict
from pathlib import Path
from typing import Any

from tqdm import tqdm
from tqdm.contrib.logging import logging_redirect_tqdm

from benchmark.common import machine_info, write_json
from benchmark.spec_metrics import (
    BASELINE,
    SELF_REPEAT_N,
    ConfigError,
    SpecCounters,
    SpecRecord,
    SpecRunConfig,
    baseline_runs,
    compare_to_baseline,
    fmt_temperatures,
    kind_table,
    median_paired_speedup,
    parse_spec_configs,
    repetition_table,
    run_cell,
    speedup,
    summarize_run,
    summary_table,
)
from benchmark.spec_runner import EngineTarget, HttpTarget, Target, render_prompts, run_requests
from specserve.corpora.datasets import (
    SPLITS,
    BenchRequest,
    DatasetError,
    chat_prompt_ids,
    load_bench_tokenizer,
    sample_requests,
)

logger = logging.getLogger("bench_speculative")
DATASETS = ("sharegpt", "rewrite", "schema", "extraction", "custom")
WARMUP_MESSAGES = [{"role": "user", "content": "Count from one to ten, in words."}]
WARMUP_MAX_NEW_TOKENS = 16


# ---- one run ---------------------------------------------------------------------------------
def interleave_block(concurrency: int) -> int:
    """Requests per interleaved block: one at c = 1; at c > 1, 4c, so that most of a block runs
    with c requests in flight (each block fills and drains the batch)."""
    return 1 if concurrency == 1 else 4 * concurrency


PENALTIES = {"repetition_penalty": 1.0, "frequency_penalty": 0.0, "presence_penalty": 0.0}


def sampling_filters(args: argparse.Namespace) -> dict[str, Any]:
    """--top-p / --top-k for the sampled requests, and the penalties for every request (only
    those set away from their defaults; a key "all:<name>" applies to greedy requests too)."""
    out: dict[str, Any] = {}
    if getattr(args, "top_p", 1.0) < 1.0:
        out["top_p"] = args.top_p
    if getattr(args, "top_k", -1) > 0:
        out["top_k"] = args.top_k
    for name, default in PENALTIES.items():
        value = getattr(args, name, default)
        if value != default:
            out["all:" + name] = value
    return out


def measure(
    targets: list[tuple[Target, str, dict[str, Any]]], dataset: str, reqs: list[BenchRequest],
    prompts: list[list[int]], concurrency: int, temperature: float, args: argparse.Namespace,
    block: int | None = None,
) -> list[dict[str, Any]]:
    """One run per (target, config label, server args), on the same requests.

    Counters are read before and after; metrics come from the deltas. With several targets and
    a `block`, the requests go block by block and every target serves each block in turn (the
    first target of a block rotates), so minutes-long drifts of this machine's speed hit every
    config alike; tokens/s is then output tokens over the sum of a target's block times.
    Without a block, each target serves all requests at once, one target after the other.
    """
    block = block or len(reqs)
    before = [SpecCounters.from_server_info(t.server_info()) for t, _, _ in targets]
    records: list[list[SpecRecord]] = [[] for _ in targets]
    walls = [0.0] * len(targets)
    starts = list(range(0, len(reqs), block))
    interleaved = len(starts) > 1 and len(targets) > 1
    desc = f"{dataset} c={concurrency} T={temperature:g}"
    bar = tqdm(total=len(reqs) * len(targets), desc=f"{desc} interleaved", unit="req",
               disable=args.disable_tqdm or not interleaved, leave=False)
    for b, s in enumerate(starts):
        for k in [(b + j) % len(targets) for j in range(len(targets))]:
            target, config, _ = targets[k]
            recs, wall = asyncio.run(run_requests(
                target, reqs[s : s + block], prompts[s : s + block], concurrency, temperature,
                None if args.unseeded else args.seed + s, f"{desc} {config}",
                args.disable_tqdm or interleaved, sampling_filters(args),
            ))
            records[k] += recs
            walls[k] += wall
            bar.update(len(recs))
    bar.close()
    runs = []
    for (target, config, server_args), recs, wall, prev in zip(targets, records, walls, before):
        after = SpecCounters.from_server_info(target.server_info())
        counters = after.minus(prev) if after is not None else None
        run = {
            "dataset": dataset, "config": config, "concurrency": concurrency,
            "temperature": temperature, "server_args": server_args,
            "seeded": temperature > 0 and not args.unseeded,
            "interleaved_block": block if interleaved else None,
            "counters": asdict(counters) if counters else None,
            "metrics": summarize_run(recs, wall, counters), "records": recs,
        }
        m = run["metrics"]
        logger.info("%s %s c=%d T=%g: %d/%d ok, %d tokens in %.1fs = %.2f tok/s%s", dataset,
                    config, concurrency, temperature, m["completed"], len(recs),
                    m["total_output_tokens"], wall, m["output_tokens_per_s"],
                    f", accept length {m['accept_length']:.2f}" if m["accept_length"] else "")
        for rec in recs:
            if rec.error:
                logger.warning("request %s failed: %s", rec.id, rec.error)
        runs.append(run)
    return runs


# ---- engine mode -----------------------------------------------------------------------------
def start_engine(args: argparse.Namespace, cfg: SpecRunConfig) -> Any:
    from specserve.launch.engine import Engine

    t0 = time.perf_counter()
    engine = Engine(model_path=args.model_path, log_level="warning",
                    max_running_requests=max(32, *args.concurrency),
                    grammar_backend=args.grammar_backend,
                    constrained_json_disable_any_whitespace=args.compact_json, **cfg.server_args)
    try:
        ids = engine.tm.chat_ids(WARMUP_MESSAGES)
        engine.generate(input_ids=ids, sampling_params={
            "max_new_tokens": WARMUP_MAX_NEW_TOKENS, "temperature": 0.0})
        engine.flush_cache()  # the warm-up prompt's KV should not count as a cache hit
    except BaseException:
        engine.shutdown()
        raise
    logger.info("engine %s started and warmed up in %.1fs", cfg.label, time.perf_counter() - t0)
    return engine


def run_engines(
    args: argparse.Namespace, configs: list[SpecRunConfig],
    requests: dict[str, list[BenchRequest]], prompts: dict[str, list[list[int]]],
) -> list[dict[str, Any]]:
    """Per dataset and concurrency, fresh engines for the baseline and every config: all of
    them at once, interleaved block by block (the default), or one after the other
    (`--no-interleave`, one engine in memory at a time). Every temperature on those engines,
    their caches flushed in between. Fills `prompts` (rendered with the first engine's chat
    template)."""
    runs = []
    groups = [[BASELINE, *configs]] if args.interleave else [[cfg] for cfg in
                                                             [BASELINE, *configs]]
    cells = [(d, c, g) for d in requests for c in args.concurrency for g in groups]
    for dataset, c, group in tqdm(cells, desc="engines", disable=args.disable_tqdm,
                                  unit="cell"):
        engines: list[Any] = []
        try:
            for cfg in group:
                engines.append(start_engine(args, cfg))
            if dataset not in prompts:
                prompts[dataset] = render_prompts(requests[dataset], engines[0].tm.chat_ids,
                                                  engines[0].tm.tokenize)
            targets = [(EngineTarget(e), cfg.label, cfg.server_args)
                       for e, cfg in zip(engines, group)]
            for i, temperature in enumerate(args.temperature):
                if i:
                    for e in engines:
                        _flush_engine(e)
                runs += measure(targets, dataset, requests[dataset], prompts[dataset], c,
                                temperature, args, interleave_block(c))
        finally:
            for e in engines:
                e.shutdown()
    return runs


def _flush_engine(engine: Any, tries: int = 20) -> None:
    """Radix cache and drafter state (the n-gram trie), so that the next temperature's run
    drafts only from its own requests. Refused while requests still run: retried briefly."""
    for _ in range(tries):
        if engine.flush_cache():
            return
        time.sleep(0.1)
    logger.warning("flush_cache refused %d times: the next run may draft from earlier outputs",
                   tries)


# ---- URL mode --------------------------------------------------------------------------------
def run_urls(
    args: argparse.Namespace, requests: dict[str, list[BenchRequest]],
    prompts: dict[str, list[list[int]]],
) -> tuple[list[dict[str, Any]], str]:
    """Measure `--base-url` (and `--baseline-url` first, when given); returns (runs, the
    baseline's label)."""
    targets = []
    if args.baseline_url:
        targets.append(HttpTarget(args.baseline_url, args.api_key, args.request_timeout))
    targets.append(HttpTarget(args.base_url, args.api_key, args.request_timeout))
    labels = []
    for t in targets:
        if t.server_info() is None:
            raise RuntimeError(f"no server answers GET {t.base_url}/server_info")
        labels.append(t.label())
        warm = {"max_new_tokens": WARMUP_MAX_NEW_TOKENS, "temperature": 0.0}
        asyncio.run(_generate_once(t, next(iter(prompts.values()))[0], warm))
    if len(set(labels)) < len(labels):
        labels = [f"baseline {labels[0]}", labels[1]]
    runs = []
    pairs = [(t, label, {}) for t, label in zip(targets, labels)]
    groups = [pairs] if args.interleave else [[p] for p in pairs]
    for dataset in requests:
        for c in args.concurrency:
            for temperature in args.temperature:
                for group in groups:
                    for t, _, _ in group:
                        t.flush_cache()
                    runs += measure(group, dataset, requests[dataset], prompts[dataset], c,
                                    temperature, args, interleave_block(c))
    return runs, labels[0] if args.baseline_url else ""


async def _generate_once(target: HttpTarget, ids: list[int], params: dict[str, Any]) -> None:
    async with target.session():
        await target.generate(ids, params)


# ---- Hugging Face transformers ---------------------------------------------------------------
def bench_hf(
    model_dir: str, requests: dict[str, list[BenchRequest]], prompts: dict[str, list[list[int]]],
    lookup_tokens: int, disable_tqdm: bool,
) -> dict[str, dict[str, Any]]:
    """Batch 1, fp32, greedy: plain `generate` and prompt lookup, per dataset."""
    import torch
    import transformers
    from transformers import AutoModelForCausalLM

    transformers.logging.set_verbosity_error()
    torch.set_num_threads(os.cpu_count() or 1)
    model = AutoModelForCausalLM.from_pretrained(model_dir, dtype=torch.float32).eval()
    pad = model.generation_config.pad_token_id
    if pad is None:
        eos = model.generation_config.eos_token_id
        pad = eos[0] if isinstance(eos, list) else eos

    def generate(ids: list[int], n: int, extra: dict[str, Any]) -> list[int]:
        x = torch.tensor([ids])
        with torch.inference_mode():
            out = model.generate(x, attention_mask=torch.ones_like(x), max_new_tokens=n,
                                 do_sample=False, pad_token_id=pad, **extra)
        return out[0, len(ids):].tolist()

    modes = {"generate": {}, "prompt_lookup": {"prompt_lookup_num_tokens": lookup_tokens}}
    first = next(iter(prompts.values()))[0]
    for extra in modes.values():  # warm-up
        generate(first, WARMUP_MAX_NEW_TOKENS, extra)
    out: dict[str, dict[str, Any]] = {}
    for dataset, reqs in requests.items():
        out[dataset] = {}
        for mode, extra in modes.items():
            records = []
            for req, ids in tqdm(list(zip(reqs, prompts[dataset])), desc=f"HF {mode} {dataset}",
                                 disable=disable_tqdm, leave=False, unit="req"):
                rec = SpecRecord(req.id, req.kind, len(ids), req.max_new_tokens, success=True)
                t0 = time.perf_counter()
                rec.output_ids = generate(ids, req.max_new_tokens, extra)
                rec.e2e_s = time.perf_counter() - t0
                rec.completion_tokens = len(rec.output_ids)
                records.append(rec)
            metrics = summarize_run(records, sum(r.e2e_s for r in records), None)
            out[dataset][mode] = {**metrics, "records": records}
            logger.info("HF %s %s: %.2f tok/s", mode, dataset, metrics["output_tokens_per_s"])
        hf = out[dataset]
        hf["prompt_lookup"]["speedup"] = speedup(hf["prompt_lookup"]["output_tokens_per_s"],
                                                 hf["generate"]["output_tokens_per_s"])
    return out


# ---- putting runs together -------------------------------------------------------------------
def attach_comparisons(
    runs: list[dict[str, Any]], baseline_label: str,
    hf: dict[str, dict[str, Any]] | None = None,
) -> None:
    """Speedup against the same-run baseline at the same dataset, concurrency and temperature;
    mismatches (greedy runs only) against its outputs. HF is greedy: vs HF prompt lookup for
    runs at c = 1 and T = 0 only, HF mismatches against the baseline's c = 1, T = 0 run."""
    base = baseline_runs(runs, baseline_label)
    for run in runs:
        m = run["metrics"]
        ref = base.get(run_cell(run))
        if ref is not None and ref is not run:
            m["speedup"] = speedup(m["output_tokens_per_s"], ref["metrics"]["output_tokens_per_s"])
            m["median_request_speedup"] = median_paired_speedup(run["records"], ref["records"])
            if run["temperature"] == 0 or run.get("seeded"):
                m["mismatches"] = compare_to_baseline(run["records"], ref["records"])
        elif ref is run:
            m["speedup"] = m["median_request_speedup"] = 1.0
        if hf and run["concurrency"] == 1 and run["temperature"] == 0 and run["dataset"] in hf:
            pld = hf[run["dataset"]]["prompt_lookup"]["output_tokens_per_s"]
            m["vs_hf_prompt_lookup"] = speedup(m["output_tokens_per_s"], pld)
    for dataset, modes in (hf or {}).items():
        ref = base.get((dataset, 1, 0.0))
        if ref is not None:
            for h in modes.values():
                h["mismatches"] = compare_to_baseline(h["records"], ref["records"])


def _jsonable(result: dict[str, Any]) -> dict[str, Any]:
    out = dict(result)
    out["runs"] = [{**r, "records": [asdict(x) for x in r["records"]]} for r in result["runs"]]
    if result.get("hf"):
        out["hf"] = {d: {m: {**v, "records": [asdict(x) for x in v["records"]]}
                         for m, v in modes.items()} for d, modes in result["hf"].items()}
    return out


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0],
                                formatter_class=argparse.ArgumentDefaultsHelpFormatter)
    p.add_argument("--model-path", default="default", help="HF dir, .gguf, or default")
    p.add_argument("--dataset", nargs="+", choices=DATASETS, default=["rewrite"])
    p.add_argument("--dataset-path", default=None, help="custom: the JSONL file; "
                   "sharegpt/rewrite: a ShareGPT JSON overriding the packaged one")
    p.add_argument("--split", choices=SPLITS, default="heldout")
    p.add_argument("--num-prompts", type=int, default=20)
    p.add_argument("--max-new-tokens", type=int, default=128)
    p.add_argument("--configs", nargs="+", default=None,
                   help="ALGO[:key=value,...] per config (default: NGRAM)")
    p.add_argument("--concurrency", default="1", help="comma-separated, e.g. 1,8")
    p.add_argument("--temperature", default="0", help="comma-separated, e.g. 0,0.7: every "
                   "config and the baseline are measured at each")
    p.add_argument("--top-p", type=float, default=1.0,
                   help="top_p of the sampled requests (temperature > 0)")
    p.add_argument("--top-k", type=int, default=-1,
                   help="top_k of the sampled requests (temperature > 0; -1: off)")
    for name, default in PENALTIES.items():
        p.add_argument("--" + name.replace("_", "-"), type=float, default=default,
                       help=f"{name} of every request, greedy ones included")
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--grammar-backend", default="xgrammar", choices=("xgrammar", "llguidance"),
                   help="every engine's, for constrained requests (--dataset extraction)")
    p.add_argument("--compact-json", action="store_true", help="every engine with "
                   "--constrained-json-disable-any-whitespace (JSON without free whitespace)")
    p.add_argument("--unseeded", action="store_true",
                   help="sampled requests carry no seed (default: request i gets --seed + i)")
    p.add_argument("--compare-hf", action="store_true",
                   help="HF transformers, greedy: needs 0 among the temperatures")
    p.add_argument("--hf-prompt-lookup-tokens", type=int, default=10)
    p.add_argument("--base-url", default=None, help="measure this running server instead")
    p.add_argument("--baseline-url", default=None, help="with --base-url: a server without "
                   "speculation, for speedups")
    p.add_argument("--api-key", default=None)
    p.add_argument("--request-timeout", type=float, default=600.0)
    p.add_argument("--output", default="results/bench_speculative.json")
    p.add_argument("--plot", default=None, help="PNG path (default: --output with .png)")
    p.add_argument("--no-interleave", dest="interleave", action="store_false",
                   help="run the baseline and each config one after the other (one engine in "
                   "memory at a time) instead of all at once, taking turns request by request "
                   "(4c requests at a time at concurrency c)")
    p.add_argument("--disable-tqdm", action="store_true")
    p.add_argument("--report", nargs="+", metavar="JSON", default=None,
                   help="print the tables of earlier runs from their JSON and exit")
    args = p.parse_args(argv)
    if args.report:
        return args
    try:
        args.concurrency = sorted({int(x) for x in args.concurrency.split(",") if x.strip()})
    except ValueError:
        p.error(f"--concurrency must be comma-separated integers, got {args.concurrency!r}")
    if not args.concurrency or min(args.concurrency) < 1:
        p.error("--concurrency needs positive integers")
    try:
        args.temperature = parse_temperatures(args.temperature)
    except ValueError as exc:
        p.error(f"--temperature: {exc}")
    if args.compare_hf and 0.0 not in args.temperature:
        p.error("--compare-hf is greedy (HF prompt lookup): add 0 to --temperature, "
                f"e.g. --temperature 0,{fmt_temperatures(args.temperature)}")
    if args.num_prompts < 1 or args.max_new_tokens < 1:
        p.error("--num-prompts and --max-new-tokens must be positive")
    if not 0.0 < args.top_p <= 1.0:
        p.error(f"--top-p must be in (0, 1], got {args.top_p}")
    if args.baseline_url and not args.base_url:
        p.error("--baseline-url needs --base-url")
    if args.base_url and args.configs:
        p.error("--configs starts engines; with --base-url the server's own configuration "
                "is measured")
    args.dataset = list(dict.fromkeys(args.dataset))
    return args


def parse_temperatures(text: str) -> list[float]:
    """`0,0.7` -> [0.0, 0.7]: sorted, duplicates dropped, each finite and >= 0."""
    out = set()
    for item in filter(None, (x.strip() for x in text.split(","))):
        try:
            t = float(item)
        except ValueError:
            raise ValueError(f"{item!r} is not a number (expected e.g. 0,0.7)") from None
        if not math.isfinite(t) or t < 0:
            raise ValueError(f"temperatures must be finite and >= 0, got {item!r}")
        out.add(t + 0.0)  # -0.0 -> 0.0
    if not out:
        raise ValueError(f"no temperature in {text!r} (expected e.g. 0 or 0,0.7)")
    return sorted(out)


def validate_configs(args: argparse.Namespace) -> list[SpecRunConfig]:
    """Parse `--configs` and check every one against ServerArgs before minutes are spent."""
    from specserve.launch.server_args import ServerArgs

    configs = parse_spec_configs(args.configs or ["NGRAM"])
    for cfg in configs:
        try:
            ServerArgs(model_path=args.model_path, **cfg.server_args).resolve()
        except (ValueError, TypeError) as exc:
            raise ConfigError(f"config {cfg.label!r}: {exc}") from None
    return configs


def main(argv: list[str] | None = None) -> int:
    logging.basicConfig(level=logging.INFO, format="%(asctime)s %(levelname)s %(message)s",
                        datefmt="%H:%M:%S")
    args = parse_args(argv)
    if args.report:
        return report(args.report)
    from specserve.runtime.model_loader.default_model import resolve_model_path

    model_dir = str(resolve_model_path(args.model_path))
    try:
        configs = [] if args.base_url else validate_configs(args)
        tokenizer = load_bench_tokenizer(model_dir)
        requests = {d: sample_requests(d, args.num_prompts, tokenizer, args.seed,
                                       args.max_new_tokens, dataset_path=args.dataset_path,
                                       split=args.split) for d in args.dataset}
    except (ConfigError, DatasetError) as exc:
        logger.error("%s", exc)
        return 2
    prompts: dict[str, list[list[int]]] = {}
    with logging_redirect_tqdm():
        if args.base_url:
            prompts = {d: render_prompts(reqs, lambda m: chat_prompt_ids(tokenizer, m),
                                         lambda t: tokenizer.encode(t, add_special_tokens=False))
                       for d, reqs in requests.items()}
            try:
                runs, baseline_label = run_urls(args, requests, prompts)
            except RuntimeError as exc:
                logger.error("%s", exc)
                return 2
        else:
            runs, baseline_label = run_engines(args, configs, requests, prompts), BASELINE.label
        hf = None
        if args.compare_hf:
            hf = bench_hf(model_dir, requests, prompts, args.hf_prompt_lookup_tokens,
                          args.disable_tqdm)
    attach_comparisons(runs, baseline_label, hf)

    title = (f"bench_speculative  {', '.join(args.dataset)}  n={args.num_prompts}  "
             f"max_new_tokens={args.max_new_tokens}  T={fmt_temperatures(args.temperature)}  "
             f"{'url ' + args.base_url if args.base_url else Path(model_dir).name}")
    result = {
        "title": title, "mode": "url" if args.base_url else "engine", "args": vars(args),
        "machine": machine_info(), "model_dir": model_dir, "baseline_label": baseline_label,
        "datasets": {d: [{"id": r.id, "kind": r.kind, "prompt_len": len(p),
                          "max_new_tokens": r.max_new_tokens}
                         for r, p in zip(requests[d], prompts.get(d, []))] for d in requests},
        "runs": runs, "hf": hf,
    }
    json_path = write_json(args.output, _jsonable(result))
    from benchmark.plots import plot_speculative

    plot_path = plot_speculative(result, args.plot or Path(args.output).with_suffix(".png"))
    print(f"\nJSON: {json_path}\nplot: {plot_path}")
    print_tables(result)
    return 0 if all(r["metrics"]["completed"] for r in runs) else 1


def print_tables(result: dict[str, Any]) -> None:
    """The title, the per-kind and self-repetition breakdowns, and the summary table last."""
    print(f"{result.get('title', '')}\n")
    by_kind = kind_table(result)
    if by_kind:
        print(f"by prompt kind\n{by_kind}\n")
    by_repeat = repetition_table(result)
    if by_repeat:
        print(f"by self-repetition of the baseline's output ({SELF_REPEAT_N}-grams)\n"
              f"{by_repeat}\n")
    print(summary_table(result))


def report(paths: list[str]) -> int:
    """Re-print the tables of saved runs (`--report results/x.json ...`)."""
    for i, path in enumerate(paths):
        try:
            with open(path) as f:
                result = json.load(f)
            if not isinstance(result, dict) or "runs" not in result:
                raise ValueError("not a bench_speculative JSON")
        except (OSError, ValueError) as exc:
            logger.error("%s: %s", path, exc)
            return 2
        print(("\n" if i else "") + f"== {path}")
        print_tables(result)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
