"""A MODEL, not a measurement: what the acceptance measured by `bench_speculative` would give
with a target k times as costly per step as the draft's cost per draft token.

    python -m benchmark.draft_cost_model results/bench_speculative_all_methods.json

For each model-drafter run (c = 1, T = 0) of the JSON: measured tokens per verify step
tau = 1 + sum of the per-position acceptance rates (drafting steps only, as measured), measured
draft cost per token (drafting time / drafted tokens) against the baseline's measured time per
token, then the modelled speedup tau / (1 + S / k) for several k, which assumes a verify pass of
S + 1 tokens costs one plain decode step (a memory-bound GPU target; on this CPU it costs more).
"""

from __future__ import annotations

import argparse
import json

from benchmark.common import format_table

KS = (1, 3, 10, 30, 100)


def rows(result: dict) -> list[list]:
    runs = [r for r in result["runs"] if r["concurrency"] == 1 and not r.get("temperature")]
    base = {r["dataset"]: r for r in runs if r["config"] == "baseline"}
    out = []
    for r in runs:
        m = r["metrics"]
        if r["config"] == "baseline" or not m.get("draft_tokens_per_step"):
            continue
        if not m.get("draft_ms_per_step") or r["dataset"] not in base:
            continue
        steps_drafted = m["draft_tokens_per_step"]  # mean drafts per verify step
        tau = 1 + sum(m.get("accept_rate_per_pos") or [])
        draft_ms_per_token = m["draft_ms_per_step"] / steps_drafted
        target_ms = 1e3 / base[r["dataset"]]["metrics"]["output_tokens_per_s"]
        s = steps_drafted
        out.append([r["dataset"], r["config"], f"{tau:.2f}", f"{draft_ms_per_token:.2f}",
                    f"{target_ms:.2f}", f"{target_ms / draft_ms_per_token:.1f}",
                    *(f"{tau / (1 + s / k):.2f}x" for k in KS)])
    return out


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("json", nargs="+")
    args = p.parse_args(argv)
    table = []
    for path in args.json:
        table += rows(json.loads(open(path).read()))
    print("MODEL (computed from measured acceptance; verify of S+1 tokens assumed = 1 decode):")
    print(format_table(["dataset", "config", "tokens/step", "draft ms/token", "target ms/token",
                        "k measured", *(f"k={k}" for k in KS)], table))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
