"""benchmark/replay_ngram: the replay drives the real drafter and the speculation controller."""

from __future__ import annotations

import random

import pytest

from benchmark.replay_ngram import parse_curve, replay, resolve

CURVE = parse_curve("1:1,8:1.25,16:1.5,32:2.2")


def copy_items(seed: int, n: int = 4) -> list[tuple[list[int], list[int]]]:
    """Prompts holding a passage; outputs copy it with an edit every ~30 tokens."""
    rng = random.Random(seed)
    items = []
    for _ in range(n):
        passage = [rng.randrange(100, 5000) for _ in range(120)]
        out = [t if rng.random() > 1 / 30 else rng.randrange(100, 5000) for t in passage]
        items.append(([1, 2, 3, *passage, 4], out))
    return items


def test_every_output_token_is_counted_once_and_copies_are_accepted():
    items = copy_items(0)
    res = replay(items, *resolve("NGRAM:ngram_max_draft_tokens=8")[1:], CURVE)
    total = sum(len(out) - 1 for _, out in items)  # the first token comes from the prefill
    assert res["tokens_per_step"] * res["verify_steps"] == pytest.approx(total)
    assert res["tokens_per_step"] > 3 and res["modelled_speedup"] > 2


def test_deep_drafts_take_fewer_steps_on_long_copies_and_random_text_backs_off():
    items = copy_items(1)
    shallow = replay(items, *resolve("NGRAM:ngram_max_draft_tokens=8")[1:], CURVE)
    label, spec, deep_nodes = resolve("NGRAM:num_draft_tokens=8")
    assert deep_nodes == 16  # deep drafts default to twice the tree size
    deep = replay(items, spec, deep_nodes, CURVE)
    assert deep["verify_steps"] < shallow["verify_steps"]
    rng = random.Random(2)
    noise = [([rng.randrange(100, 30000) for _ in range(40)],
               [rng.randrange(100, 30000) for _ in range(100)]) for _ in range(3)]
    res = replay(noise, spec, deep_nodes, CURVE)
    # nothing matches: few drafts, so the modelled cost stays near plain decoding
    assert res["modelled_speedup"] > 0.95


@pytest.mark.parametrize("bad", ["NGRAM:nodes=8", "NGRAM:num_draft_tokens=x", "EAGLE3",
                                 "NGRAM:num_draft_tokens=8,ngram_max_draft_tokens=4"])
def test_bad_configs_are_rejected(bad):
    with pytest.raises(ValueError):
        resolve(bad)


def test_by_match_statistics_cover_the_drafting_steps_and_follow_the_sizing_rule():
    items = copy_items(3)
    label, spec, deep_nodes = resolve("NGRAM:num_draft_tokens=8")
    res = replay(items, spec, deep_nodes, CURVE)
    rows = res["by_match"]
    assert rows and all(r["match"] >= 1 for r in rows)  # no match never drafts
    assert sum(r["steps"] for r in rows) <= res["verify_steps"]
    long = [r for r in rows if r["match"] >= 4]
    # a copy: long matches get the whole deep budget and are mostly accepted
    assert long and all(r["mean_nodes"] <= deep_nodes for r in long)
    assert max(r["mean_nodes"] for r in long) == deep_nodes
    assert sum(r["p_any_accepted"] * r["steps"] for r in long) / sum(r["steps"] for r in long) > 0.8
    fixed = replay(items, *resolve("NGRAM:num_draft_tokens=8,ngram_disable_match_sizing=true")[1:],
                   CURVE)
    short = [r for r in fixed["by_match"] if r["match"] <= 2]
    assert all(r["mean_nodes"] >= 8 for r in short)  # without sizing short matches fill N


def test_copy_reach_finds_the_longest_run_in_the_context():
    from benchmark.replay_ngram import copy_reach
    from specserve.speculative.ngram_context import ContextIndex

    history = [5, 1, 2, 3, 9, 1, 2, 3, 4, 7]
    positions = ContextIndex()
    positions.catch_up(history)
    assert copy_reach(positions, history, [1, 2, 3, 4, 8], cap=10) == 4  # the second run
    assert copy_reach(positions, history, [1, 2, 3, 4, 8], cap=2) == 2  # capped
    assert copy_reach(positions, history, [6, 1], cap=10) == 0  # first token never seen
    assert copy_reach(positions, history, [4, 7], cap=10) == 2  # runs to the end of history


def test_copy_oracle_is_reported_per_step_and_per_match_length():
    items = copy_items(4)
    label, spec, deep_nodes = resolve("NGRAM")
    res = replay(items, spec, deep_nodes, CURVE)
    # random passages: the trie's drafts are chains from the prompt, so a chain placed with
    # hindsight at the best spot accepts at least as much, at the same node count
    assert res["oracle_tokens_per_step"] >= res["tokens_per_step"] > 3
    assert all(r["oracle_mean_accepted"] >= r["mean_accepted"] for r in res["by_match"])
    rng = random.Random(5)
    noise = [([rng.randrange(100, 30000) for _ in range(40)],
              [rng.randrange(100, 30000) for _ in range(60)]) for _ in range(2)]
    res = replay(noise, spec, deep_nodes, CURVE)
    assert res["oracle_tokens_per_step"] < 1.1  # nothing in the context to copy


def test_suffix_replays_with_the_curve_it_plans_with():
    """SUFFIX replays too; its trees are cut by the curve handed over (a steep curve cuts
    more nodes than a flat one), and the cpu / torch names give the stored curves."""
    items = copy_items(4)
    label, spec, deep_nodes = resolve("SUFFIX")
    assert spec.algorithm == "SUFFIX" and deep_nodes == 2 * spec.num_draft_tokens
    flat = replay(items, spec, deep_nodes, parse_curve("1:1,64:1.01"))
    steep = replay(items, spec, deep_nodes, parse_curve("1:1,2:2,64:64"))
    total = sum(len(out) - 1 for _, out in items)
    for res in (flat, steep):
        assert res["tokens_per_step"] * res["verify_steps"] == pytest.approx(total)
    assert flat["tokens_per_step"] > 2
    assert steep["verify_steps"] > flat["verify_steps"]
    rows, ratios = parse_curve("cpu")
    assert rows[0] == 1 and ratios[0] == 1.0 and len(rows) > 4


def test_suffix_calibration_table_counts_every_drafted_node():
    """SUFFIX reports its node probabilities: the replay buckets every drafted node by them,
    with the share accepted; NGRAM reports none."""
    items = copy_items(5)
    _, spec, deep = resolve("SUFFIX")
    res = replay(items, spec, deep, CURVE)
    cal = res["calibration"]
    assert cal and sum(c["nodes"] for c in cal) > 0
    for c in cal:
        assert c["bucket"] <= c["mean_estimate"] <= c["bucket"] + 0.1 + 1e-9
        assert 0.0 <= c["accepted"] <= 1.0
    # on copies with rare edits, most confident nodes are accepted
    top = [c for c in cal if c["bucket"] >= 0.7]
    assert top and sum(c["accepted"] * c["nodes"] for c in top) / sum(
        c["nodes"] for c in top) > 0.7
    _, ngram, deep = resolve("NGRAM")
    assert replay(items, ngram, deep, CURVE)["calibration"] == []
