"""benchmark.profile_spec_step end to end on the default model, a few short prompts."""

from __future__ import annotations

import json

from benchmark.profile_spec_step import main


def test_profile_times_decode_and_verify_forwards_and_serves_every_token(tmp_path, capsys):
    out = tmp_path / "profile.json"
    rc = main(["--dataset", "rewrite", "--split", "train", "--num-prompts", "2",
               "--max-new-tokens", "24", "--configs", "NGRAM", "--output", str(out)])
    assert rc == 0
    runs = {r["label"]: r for r in json.loads(out.read_text())["runs"]}
    base, ngram = runs["baseline"], runs["NGRAM"]
    # ignore_eos: both serve exactly the same number of tokens, the baseline at most one per
    # step (a prompt longer than the prefill budget takes steps that sample nothing)
    assert base["tokens"] == ngram["tokens"] > 0
    assert base["tokens"] <= base["steps"] <= base["tokens"] + 2 * 2
    assert ngram["steps"] < base["steps"]  # rewrite prompts copy: some drafts are accepted
    assert set(base["forwards"]) <= {"DECODE:1"} | {k for k in base["forwards"]
                                                   if k.startswith("EXTEND")}
    assert any(k.startswith("TARGET_VERIFY") for k in ngram["forwards"])
    table = capsys.readouterr().out
    assert "outside any forward" in table and "end to end" in table


def test_profile_rejects_an_unknown_config(capsys):
    assert main(["--configs", "NGRAM:no_such_key=1"]) == 2
    assert "error" in capsys.readouterr().err


def test_logprobs_flag_serves_every_configuration_again_asking_for_them(monkeypatch, tmp_path):
    """(The wiring only: each serve loads the model, and the logprob path itself is checked
    by the lossless and logprob tests.)"""
    import benchmark.profile_spec_step as pss

    calls = []

    def fake_serve(label, server_args, prompts, threads, concurrency=1, warmup=2,
                   logprobs=None, penalty=1.0):
        calls.append((label, logprobs))
        return {"label": label, "wall_s": 1.0, "tokens": 1, "steps": 1, "forward_s": 0.5,
                "draft_forward_s": 0.0, "draft_forward_ms_per_step": 0.0,
                "outside_forward_ms_per_step": 1.0, "ttft_median_ms": 1.0, "forwards": {}}

    monkeypatch.setattr(pss, "serve", fake_serve)
    assert main(["--dataset", "rewrite", "--split", "train", "--num-prompts", "1",
                 "--configs", "NGRAM", "--logprobs", "3",
                 "--output", str(tmp_path / "p.json")]) == 0
    assert calls == [("baseline", None), ("NGRAM", None), ("baseline+logprobs3", 3),
                     ("NGRAM+logprobs3", 3)]


def test_a_drafters_own_forwards_are_timed_apart_from_the_rest(tmp_path):
    """EAGLE-3's head forwards are counted as the drafter's, not as time outside any forward:
    the outside share is what remains after both the target's and the head's forwards."""
    out = tmp_path / "profile.json"
    assert main(["--dataset", "sharegpt", "--split", "train", "--num-prompts", "1",
                 "--warmup-prompts", "1", "--max-new-tokens", "16",
                 "--configs", "EAGLE3:disable_adaptive=true", "--output", str(out)]) == 0
    run = {r["label"]: r for r in json.loads(out.read_text())["runs"]}[
        "EAGLE3:disable_adaptive=true"]
    assert {"draft run_head fused", "draft run_head"} <= set(run["forwards"])
    drafted = sum(f["total_s"] for k, f in run["forwards"].items() if k.startswith("draft "))
    assert run["draft_forward_s"] == drafted > 0
    outside = run["wall_s"] - run["forward_s"] - run["draft_forward_s"]
    assert abs(run["outside_forward_ms_per_step"] - outside / run["steps"] * 1e3) < 1e-6


def test_activation_digits_serve_the_baseline_and_every_config_at_each(monkeypatch, tmp_path):
    import benchmark.profile_spec_step as pss

    calls = []

    def fake_serve(label, server_args, prompts, threads, concurrency=1, warmup=2,
                   logprobs=None, penalty=1.0):
        calls.append((label, server_args.get("activation_digits")))
        return {"label": label, "wall_s": 1.0, "tokens": 2, "steps": 1, "forward_s": 0.5,
                "draft_forward_s": 0.0, "draft_forward_ms_per_step": 0.0,
                "outside_forward_ms_per_step": 1.0, "ttft_median_ms": 1.0, "forwards": {}}

    monkeypatch.setattr(pss, "serve", fake_serve)
    assert main(["--dataset", "rewrite", "--split", "train", "--num-prompts", "1",
                 "--configs", "NGRAM", "--activation-digits", "3,1",
                 "--output", str(tmp_path / "p.json")]) == 0
    assert calls == [("baseline@3d", 3), ("NGRAM@3d", 3), ("baseline@1d", 1), ("NGRAM@1d", 1)]
