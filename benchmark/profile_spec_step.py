"""Where a speculative step's time goes: forwards by mode and size, and the rest, in-process.

    python -m benchmark.profile_spec_step --dataset rewrite --split train --num-prompts 12

Runs the scheduler and the model-runner worker in one process (no HTTP, no IPC) on the default
model, serving the prompts one after another (`--concurrency N`: N requests in flight, a new one
arriving as soon as one finishes), once without speculation and once per `--configs` entry
(NGRAM options as in `bench_speculative`: `NGRAM`, `NGRAM:ngram_max_draft_tokens=8`). Every
`ModelRunner.forward` is timed (`+capture`: it captured hidden states for the drafter), and so
is every forward a drafter runs of its own model (an EAGLE head over target features and its
draft steps, a draft model's or early exit's steps, Medusa's heads, an MLPSpeculator's stages:
`DRAFT_FORWARDS`) and every drafter's whole `propose` (forwards included); the table gives the
median forward time per (mode, tree size), its ratio to a decode step of the full batch measured
in the same serving loop (the T(n)/T(1) that `benchmark.replay_ngram` models), the drafter's
forwards per step (and as a share of a decode step), the per-step time outside any forward (tree
building, masks, verification, commit, scheduling) and the median time to first token. The
first two prompts warm up (alone) and are not counted (`--warmup-prompts`).
`--logprobs N` serves every configuration a second time with each request asking for logprobs.
"""

from __future__ import annotations

import argparse
import statistics
import sys
import time
from collections import defaultdict

import torch
from tqdm import tqdm

from benchmark.common import format_table, write_json
from benchmark.spec_metrics import parse_spec_config
from benchmark.spec_runner import render_prompts
from specserve.corpora.datasets import (
    SPLITS,
    chat_prompt_ids,
    load_bench_tokenizer,
    sample_requests,
)

WARMUP_PROMPTS = 2
# the drafters' methods that run their own model: EAGLE heads, chain drafters (STANDALONE,
# EARLY_EXIT) by chain and by tree level, Medusa's heads, an MLPSpeculator's stages
DRAFT_FORWARDS = ("_run_head", "_step", "_tree_step", "_head_logits", "_stage_run")
NOT_TARGET = ("draft ", "propose")  # timed keys that are not target forwards


