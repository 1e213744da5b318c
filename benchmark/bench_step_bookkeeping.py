"""What a step's bookkeeping costs around the forward: the model runner's `ForwardBatch.build`
and CPU attention plan, and the scheduler's whole decode step (batch assembly, slot
allocation, applying the result), timed with the caches cold (as right after a forward).

    python -m benchmark.bench_step_bookkeeping --batch-sizes 1,8,32 --context 300 --tree-nodes 4

A CPU-engine forward streams the model's weights through every cache level, so the Python and
torch code that runs between two forwards finds its code and data evicted: a small torch op
that takes ~3 us in a loop takes 20-60 us there. This times the index assembly of one step
(decode: one new token per request; spec root: a speculative step in which no one drafted,
each request's one-node tree built as the drafters hand it over; verify: a `--tree-nodes`
chain per request built from lists, positions and ancestor masks, as the speculative worker
builds it) after sweeping `--evict-mb` of memory
(cold) and back to back (warm). The scheduler rows run a real `Scheduler` over a stand-in
runner that sweeps the same memory instead of a forward and answers one token per request:
the time of `Scheduler.step` minus the stand-in's, per decode step (the scheduler's side of
a plain decode step; in a server it runs in its own process while the runner waits).
Medians over `--reps`; a table last, JSON (`--output`).
To compare two versions of the runtime, run this file with each tree on PYTHONPATH
(`PYTHONPATH=<old tree> python <this tree>/benchmark/bench_step_bookkeeping.py`).
"""

from __future__ import annotations

import argparse
import statistics
import time

import numpy as np
import torch
from tqdm import tqdm

from benchmark.common import format_table, machine_info, write_json
from specserve.runtime.forward_batch import ForwardBatch, ForwardMode
from specserve.runtime.layers.attention.cpu import plan
from specserve.speculative.tree import DraftTree


def ints(text: str) -> list[int]:
    return [int(x) for x in text.split(",") if x]


MODES = ("decode", "spec root", "verify")


def step_inputs(batch: int, context: int, nodes: int, mode: str) -> dict:
    """One step's per-request pieces: slot tensors (prefix + new) and each tree's lists."""
    n = nodes if mode == "verify" else 1
    slots = [torch.arange(b * 100_000, b * 100_000 + context + n) for b in range(batch)]
    lists = [(list(range(7 + b, 7 + b + n)), [-1] + list(range(n - 1))) for b in range(batch)]
    return {"slots": slots, "lists": lists, "prefix_lens": [context] * batch}


def bookkeeping(inp: dict, mode: str) -> None:
    prefix_lens = inp["prefix_lens"]
    if mode == "decode":  # plain decoding: no trees
        batch = ForwardBatch.build(ForwardMode.DECODE, [[t[0]] for t, _ in inp["lists"]],
                                   inp["slots"], prefix_lens)
        batch.check()
        plan(batch)
        return
    trees = [DraftTree.from_parents(t, p) for t, p in inp["lists"]]
    tokens = [t.token_list for t in trees]
    if mode == "verify":
        batch = ForwardBatch.build(
            ForwardMode.TARGET_VERIFY, tokens, inp["slots"], prefix_lens,
            positions=torch.tensor([p + d for p, t in zip(prefix_lens, trees)
                                    for d in t.depth_list]),
            custom_masks=[t.ancestor_mask for t in trees], logits="all")
    else:
        batch = ForwardBatch.build(ForwardMode.DECODE, tokens, inp["slots"], prefix_lens)
    batch.check()
    plan(batch)


