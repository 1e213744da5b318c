"""Replay greedy outputs through a model-free drafter (NGRAM, SUFFIX) to compare drafting
policies without the model.

    python -m benchmark.bench_speculative --dataset rewrite sharegpt --split train \\
        --num-prompts 40 --configs NGRAM --concurrency 1 --output results/train_ngram.json
    python -m benchmark.replay_ngram results/train_ngram.json \\
        --configs NGRAM NGRAM:ngram_max_draft_tokens=8 NGRAM:num_draft_tokens=16

Greedy speculation is exact: every config outputs the baseline's tokens, and which drafts get
accepted depends only on those tokens. So the baseline records of a `bench_speculative` JSON
(prompts re-sampled from its own arguments) are enough to replay, at batch 1 and in order, what
the real `NgramDrafter` and the speculation controller (specserve/speculative/controller.py: its
plan, probes, sure drafts and deep-draft caps, fed the modelled step times) would do: tokens per
verify step exactly, and a modelled speedup = decode steps / sum of verify costs, each step costing
T(n)/T(1) of a decode step for an n-node tree (`--cost-curve`) plus `--step-overhead` when it
drafted. Next to it, a copy oracle's tokens per step: the same node count as one chain, placed with
hindsight where the request's own context continues the answer longest (`replay`). Tune on the
`train` split; measure the winner on `heldout` with `bench_speculative`.

`--configs` are NGRAM or SUFFIX configs written as for `bench_speculative`
(`SUFFIX[:key=value,...]`, keys are `speculative_<key>` server flags), resolved like the server
resolves them. The cost curve (`--cost-curve`: `cpu` / `torch`, the stored tables of
`specserve/runtime/verify_cost.py`, or n:ratio points) both prices the steps and is the curve a
drafter that sizes its trees by cost (SUFFIX) plans with, as the worker hands it over.
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import sys

import numpy as np
import torch
from tqdm import tqdm

from benchmark.common import format_table, write_json
from benchmark.spec_metrics import parse_spec_config
from benchmark.spec_runner import render_prompts
from specserve.corpora.datasets import chat_prompt_ids, load_bench_tokenizer, sample_requests
from specserve.launch.server_args import ServerArgs
from specserve.runtime.verify_cost import VERIFY_COST, VerifyCost
from specserve.speculative.base import ALGORITHMS, SpecConfig, create_drafter
from specserve.speculative.controller import SpecController
from specserve.speculative.ngram_context import ContextIndex

# T(n)/T(1) of an n-node TARGET_VERIFY forward against a decode step: the CPU engine's stored
# curve (specserve/runtime/verify_cost.py); between points linear. Until 2026-11-23 (the torch
# engine) the default was "1:1.0,4:1.08,8:1.27,16:1.55,32:2.3". Pass your own with --cost-curve.
DEFAULT_CURVE = "cpu"
MATCH_BUCKETS = 13  # by-match statistics for m = 1..11 and 12+ (0 never drafts)
CALIBRATION_BUCKETS = 10  # drafted nodes by their estimated probability, in tenths


REPLAYABLE = ("NGRAM", "SUFFIX")  # deterministic, model-free drafters


def parse_curve(text: str) -> tuple[list[float], list[float]]:
    if text in VERIFY_COST:
        c = VERIFY_COST[text]
        return [float(n) for n in c.rows], list(c.ratios)
    pts = sorted((float(n), float(r)) for n, r in (p.split(":") for p in text.split(",")))
    return [n for n, _ in pts], [r for _, r in pts]


def true_path(tree, truth: list[int]) -> tuple[torch.Tensor, list[bool]]:
    """The target's argmax at each node of `tree` when its output continues `truth` (truth[0]
    follows the root): known on the true path, -1 elsewhere (greedy verification never
    continues from any other node); and which nodes lie on that path."""
    depth = tree.depth.tolist()
    on_path = [True] + [False] * (tree.num_nodes - 1)
    argmax = [truth[0]] + [-1] * (tree.num_nodes - 1)
    for u in range(1, tree.num_nodes):
        p, d = int(tree.parents[u]), depth[u]
        if on_path[p] and d <= len(truth) and int(tree.tokens[u]) == truth[d - 1]:
            on_path[u] = True
            argmax[u] = truth[d] if d < len(truth) else -1
    return torch.tensor(argmax), on_path


def resolve(config: str) -> tuple[str, SpecConfig, int]:
    """A config string → (label, SpecConfig, max draft tokens), as the server has them."""
    cfg = parse_spec_config(config)
    algo = cfg.server_args.get("speculative_algorithm")
    if algo not in REPLAYABLE:
        raise ValueError(f"{config!r}: only {' / '.join(REPLAYABLE)} configs replay without "
                         "the model")
    spec = ServerArgs(**cfg.server_args).resolve().spec_config()
    return cfg.label, spec, ALGORITHMS[algo].tree_sizes(spec).alone


def copy_reach(index: ContextIndex, history: list[int], truth: list[int], cap: int) -> int:
    """Longest prefix of `truth` (at most `cap` tokens) that occurs as a run in `history`;
    `index` is `history`'s occurrence index."""
    best = 0
    j = index.last.get(truth[0], -1)
    while j >= 0 and best < cap:
        n = 0
        while n < cap and n < len(truth) and j + n < len(history) and history[j + n] == truth[n]:
            n += 1
        best = max(best, n)
        j = index.prev[j]
    return best