def serve(label: str, server_args: dict, prompts: list[tuple[list[int], int]],
          threads: int, concurrency: int = 1, warmup: int = WARMUP_PROMPTS,
          logprobs: int | None = None, penalty: float = 1.0) -> dict:
    from specserve.launch.server_args import ServerArgs, speculation
    from specserve.runtime.messages import GenerateReq
    from specserve.runtime.model_loader.tokenizer import load_tokenizer
    from specserve.runtime.model_runner.model_runner import ModelRunner, RunnerConfig
    from specserve.runtime.model_runner.runner_process import RunnerWorker, single_torch_thread
    from specserve.runtime.sampling.logprobs import LogprobOptions
    from specserve.runtime.sampling.sampling_params import SamplingParams
    from specserve.runtime.scheduler.scheduler import Scheduler, SchedulerConfig
    from specserve.runtime.scheduler.stop import StopChecker

    torch.set_num_threads(threads)
    args = ServerArgs(**server_args).resolve()
    runner = ModelRunner(RunnerConfig(args.model_path, "cpu", "float32",
                                      max_total_tokens=8192, num_threads=threads,
                                      activation_digits=args.activation_digits))
    plug = speculation(args)
    spec = None if plug is None else plug.create_worker(runner)
    single_torch_thread(runner)  # as the runner process does
    worker = RunnerWorker(runner, spec)
    stop = StopChecker(load_tokenizer(args.model_path), [], 8192)
    cfg = SchedulerConfig.from_server_args(args)
    controller = None if plug is None else plug.create_controller(spec.verify_cost)
    submitted: dict[str, float] = {}
    ttft: list[float] = []
    done: set[str] = set()

    def emit(msg) -> None:  # the scheduler's output: first tokens and finishes
        now = time.perf_counter()
        for rid, toks, fin in zip(msg.rids, msg.new_token_ids, msg.finish_reasons):
            if toks and rid in submitted:
                ttft.append(now - submitted.pop(rid))
            if fin is not None:
                done.add(rid)

    sched = Scheduler(cfg, runner.kv_capacity, stop, worker.run, emit, controller)
    times: dict[str, list[float]] = defaultdict(list)
    forward = runner.forward

    def timed(batch, *a, **kw):
        t = time.perf_counter()
        out = forward(batch, *a, **kw)
        if counting:
            key = f"{batch.mode.name}:{batch.num_tokens}" + ("+capture" if batch.capture_layers
                                                             else "")
            times[key].append(time.perf_counter() - t)
        return out

    runner.forward = timed
    for name in DRAFT_FORWARDS if spec is not None else ():
        if hasattr(spec.drafter, name):
            setattr(spec.drafter, name, _timed_draft(getattr(spec.drafter, name), name, times,
                                                     lambda: counting))
    if spec is not None:  # the whole proposal, its own forwards included
        spec.drafter.propose = _timed_draft(spec.drafter.propose, "propose", times,
                                            lambda: counting, key="propose")
    counting, wall, steps, tokens = False, 0.0, 0, 0

    def submit(i: int) -> None:
        ids, max_new = prompts[i]
        if counting:
            submitted[f"p{i}"] = time.perf_counter()
        sched.handle(GenerateReq(rid=f"p{i}", input_ids=ids, sampling_params=SamplingParams(
            temperature=0.0, max_new_tokens=max_new, ignore_eos=True,
            repetition_penalty=penalty),
            logprobs=None if logprobs is None else LogprobOptions(top=logprobs)))

    bar = tqdm(total=len(prompts), desc=label, unit="prompt")
    warm = min(warmup, len(prompts))
    for i in range(warm):  # the warm-up prompts one by one, not counted
        submit(i)
        while sched.step():
            pass
        bar.update()
    done.clear()
    # then `concurrency` requests in flight: a new one arrives as soon as one finishes
    counting, nxt, inflight = True, warm, 0
    before = sched.totals["generation_tokens"]
    t = time.perf_counter()
    while nxt < len(prompts) or inflight:
        while inflight < concurrency and nxt < len(prompts):
            submit(nxt)
            nxt, inflight = nxt + 1, inflight + 1
        sched.step()
        steps += 1
        if done:
            inflight -= len(done)
            bar.update(len(done))
            done.clear()
    wall = time.perf_counter() - t
    tokens = sched.totals["generation_tokens"] - before
    bar.close()
    fwd = sum(sum(v) for k, v in times.items() if not k.startswith(NOT_TARGET))
    draft = sum(sum(v) for k, v in times.items() if k.startswith("draft "))
    return {"label": label, "wall_s": wall, "tokens": tokens, "steps": steps,
            "forward_s": fwd, "draft_forward_s": draft,
            "draft_forward_ms_per_step": draft / max(steps, 1) * 1e3,
            "outside_forward_ms_per_step": (wall - fwd - draft) / max(steps, 1) * 1e3,
            "ttft_median_ms": statistics.median(ttft) * 1e3 if ttft else None,
            "forwards": {k: {"count": len(v), "median_ms": statistics.median(v) * 1e3,
                             "total_s": sum(v)} for k, v in sorted(times.items())}}


def _serve_all(args, configs, prompts, digits: int, suffix: str) -> list[dict]:
    """The baseline and every config at `digits` activation digits (labels + suffix), then
    each again asking for logprobs (`--logprobs`)."""
    pen, out = args.repetition_penalty, []
    plans = [("baseline", {})] + [(c.label, c.server_args) for c in configs]
    for lp in [None] + ([args.logprobs] if args.logprobs is not None else []):
        tag = "" if lp is None else f"+logprobs{lp}"
        for label, server_args in plans:
            run = serve(label + tag + suffix, {**server_args, "activation_digits": digits},
                        prompts, args.threads, args.concurrency, args.warmup_prompts, lp,
                        penalty=pen)
            out.append({**run, "group": tag + suffix, "activation_digits": digits})
    return out


