"""Per-step CPU cost of the NGRAM drafter's trie: extend + draft, against context length.

    python -m benchmark.bench_ngram_cache --context-lens 1000,8000,32000 --new-per-step 1,4,8

The token stream mixes random tokens from a small vocabulary with repeated passages, so
suffixes match and drafts are real trees. For each (context length, new tokens per step) a
fresh cache gets the context via `insert` (the prompt), then every step times
`extend(key, tail, new)` (what the worker does after verify) and the next step's draft
separately. Draft modes: `tree` = `draft(tail)` -> DraftTree, as the NGRAM drafter calls it;
`keyed` = `draft(tail, key=key)` (suffix nodes reused from the extend); `lists` =
`draft_lists(tail)` (plain lists, no tensors); `drafter` = the whole `NgramDrafter` as the
model runner drives it (`observe` then `propose`, with the own-context drafts of short matches,
`specserve/speculative/ngram_context.py`); `suffix` = the whole `SuffixDrafter` (SUFFIX: its own
suffix tree over the context, depth 24, and the global tree over the outputs, observe then propose;
rows at every `--context-lens`, one new token per step, reported under match "SUFFIX"). `keyed`,
`lists` and `drafter` run at `--aux-context`. `--evict-capacity` adds rows with a small capacity, so
every step also evicts. `hit %` = steps whose tree has the true next token as a child of the root.
`step p99 cpu` is the p99 of the thread's CPU time for extend + draft: on a shared machine the
wall-clock tail also holds time slices lost to other processes (the 4 ms scheduler tick shows up
there). Prints a table last and writes JSON (`--output`).
"""

from __future__ import annotations

import argparse
import gc
import random
import statistics
import time

from benchmark.common import format_table, machine_info, write_json
from specserve.runtime.sampling.sampling_params import SamplingParams
from specserve.speculative.base import RunnerReq, SpecConfig
from specserve.speculative.drafters.ngram import NgramDrafter
from specserve.speculative.drafters.suffix import SuffixDrafter
from specserve.speculative.ngram_cache import NgramCache, NgramConfig


def ints(text: str) -> list[int]:
    return [int(x) for x in text.split(",") if x]


