"""benchmark/bench_ngram_cache: every draft mode runs, and the real drafter's trees are real."""

from __future__ import annotations

from benchmark.bench_ngram_cache import main


def test_every_mode_runs_and_the_drafter_finds_the_repeated_passages(tmp_path):
    out = main(["--context-lens", "300", "--new-per-step", "1,4", "--steps", "60",
                "--aux-context", "600", "--evict-capacity", "0", "--match-types", "BFS",
                "--passages", "2", "--output", str(tmp_path / "r.json")])
    modes = {(r["draft_mode"], r["new_per_step"]) for r in out["runs"]}
    assert modes == {(m, k) for m in ("tree", "keyed", "lists", "drafter") for k in (1, 4)} | {
        ("suffix", 1)}
    drafter = [r for r in out["runs"] if r["draft_mode"] in ("drafter", "suffix")]
    # quoted passages: the next token is often a child of the root, as for the bare trie
    assert all(r["root_hit_rate"] > 0.2 and r["mean_draft_nodes"] > 1 for r in drafter)
    assert all(r["step_us"]["median"] < 5000 for r in drafter)  # far below; a sanity bound
    assert (tmp_path / "r.json").exists()