def replay(items: list[tuple[list[int], list[int]]], spec: SpecConfig, max_draft_tokens: int,
           curve: tuple[list[float], list[float]], step_overhead: float = 0.03) -> dict:
    """items: (prompt ids, greedy output ids) served one after another by one server.

    Besides the drafter's own counts, every step records a copy oracle's: how many tokens a
    chain of as many nodes as the drafter used, copied from the best place in the request's own
    context (prompt and output so far), would have had accepted. It knows the answer, so it is
    a reference at equal verify cost, not a policy: it shows how much of the output the context
    holds within reach of each step. (Not a strict bound: a tree can beat one chain, and the
    trie also holds other requests' text.)"""
    from specserve.runtime.sampling.sampling_params import SamplingParams
    from specserve.speculative.base import RunnerReq
    from specserve.speculative.verify import verify_greedy

    drafter = create_drafter(spec, runner=None)
    rows = tuple(int(n) for n in curve[0])
    curve_fn = VerifyCost(rows, tuple(curve[1]), t1_s=1.0) \
        if rows[0] == 1 and len(rows) > 1 else VERIFY_COST["cpu"]
    drafter.verify_cost = curve_fn  # as the worker hands it over
    sizes = dataclasses.replace(ALGORITHMS[spec.algorithm].tree_sizes(spec),
                                alone=max_draft_tokens)
    controller = SpecController(sizes, curve_fn, adaptive=not spec.disable_adaptive)
    greedy = SamplingParams(temperature=0.0)
    steps = tokens = 0
    cost = base_cost = 0.0
    per_request = []
    # drafting steps by the longest context match m (MATCH_BUCKETS - 1 = "that many or more"):
    # steps, nodes, accepted, any accepted, copy oracle's accepted
    by_match = [[0, 0, 0, 0, 0] for _ in range(MATCH_BUCKETS)]
    # drafted nodes by the probability the drafter gave them (SUFFIX: `last_probs`):
    # nodes, sum of estimates, nodes accepted
    calib = [[0, 0.0, 0] for _ in range(CALIBRATION_BUCKETS)]
    oracle_tokens = 0
    for i, (prompt, out) in enumerate(items):
        rid = f"r{i}"
        drafter.observe(rid, prompt, len(prompt))
        history = prompt + out[:1]  # the first token comes from the prefill
        drafter.observe(rid, history, 1)
        index = ContextIndex()
        index.catch_up(history)
        pos, req_cost, st = 1, 0.0, controller.new_request()
        while pos < len(out):
            plan = controller.plan([st])
            tree = drafter.propose([RunnerReq.drafting(rid, history, plan.sizes[0], greedy,
                                                       confident_only=plan.confident[0])])[0]
            truth = out[pos:]
            argmax, on_path = true_path(tree, truth)
            res = verify_greedy(tree, argmax)
            probs = getattr(drafter, "last_probs", None)
            if probs is not None and len(probs) == tree.num_nodes:
                for u in range(1, tree.num_nodes):
                    row = calib[min(int(probs[u] * CALIBRATION_BUCKETS), CALIBRATION_BUCKETS - 1)]
                    row[0] += 1
                    row[1] += probs[u]
                    row[2] += on_path[u]
            gained = min(len(res.accepted_tokens) + 1, len(truth))
            drafted = tree.num_nodes - 1
            reach = copy_reach(index, history, truth, drafted) if drafted else 0
            oracle_tokens += min(reach + 1, len(truth))
            if drafted:
                cache = getattr(drafter, "cache", None)  # NGRAM's trie; SUFFIX: bucket 0
                m = cache.last_match_len if cache is not None else 0
                row = by_match[min(m, MATCH_BUCKETS - 1)]
                row[0] += 1
                row[1] += tree.num_nodes
                row[2] += len(res.accepted_tokens)
                row[3] += bool(res.accepted_tokens)
                row[4] += reach
            c = float(np.interp(tree.num_nodes, *curve)) + (step_overhead if drafted else 0.0)
            controller.observe([st], [{"drafted": drafted, "accepted": len(res.accepted_tokens)}],
                               c)  # (time in decode steps: t1 = 1)
            req_cost += c
            steps += 1
            tokens += gained
            history.extend(truth[:gained])
            index.catch_up(history)
            drafter.observe(rid, history, gained)
            pos += gained
        drafter.release(rid)
        cost += req_cost
        base_cost += len(out) - 1
        per_request.append((len(out) - 1) / req_cost if req_cost else 1.0)
    return {"verify_steps": steps,
            "tokens_per_step": tokens / max(steps, 1),
            "oracle_tokens_per_step": oracle_tokens / max(steps, 1),
            "modelled_speedup": base_cost / cost if cost else 1.0,
            "median_request_speedup": float(np.median(per_request)) if per_request else 1.0,
            "by_match": [{"match": m, "steps": n, "mean_nodes": nodes / n,
                          "mean_accepted": acc / n, "p_any_accepted": anyacc / n,
                          "oracle_mean_accepted": orc / n}
                         for m, (n, nodes, acc, anyacc, orc) in enumerate(by_match) if n],
            "calibration": [{"bucket": b / CALIBRATION_BUCKETS, "nodes": n,
                             "mean_estimate": est / n, "accepted": acc / n}
                            for b, (n, est, acc) in enumerate(calib) if n]}