def token_stream(n: int, vocab: int, num_passages: int, passage_len: int, seed: int) -> list[int]:
    """Alternating random runs (8-64 tokens) and copies of one of a few fixed passages."""
    rng = random.Random(seed)
    passages = [[rng.randrange(vocab) for _ in range(passage_len)] for _ in range(num_passages)]
    out: list[int] = []
    while len(out) < n:
        out += [rng.randrange(vocab) for _ in range(rng.randint(8, 64))]
        p = rng.choice(passages)
        start = rng.randrange(passage_len // 2)  # quote part of it
        out += p[start : start + rng.randint(passage_len // 4, passage_len)]
    return out[:n]


def pct(xs: list[float], q: float) -> float:
    s = sorted(xs)
    return s[min(len(s) - 1, int(q * len(s)))]


def summary(xs: list[float]) -> dict[str, float]:
    return {"median": statistics.median(xs), "p99": pct(xs, 0.99), "max": max(xs)}


def run_case(
    cfg: NgramConfig, stream: list[int], ctx_len: int, new_per_step: int, steps: int, mode: str,
) -> dict:
    drafter = None
    if mode == "suffix":
        drafter = SuffixDrafter(SpecConfig(
            "SUFFIX", num_draft_tokens=cfg.num_draft_tokens,
            suffix_max_draft_tokens=cfg.num_draft_tokens), runner=None)
        cache = drafter.global_tree
    elif mode == "drafter":
        drafter = NgramDrafter(SpecConfig(
            "NGRAM", num_draft_tokens=cfg.num_draft_tokens, ngram_capacity=cfg.capacity,
            ngram_max_trie_depth=cfg.max_trie_depth, ngram_match_type=cfg.match_type,
            ngram_disable_match_sizing=not cfg.size_by_match), runner=None)
        cache = drafter.cache
    else:
        cache = NgramCache(cfg)
    depth = cfg.max_trie_depth
    t0 = time.perf_counter()
    if drafter is not None:
        drafter.observe("req", stream[:ctx_len], ctx_len)
    else:
        cache.insert(stream[:ctx_len])
    insert_s = time.perf_counter() - t0
    greedy = SamplingParams(temperature=0.0)
    ext_us, draft_us, cpu_us, nodes, hits = [], [], [], [], 0
    pos = ctx_len
    clock, cpu_clock = time.perf_counter_ns, time.thread_time_ns
    for _ in range(steps):
        new = stream[pos : pos + new_per_step]
        tail = stream[pos - depth : pos]
        history = stream[: pos + new_per_step] if drafter is not None else None
        c0 = cpu_clock()
        t0 = clock()
        if drafter is not None:
            drafter.observe("req", history, new_per_step)
        else:
            cache.extend("req", tail, new)
        t1 = clock()
        pos += new_per_step
        tail = stream[pos - depth : pos]
        if mode in ("drafter", "suffix"):
            req = RunnerReq.drafting("req", history, cfg.num_draft_tokens, greedy)
            tree = drafter.propose([req])[0]
        elif mode == "tree":
            tree = cache.draft(tail)
        elif mode == "keyed":
            tree = cache.draft(tail, key="req")
        else:
            tokens, parents = cache.draft_lists(tail)
        t2 = clock()
        cpu_us.append((cpu_clock() - c0) / 1e3)
        ext_us.append((t1 - t0) / 1e3)
        draft_us.append((t2 - t1) / 1e3)
        if mode == "lists":
            nodes.append(len(tokens))
            hits += any(p == 0 and tokens[i] == stream[pos] for i, p in enumerate(parents))
        else:
            nodes.append(tree.num_nodes)
            hits += stream[pos] in {int(tree.tokens[c]) for c in tree.children(0)}
    return {
        "context_len": ctx_len,
        "new_per_step": new_per_step,
        "draft_mode": mode,
        "capacity": cfg.capacity,
        "match_type": "SUFFIX" if mode == "suffix" else cfg.match_type,
        "steps": steps,
        "num_nodes": (cache.num_nodes if mode != "suffix" else
                      sum(v for k, v in drafter.memory_nodes().items()
                          if k in ("global", "requests"))),
        "insert_us_per_token": insert_s / ctx_len * 1e6,
        "extend_us": summary(ext_us),
        "draft_us": summary(draft_us),
        "step_us": summary([a + b for a, b in zip(ext_us, draft_us)]),
        "step_cpu_us": summary(cpu_us),
        "mean_draft_nodes": statistics.fmean(nodes),
        "root_hit_rate": hits / steps,
    }


def main(argv: list[str] | None = None) -> dict:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawTextHelpFormatter)
    p.add_argument("--context-lens", type=ints, default=[1000, 8000, 32000])
    p.add_argument("--new-per-step", type=ints, default=[1, 4, 8])
    p.add_argument("--steps", type=int, default=1000)
    p.add_argument("--vocab", type=int, default=2000)
    p.add_argument("--passages", type=int, default=16)
    p.add_argument("--passage-len", type=int, default=96)
    p.add_argument("--num-draft-tokens", type=int, default=8)
    p.add_argument("--match-types", default="BFS,PROB")
    p.add_argument("--aux-context", type=int, default=8000,
                   help="context length of the keyed / lists draft rows (0: skip)")
    p.add_argument("--evict-capacity", type=int, default=20_000,
                   help="extra rows at --aux-context with this capacity (0: skip)")
    p.add_argument("--no-suffix", dest="suffix", action="store_false",
                   help="skip the SUFFIX drafter rows")
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--output", default="results/bench_ngram_cache.json")
    args = p.parse_args(argv)

    longest = max(args.context_lens + [args.aux_context]) + args.steps * max(args.new_per_step)
    stream = token_stream(longest + 64, args.vocab, args.passages, args.passage_len, args.seed)
    cases = []
    for mt in args.match_types.split(","):
        base = NgramConfig(match_type=mt, num_draft_tokens=args.num_draft_tokens)
        cases += [(base, n, k, "tree") for n in args.context_lens for k in args.new_per_step]
        if args.aux_context:
            cases += [(base, args.aux_context, k, mode)
                      for mode in ("keyed", "lists", "drafter") for k in args.new_per_step]
        if args.aux_context and args.evict_capacity:
            small = NgramConfig(match_type=mt, num_draft_tokens=args.num_draft_tokens,
                                capacity=args.evict_capacity)
            cases += [(small, args.aux_context, k, "tree") for k in args.new_per_step]

    if args.suffix:
        base = NgramConfig(num_draft_tokens=args.num_draft_tokens)
        cases += [(base, n, args.new_per_step[0], "suffix") for n in args.context_lens]
    runs = []
    for cfg, n, k, mode in cases:
        gc.collect()
        r = run_case(cfg, stream, n, k, args.steps, mode)
        runs.append(r)
        print(f"{cfg.match_type} ctx={n} new={k} cap={cfg.capacity} draft={mode}: "
              f"step median {r['step_us']['median']:.0f} us", flush=True)

    result = {"machine": machine_info(), "args": vars(args), "runs": runs}
    path = write_json(args.output, result)
    rows = [
        [r["match_type"], r["context_len"], r["new_per_step"], r["capacity"],
         r["draft_mode"], r["num_nodes"], r["extend_us"]["median"], r["extend_us"]["p99"],
         r["draft_us"]["median"], r["draft_us"]["p99"], r["step_us"]["median"],
         r["step_us"]["p99"], r["step_cpu_us"]["p99"], r["mean_draft_nodes"],
         100 * r["root_hit_rate"], r["insert_us_per_token"]]
        for r in runs
    ]
    print(f"\nJSON: {path}\n")
    print(format_table(
        ["match", "ctx", "new", "capacity", "draft", "nodes", "ext med us", "ext p99",
         "draft med us", "draft p99", "step med us", "step p99", "step p99 cpu", "tree nodes",
         "hit %", "insert us/tok"],
        rows,
    ))
    return result


if __name__ == "__main__":
    main()
