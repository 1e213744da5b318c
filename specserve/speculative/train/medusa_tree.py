"""Choose a Medusa tree (`--speculative-medusa-choices`) for trained heads, from the train split.

    python -m specserve.speculative.train.medusa_tree --run results/medusa [--max-nodes 24]

The Medusa paper's construction: measure each head's top-r accuracy (how often the token it
ranks r-th is the one the target would choose there), take the accuracy of a path of ranks as
the product along it (heads treated as independent), and grow the tree greedily by the path of
highest accuracy. The expected accepted drafts of a tree are then the sum of its paths'
accuracies (a node's path can only be accepted whole, and siblings are disjoint events).

Which size to keep is a cost question: on the CPU engine a verify row is not free, so each
candidate size n is scored by expected tokens per step over the step's cost
`VERIFY_COST[engine](n + 1) + draft_cost` (the heads' own cost in decode steps, measured by
`bench_speculative` as "draft ms/step"), and the best one is printed as JSON to paste into the
flag (or `DEFAULT_CHOICES`).

Labels are the target's greedy choice at every position: its LM head on the captured final
hidden state of position t + 1 + k is what head k on position t must hit. Rows come from the
run's captured train-split answers (`features/`), the trainer's held-out rows first.
"""

from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path

import numpy as np
import torch

from specserve.speculative.train.capture import FEATURE_DIR, FeatureStore
from specserve.speculative.train.trainer import is_val, load_target_parts


@torch.inference_mode()
def rank_accuracy(store: FeatureStore, heads, lm_head: torch.Tensor, max_rank: int,
                  max_rows: int = 20000) -> np.ndarray:
    """[K, max_rank]: P(head k's rank-r token is the target's greedy token at t + 2 + k)."""
    _, final, _ = store.arrays()
    seqs = sorted(store.index, key=lambda r: (not is_val(r["id"], 3), r["id"]))
    k_heads = heads.num_heads
    hits = np.zeros((k_heads, max_rank), dtype=np.int64)
    counts = np.zeros(k_heads, dtype=np.int64)
    rows = 0
    for r in seqs:
        if rows >= max_rows:
            break
        s, n, p = r["start"], r["length"], r["prompt_len"]
        # rows t in the answer part whose label position t + 2 + k exists for every head
        lo, hi = max(p - 1, 0), n - 1 - k_heads
        if hi <= lo:
            continue
        h = torch.from_numpy(np.asarray(final[s: s + n], dtype=np.float32))
        greedy = (h @ lm_head.T).argmax(-1)  # [n]: the target's choice after position i
        logits = heads.logits(h[lo:hi], lambda x: x @ lm_head.T)  # [K, R, V]
        top = logits.topk(max_rank, dim=-1).indices  # [K, R, max_rank]
        for k in range(k_heads):
            label = greedy[lo + 1 + k: hi + 1 + k]  # token t + 2 + k = argmax after t + 1 + k
            eq = top[k] == label[:, None]
            hits[k] += eq.sum(0).numpy()
            counts[k] += len(label)
        rows += hi - lo
    return hits / np.maximum(counts, 1)[:, None]


def grow_tree(acc: np.ndarray, max_nodes: int) -> list[tuple[tuple[int, ...], float]]:
    """Greedy paths in the order added, each with its estimated accuracy."""
    k_heads, max_rank = acc.shape
    prob = {(): 1.0}
    next_rank = {(): 0}
    order: list[tuple[tuple[int, ...], float]] = []
    while len(order) < max_nodes:
        best, best_p = None, -1.0
        for path, p in prob.items():
            r = next_rank[path]
            if len(path) >= k_heads or r >= max_rank:
                continue
            cand = p * float(acc[len(path), r])
            if cand > best_p:
                best, best_p = path + (r,), cand
        if best is None:
            break
        next_rank[best[:-1]] += 1
        prob[best], next_rank[best] = best_p, 0
        order.append((best, best_p))
    return order


def choose(acc: np.ndarray, max_nodes: int, cost, draft_cost: float) -> dict:
    order = grow_tree(acc, max_nodes)
    table, expected = [], 1.0
    for n, (_, p) in enumerate(order, start=1):
        expected += p
        step = cost(n + 1) + draft_cost
        table.append({"drafts": n, "expected_accept": round(expected, 4),
                      "step_cost": round(step, 4), "tokens_per_cost": round(expected / step, 4)})
    best = max(table, key=lambda row: row["tokens_per_cost"])
    choices = [list(path) for path, _ in order[: best["drafts"]]]
    return {"choices": choices, "best": best, "table": table,
            "rank_accuracy": np.round(acc, 4).tolist()}


def main(argv: list[str] | None = None) -> int:
    from specserve.runtime.verify_cost import VERIFY_COST
    from specserve.speculative.models.medusa import load_medusa

    ap = argparse.ArgumentParser(prog="python -m specserve.speculative.train.medusa_tree",
                                 description=__doc__.split("\n\n")[0])
    ap.add_argument("--run", required=True, help="the trainer's --output (features/, medusa/)")
    ap.add_argument("--heads", help="Medusa heads directory (default: RUN/medusa)")
    ap.add_argument("--target-model", default="default")
    ap.add_argument("--max-nodes", type=int, default=24, help="largest tree tried (drafts)")
    ap.add_argument("--max-rank", type=int, default=8)
    ap.add_argument("--max-rows", type=int, default=20000)
    ap.add_argument("--engine", default="cpu", choices=sorted(VERIFY_COST))
    ap.add_argument("--draft-cost", type=float, default=0.1,
                    help="the heads' cost per step in decode steps (bench_speculative's draft "
                         "ms/step over the baseline's ms/token)")
    ap.add_argument("--out", help="write the result JSON here too")
    args = ap.parse_args(argv)
    run = Path(args.run)
    mc, _, lm_head, _ = load_target_parts(args.target_model)
    heads = load_medusa(args.heads or str(run / "medusa"), mc.hidden_size, mc.vocab_size)
    heads.float()
    acc = rank_accuracy(FeatureStore(run / FEATURE_DIR), heads, lm_head, args.max_rank,
                        args.max_rows)
    res = choose(acc, args.max_nodes, VERIFY_COST[args.engine], args.draft_cost)
    for k, row in enumerate(res["rank_accuracy"]):
        print(f"head {k}: top-r accuracy " + " ".join(f"{a:.3f}" for a in row), file=sys.stderr)
    print(f"{'drafts':>6} {'E[accept]':>9} {'cost':>6} {'tok/cost':>8}", file=sys.stderr)
    for row in res["table"]:
        print(f"{row['drafts']:>6} {row['expected_accept']:>9.3f} {row['step_cost']:>6.2f} "
              f"{row['tokens_per_cost']:>8.3f}", file=sys.stderr)
    if args.out:
        Path(args.out).write_text(json.dumps(res, indent=1) + "\n")
    print(json.dumps(res["choices"]))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