def _bucket(m: int) -> str:
    return f"{m}+" if m == MATCH_BUCKETS - 1 else str(m)


def load_items(path: str, dataset: str) -> list[tuple[list[int], list[int]]]:
    """(prompt ids, baseline greedy output) of `dataset` from a bench_speculative JSON."""
    d = json.loads(open(path).read())
    a = d["args"]
    base = next((r for r in d["runs"] if r["dataset"] == dataset and r["config"] == "baseline"
                 and r.get("temperature", 0) == 0), None)
    if base is None:
        raise ValueError(f"{path} has no greedy baseline run of dataset {dataset!r}")
    tok = load_bench_tokenizer(a.get("model_path") if a.get("model_path") != "default" else None)
    reqs = sample_requests(dataset, a["num_prompts"], tok, a["seed"], a["max_new_tokens"],
                           dataset_path=a.get("dataset_path"), split=a.get("split", "all"))
    recs = {r["id"]: r for r in base["records"]}
    items = []
    for q in reqs:
        r = recs[q.id]
        prompt = render_prompts([q], lambda m: chat_prompt_ids(tok, m),
                                lambda t: tok.encode(t, add_special_tokens=False))[0]
        if len(prompt) != r["prompt_len"]:
            raise ValueError(f"{q.id}: re-rendered prompt has {len(prompt)} tokens, the run "
                             f"had {r['prompt_len']} (another tokenizer or template?)")
        items.append((prompt, r["output_ids"]))
    return items


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("input", help="a bench_speculative JSON with greedy baseline runs")
    p.add_argument("--datasets", nargs="+", default=None,
                   help="datasets of the JSON to replay (default: all)")
    p.add_argument("--configs", nargs="+", default=["NGRAM:ngram_max_draft_tokens=8", "NGRAM"],
                   help="NGRAM / SUFFIX[:key=value,...] per config, as for bench_speculative")
    p.add_argument("--cost-curve", default=DEFAULT_CURVE,
                   help="cpu / torch (the stored curves) or n:T(n)/T(1),... points")
    p.add_argument("--step-overhead", type=float, default=0.03,
                   help="extra cost of a drafting step, in decode steps (drafting, masks, "
                        "verification, commit)")
    p.add_argument("--by-match", action="store_true",
                   help="also print, per config, the drafting steps by their longest context "
                   "match m: tree nodes, drafts accepted, how often any was")
    p.add_argument("--calibration", action="store_true",
                   help="also print, per config that reports its node probabilities (SUFFIX), "
                   "the drafted nodes by estimated probability against how often they were "
                   "accepted")
    p.add_argument("--output", default="results/replay_ngram.json")
    args = p.parse_args(argv)
    try:
        configs = [resolve(c) for c in args.configs]
        curve = parse_curve(args.cost_curve)
        data = json.loads(open(args.input).read())
        datasets = args.datasets or list(data["args"]["dataset"])
        items = {ds: load_items(args.input, ds) for ds in datasets}
    except (OSError, ValueError, KeyError) as e:
        print(f"error: {e}", file=sys.stderr)
        return 2
    rows = []
    for ds in datasets:
        for label, spec, deep in tqdm(configs, desc=f"replay {ds}", unit="config"):
            rows.append({"dataset": ds, "config": label,
                         **replay(items[ds], spec, deep, curve, args.step_overhead)})
    write_json(args.output, {"input": args.input, "cost_curve": args.cost_curve,
                             "step_overhead": args.step_overhead, "rows": rows})
    if args.by_match:
        print(format_table(
            ["dataset", "config", "m", "steps", "nodes (mean)", "accepted (mean)",
             "P(any accepted)", "copy oracle (mean)"],
            [[r["dataset"], r["config"], _bucket(b["match"]), b["steps"],
              f"{b['mean_nodes']:.1f}", f"{b['mean_accepted']:.2f}",
              f"{b['p_any_accepted']:.2f}", f"{b['oracle_mean_accepted']:.2f}"]
             for r in rows for b in r["by_match"]]))
        print()
    if args.calibration:
        print(format_table(
            ["dataset", "config", "estimate", "nodes", "mean estimate", "accepted"],
            [[r["dataset"], r["config"],
              f"{c['bucket']:.1f}-{c['bucket'] + 1 / CALIBRATION_BUCKETS:.1f}", c["nodes"],
              f"{c['mean_estimate']:.2f}", f"{c['accepted']:.2f}"]
             for r in rows for c in r["calibration"]]))
        print()
    print(format_table(
        ["dataset", "config", "verify steps", "tokens/step", "copy oracle tokens/step",
         "modelled speedup", "median request"],
        [[r["dataset"], r["config"], r["verify_steps"], f"{r['tokens_per_step']:.2f}",
          f"{r['oracle_tokens_per_step']:.2f}",
          f"{r['modelled_speedup']:.3f}x", f"{r['median_request_speedup']:.3f}x"]
         for r in rows]))
    return 0


if __name__ == "__main__":
    sys.exit(main())
