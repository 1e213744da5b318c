"""benchmark.profile_spec_step end to end on the default model, a few short prompts."""

from __future__ import annotations

import json

from benchmark.profile_spec_step import main


def test_profile_times_decode_and_verify_forwards_and_serves_every_token(tmp_path, capsys):
    out = tmp_path / "profile.json"
    rc = main(["--dataset", "rewrite", "--split", "train", "--num-prompts", "2",
               "--max-new-tokens", "24", "--configs", "NGRAM", "--logprobs", "2",
               "--output", str(out)])
    assert rc == 0
    runs = {r["label"]: r for r in json.loads(out.read_text())["runs"]}
    base, ngram = runs["baseline"], runs["NGRAM"]
    # ignore_eos: both serve exactly the same number of tokens, the baseline one per step
    assert base["tokens"] == ngram["tokens"] == base["steps"] > 0
    assert ngram["steps"] < base["steps"]  # rewrite prompts copy: some drafts are accepted
    assert set(base["forwards"]) <= {"DECODE:1"} | {k for k in base["forwards"]
                                                   if k.startswith("EXTEND")}
    assert any(k.startswith("TARGET_VERIFY") for k in ngram["forwards"])
    # --logprobs: every configuration again, the same tokens served
    assert runs["baseline+logprobs2"]["tokens"] == runs["NGRAM+logprobs2"]["tokens"] \
        == base["tokens"]
    table = capsys.readouterr().out
    assert "outside forwards" in table and "end to end" in table


def test_profile_rejects_an_unknown_config(capsys):
    assert main(["--configs", "NGRAM:no_such_key=1"]) == 2
    assert "error" in capsys.readouterr().err