def scheduler_step_us(batch: int, context: int, reps: int, sweep: np.ndarray) -> float:
    """Median us of the scheduler's own work per decode step at `batch` requests."""
    from specserve.corpora.datasets import load_bench_tokenizer
    from specserve.runtime.messages import BatchResult, GenerateReq
    from specserve.runtime.sampling.sampling_params import SamplingParams
    from specserve.runtime.scheduler.scheduler import Scheduler, SchedulerConfig
    from specserve.runtime.scheduler.stop import StopChecker

    inside = [0.0]

    def fake_runner(msg):
        t = time.perf_counter()
        sweep.sum()  # what a forward does to the caches
        out = [[17] if e.needs_token else [] for e in msg.reqs]
        inside[0] += time.perf_counter() - t
        return BatchResult(batch_id=msg.batch_id, next_token_ids=out)

    stop = StopChecker(load_bench_tokenizer(), [0], context + reps + 64)
    cfg = SchedulerConfig(max_running_requests=batch, chunked_prefill_size=context * batch)
    sched = Scheduler(cfg, batch * (context + reps + 64) + 64, stop, fake_runner,
                      lambda msg: None)
    params = SamplingParams(temperature=0.0, max_new_tokens=reps + 32, ignore_eos=True)
    for i in range(batch):
        ids = [(i * 7919 + j * 31) % 30000 + 3 for j in range(context)]
        sched.handle(GenerateReq(rid=f"r{i}", input_ids=ids, sampling_params=params))
    while any(r.num_pending > 1 for r in sched.running) or sched.waiting:
        sched.step()  # prefill
    for _ in range(10):
        sched.step()
    times = []
    for _ in range(reps):
        inside[0] = 0.0
        t = time.perf_counter()
        sched.step()
        times.append(time.perf_counter() - t - inside[0])
    return statistics.median(times) * 1e6


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--batch-sizes", type=ints, default=[1, 8, 32])
    p.add_argument("--context", type=int, default=300, help="prefix tokens per request")
    p.add_argument("--tree-nodes", type=int, default=4, help="nodes per verify tree")
    p.add_argument("--reps", type=int, default=200)
    p.add_argument("--evict-mb", type=int, default=64, help="memory swept before a cold rep")
    p.add_argument("--output", default="results/bench_step_bookkeeping.json")
    args = p.parse_args(argv)
    torch.set_num_threads(1)  # as the model runner sets torch's own ops (runner_process.py)
    sweep = np.ones(args.evict_mb * (1 << 20) // 8)
    rows, records = [], []
    cases = [(b, m) for b in args.batch_sizes for m in MODES]
    for b, m in tqdm(cases, desc="bookkeeping", unit="case"):
        inp = step_inputs(b, args.context, args.tree_nodes, m)
        for _ in range(10):  # first calls (lazy imports, allocator growth) are not counted
            bookkeeping(inp, m)
        cold, warm = [], []
        for _ in range(args.reps):
            sweep.sum()
            t = time.perf_counter()
            bookkeeping(inp, m)
            cold.append(time.perf_counter() - t)
            t = time.perf_counter()
            bookkeeping(inp, m)
            warm.append(time.perf_counter() - t)
        c, w = statistics.median(cold) * 1e6, statistics.median(warm) * 1e6
        mode = f"verify {args.tree_nodes}" if m == "verify" else m
        records.append({"batch": b, "mode": mode, "cold_us": c, "warm_us": w})
        rows.append([b, mode, c, w, c / w])
    for b in tqdm(args.batch_sizes, desc="scheduler", unit="batch"):
        c = scheduler_step_us(b, args.context, args.reps, sweep)
        records.append({"batch": b, "mode": "scheduler decode step", "cold_us": c})
        rows.append([b, "scheduler decode", c, "-", "-"])
    write_json(args.output, {"args": vars(args), "machine": machine_info(), "rows": records})
    print(f"\nJSON: {args.output}\n")
    print(f"median us per step: the trees (spec), ForwardBatch.build + check + the CPU attention "
          f"plan, and "
          f"the scheduler's decode step ({args.context}-token prefixes; cold = after sweeping "
          f"{args.evict_mb} MB)")
    print(format_table(["batch", "mode", "cold us", "warm us", "cold / warm"], rows))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
