"""Where a speculative step's time goes: forwards by mode and size, and the rest, in-process.

    python -m benchmark.profile_spec_step --dataset rewrite --split train --num-prompts 12

Runs the scheduler and the model-runner worker in one process (no HTTP, no IPC) on the default
model, serving the prompts one after another (`--concurrency N`: N requests in flight, a new one
arriving as soon as one finishes), once without speculation and once per `--configs` entry
(NGRAM options as in `bench_speculative`: `NGRAM`, `NGRAM:ngram_max_draft_tokens=8`). Every
`ModelRunner.forward` is timed (`+capture`: it captured hidden states for the drafter), and so
is every forward of an EAGLE head (over target features, and draft steps) and every drafter's
`propose` (the whole proposal, its share of a decode step); the table gives the
median forward time per (mode, tree size), its ratio to a decode step of the full batch measured
in the same serving loop (the T(n)/T(1) that `benchmark.replay_ngram` models), the per-step time
outside forwards (drafting, tree masks, verification, commit, scheduling) and the median time to
first token. The first two prompts warm up (alone) and are not counted (`--warmup-prompts`).
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
# timed, but not target forwards: an EAGLE head's forwards, and every drafter's `propose`
NOT_FORWARDS = ("head", "propose")


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
                                      max_total_tokens=8192, num_threads=threads))
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
    head = getattr(spec.drafter, "_run_head", None) if spec is not None else None
    if head is not None:  # an EAGLE head's forwards: over target features, and draft steps

        def timed_head(batch, hidden, fused):
            t = time.perf_counter()
            out = head(batch, hidden, fused)
            if counting:
                times["head " + ("DRAFT_EXTEND" if fused else "draft step")].append(
                    time.perf_counter() - t)
            return out

        spec.drafter._run_head = timed_head
    if spec is not None:  # the drafter's whole proposal (head forwards included)
        propose = spec.drafter.propose

        def timed_propose(reqs):
            t = time.perf_counter()
            out = propose(reqs)
            if counting:
                times["propose"].append(time.perf_counter() - t)
            return out

        spec.drafter.propose = timed_propose
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
    fwd = sum(sum(v) for k, v in times.items() if not k.startswith(NOT_FORWARDS))
    return {"label": label, "wall_s": wall, "tokens": tokens, "steps": steps,
            "forward_s": fwd, "outside_forward_ms_per_step": (wall - fwd) / max(steps, 1) * 1e3,
            "ttft_median_ms": statistics.median(ttft) * 1e3 if ttft else None,
            "forwards": {k: {"count": len(v), "median_ms": statistics.median(v) * 1e3,
                             "total_s": sum(v)} for k, v in sorted(times.items())}}


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
    pen = args.repetition_penalty
    runs = [serve("baseline", {}, prompts, args.threads, args.concurrency, args.warmup_prompts,
                  penalty=pen)]
    runs += [serve(c.label, c.server_args, prompts, args.threads, args.concurrency,
                   args.warmup_prompts, penalty=pen) for c in configs]
    if args.logprobs is not None:  # each again, every request asking for logprobs
        lp = f"+logprobs{args.logprobs}"
        runs += [serve("baseline" + lp, {}, prompts, args.threads, args.concurrency,
                       args.warmup_prompts, args.logprobs)]
        runs += [serve(c.label + lp, c.server_args, prompts, args.threads, args.concurrency,
                       args.warmup_prompts, args.logprobs) for c in configs]
    decode = runs[0]["forwards"].get(f"DECODE:{args.concurrency}", {}).get("median_ms")
    rows = []
    for r in runs:
        for key, f in r["forwards"].items():
            if key.startswith(NOT_FORWARDS):  # every run, and their total time
                ratio = f"{f['median_ms'] / decode:.3f}" if decode and key == "propose" else ""
                rows.append([r["label"], key, f["count"], f"{f['median_ms']:.2f}", ratio,
                             f"total {f['total_s']:.2f} s"])
            elif f["count"] >= 5 and not key.startswith("EXTEND"):
                ratio = f"{f['median_ms'] / decode:.2f}" if decode else "-"
                rows.append([r["label"], key, f["count"], f"{f['median_ms']:.1f}", ratio, ""])
        rows.append([r["label"], "outside forwards", r["steps"],
                     f"{r['outside_forward_ms_per_step']:.2f}", "", ""])
        rows.append([r["label"], "TTFT (median)", len(prompts) - args.warmup_prompts,
                     f"{r['ttft_median_ms']:.1f}", "", ""])
        rows.append([r["label"], "end to end", r["tokens"], "", "",
                     f"{r['tokens'] / r['wall_s']:.1f} tok/s"])
    write_json(args.output, {"args": vars(args), "runs": runs})
    print(format_table(["run", "forward (mode:tokens)", "count", "median ms / step",
                        "vs decode", "throughput"], rows))
    return 0


if __name__ == "__main__":
    sys.exit(main())