def _timed_draft(fn, name: str, times: dict, counting, key: str | None = None):
    """`fn` (a drafter's own-model forward) timed into times["draft <name>[ fused]"] (or
    times[key])."""

    def timed(*a, **kw):
        t = time.perf_counter()
        out = fn(*a, **kw)
        if counting():
            fused = name == "_run_head" and (a[2] if len(a) > 2 else kw.get("fused"))
            times[key or f"draft {name.lstrip('_')}{' fused' if fused else ''}"].append(
                time.perf_counter() - t)
        return out

    return timed


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--dataset", default="rewrite", choices=["rewrite", "sharegpt", "schema"])
    p.add_argument("--split", default="train", choices=SPLITS)
    p.add_argument("--num-prompts", type=int, default=12)
    p.add_argument("--max-new-tokens", type=int, default=128)
    p.add_argument("--configs", nargs="+", default=["NGRAM"])
    p.add_argument("--threads", type=int, default=2)
    p.add_argument("--warmup-prompts", type=int, default=WARMUP_PROMPTS,
                   help="prompts served alone first and not counted (0: count from a cold "
                   "start, as a flushed server begins)")
    p.add_argument("--concurrency", type=int, default=1,
                   help="requests in flight (a new one arrives when one finishes; the warm-up "
                   "prompts run alone first)")
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--logprobs", type=int, default=None, metavar="N",
                   help="run every configuration again with each request asking for its "
                   "tokens' logprobs and N alternatives (what logprobs cost a step)")
    p.add_argument("--repetition-penalty", type=float, default=1.0,
                   help="every request's (greedy) repetition penalty")
    p.add_argument("--activation-digits", default="3",
                   help="comma-separated: the baseline and every config at each (e.g. 3,1)")
    p.add_argument("--output", default="results/profile_spec_step.json")
    args = p.parse_args(argv)
    try:
        configs = [parse_spec_config(c) for c in args.configs]
    except ValueError as e:
        print(f"error: {e}", file=sys.stderr)
        return 2
    tok = load_bench_tokenizer(None)
    reqs = sample_requests(args.dataset, args.num_prompts + args.warmup_prompts, tok, args.seed,
                           args.max_new_tokens, split=args.split)
    ids = render_prompts(reqs, lambda m: chat_prompt_ids(tok, m),
                         lambda t: tok.encode(t, add_special_tokens=False))
    prompts = [(p, r.max_new_tokens) for p, r in zip(ids, reqs)]
    runs = []
    digits = [int(d) for d in args.activation_digits.split(",")]
    for d in digits:
        runs += _serve_all(args, configs, prompts, d, f"@{d}d" if len(digits) > 1 else "")
    rows = []
    for r in runs:
        base = next(b for b in runs if b["label"] == "baseline" + r["group"])
        decode = base["forwards"].get(f"DECODE:{args.concurrency}", {}).get("median_ms")
        for key, f in r["forwards"].items():
            if key.startswith(NOT_TARGET):  # every one, and their total time
                ratio = f"{f['median_ms'] / decode:.3f}" if decode else "-"
                rows.append([r["label"], key, f["count"], f"{f['median_ms']:.2f}", ratio,
                             f"total {f['total_s']:.2f} s"])
            elif f["count"] >= 5 and not key.startswith("EXTEND"):
                ratio = f"{f['median_ms'] / decode:.2f}" if decode else "-"
                rows.append([r["label"], key, f["count"], f"{f['median_ms']:.1f}", ratio, ""])
        if r["draft_forward_s"]:
            per = r["draft_forward_ms_per_step"]
            rows.append([r["label"], "drafter's forwards", r["steps"], f"{per:.2f}",
                         f"{per / decode:.2f}" if decode else "-", ""])
        rows.append([r["label"], "outside any forward", r["steps"],
                     f"{r['outside_forward_ms_per_step']:.2f}", "", ""])
        rows.append([r["label"], "TTFT (median)", len(prompts) - args.warmup_prompts,
                     f"{r['ttft_median_ms']:.1f}", "", ""])
        speed = (r["tokens"] / r["wall_s"]) / (base["tokens"] / base["wall_s"])
        rows.append([r["label"], "end to end", r["tokens"], "", f"{speed:.2f}x",
                     f"{r['tokens'] / r['wall_s']:.1f} tok/s"])
    write_json(args.output, {"args": vars(args), "runs": runs})
    print(format_table(["run", "forward (mode:tokens)", "count", "median ms / step",
                        "vs decode", "throughput"], rows))
    return 0


if __name__ == "__main__":
    sys.exit(main())
