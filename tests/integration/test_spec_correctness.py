"""Lossless speculation on the default model through `Engine` (specserve/launch/engine.py, real
processes): speculation changes no request's output — penalised requests (a prompt that repeats
itself under a repetition penalty, and frequency / presence penalties), greedy and
seeded-sampled; 50 seeded sampled prompts at batch 1 and concurrency 8 (`make test-all`; every
algorithm's seeded check in `make test` is tests/helpers/lossless.py's); streaming with a stop
string; a client that disconnects mid-speculation gets its KV freed. The CPU engine is
batch-invariant, so equality is exact; only the torch engine's near-ties are excused
(tests/helpers/near_tie.py)."""

from __future__ import annotations

import asyncio
import time

import pytest

from specserve.corpora.datasets import sample_requests
from specserve.runtime.model_loader.default_model import resolve_model_path
from specserve.runtime.model_loader.tokenizer import load_tokenizer
from tests.helpers.engine_runs import alone_then_eight, run_concurrent
from tests.helpers.near_tie import NearTieJudge

pytestmark = pytest.mark.slow

REPEATING_PROMPT = "List the numbers one two three one two three one two three"
PENALTIES = {"repetition": {"repetition_penalty": 1.5}, "frequency": {"frequency_penalty": 0.8},
             "presence": {"presence_penalty": 0.8}}
MODES = {"greedy": {"temperature": 0}, "seeded": {"temperature": 0.7, "top_p": 0.9, "seed": 7}}
SEEDED = {"temperature": 0.7, "top_p": 0.9, "max_new_tokens": 24}
ALGOS = ("NGRAM", "EAGLE3")  # EAGLE3: the head shipped for the default model


@pytest.fixture(scope="module")
def engines():
    """Engines started on first use (plain, NGRAM, EAGLE3), shut down after the module."""
    from specserve.launch import Engine

    started = {}

    def get(name: str):
        if name not in started:
            # fixed draft sizes: every step drafts and verifies (the controller would stop drafting
            # on this prompt, and these tests are about verifying penalised/seeded drafts); the
            # stored verify-cost table: the same trees on every machine, and no ~5 s of timing
            spec = {} if name == "plain" else {"speculative_algorithm": name,
                                                "speculative_disable_adaptive": True,
                                                "speculative_verify_cost": "table"}
            started[name] = Engine(log_level="warning", **spec)
        return started[name]

    yield get
    for e in started.values():
        e.shutdown()


@pytest.fixture(scope="module")
def judge():
    j = NearTieJudge()
    yield j
    print(j.report())


_plain_cache: dict[tuple, dict] = {}


def plain_out(engines, prompt: str, params: dict) -> dict:
    key = (prompt, tuple(sorted(params.items())))
    if key not in _plain_cache:
        _plain_cache[key] = engines("plain").generate(prompt, params)
    return _plain_cache[key]


# `make test` runs every penalty, mode and algorithm once; the whole grid is `make test-all`'s
PENALTY_KEPT = {("NGRAM", "greedy", "repetition"), ("NGRAM", "seeded", "frequency"),
                ("EAGLE3", "greedy", "presence"), ("EAGLE3", "seeded", "repetition")}


@pytest.mark.parametrize("algo,mode,penalty", [
    pytest.param(a, m, p, marks=() if (a, m, p) in PENALTY_KEPT else pytest.mark.full)
    for a in ALGOS for m in MODES for p in PENALTIES])
def test_repeating_prompt_with_penalties_is_identical_with_and_without_speculation(
        engines, judge, algo, mode, penalty):
    params = {"max_new_tokens": 40, "ignore_eos": True, **MODES[mode], **PENALTIES[penalty]}
    ref = plain_out(engines, REPEATING_PROMPT, params)
    ids = engines("plain").tm.tokenize(REPEATING_PROMPT)
    # twice: the second time NGRAM's trie holds the first answer, so long drafts of it are
    # verified with per-node penalties (a fresh trie has little to offer a penalised answer)
    outs = [engines(algo).generate(REPEATING_PROMPT, params) for _ in range(2)]
    for out in outs:
        ok, why = judge.check(ids, ref["output_ids"], out["output_ids"], params)
        assert ok, f"{why}\nplain: {ref['text']!r}\n{algo}: {out['text']!r}"
        if out["output_ids"] == ref["output_ids"]:
            assert out["text"] == ref["text"]
    meta = outs[1]["meta_info"]
    assert meta["spec_num_proposed_drafts"] > 0, f"penalised requests draft: {meta}"
    if algo == "NGRAM":  # its trie holds the first answer: long drafts, verified per node
        assert meta["spec_num_correct_drafts"] > 0, meta


@pytest.fixture(scope="module")
def seeded_prompts():
    """50 held-out chat prompts (25 rewrite, 25 ShareGPT), each with its own seed."""
    from specserve.runtime.model_loader.tokenizer import apply_chat_template

    tok = load_tokenizer(resolve_model_path(None))
    reqs = sample_requests("rewrite", 25, tok, seed=11, max_new_tokens=24, split="heldout")
    reqs += sample_requests("sharegpt", 25, tok, seed=11, max_new_tokens=24, split="heldout")
    prompts = [r.input_ids or apply_chat_template(tok, r.messages, True, None) for r in reqs]
    params = [{**SEEDED, "seed": 1000 + i} for i in range(len(prompts))]
    return prompts, params


@pytest.fixture(scope="module")
def seeded_reference(engines, seeded_prompts):
    prompts, params = seeded_prompts
    return [o["output_ids"] for o in run_concurrent(engines("plain"), prompts, params, 8)]


@pytest.mark.full
@pytest.mark.parametrize("algo", ALGOS)
def test_seeded_sampling_is_identical_with_and_without_speculation(
        engines, seeded_prompts, seeded_reference, algo):
    prompts, params = seeded_prompts
    engine = engines(algo)
    alone, conc8 = alone_then_eight(engine, prompts, params)  # 25 prompts alone, all 50 by 8
    judge = NearTieJudge()
    runs = alone + list(enumerate(conc8))
    assert len(runs) == 75
    for i, out in runs:
        ok, why = judge.check(prompts[i], seeded_reference[i], out["output_ids"], params[i])
        assert ok, why
    print(judge.report())
    assert len(judge.excused) <= len(prompts) // 10, judge.report()
    accepted = sum(o["meta_info"]["spec_num_correct_drafts"] for _, o in alone)
    assert accepted > 0, "seeded sampled drafts are accepted"


def test_streaming_with_speculation_cuts_at_a_stop_string(engines, judge):
    prompt = ("Repeat this sentence exactly, three times: the quick brown fox jumps over the "
              "lazy dog near the river bank.")
    params = {"max_new_tokens": 64, "temperature": 0}
    ref = plain_out(engines, prompt, params)
    text = ref["text"]
    # the first 7 characters from a third of the way in that occur nowhere earlier
    stop = next((text[k : k + 7] for k in range(len(text) // 3, len(text) - 7)
                 if text[k : k + 7].strip() and text.find(text[k : k + 7]) == k), None)
    assert stop, f"no usable stop string in {text!r}"
    chunks = list(engines("NGRAM").generate(prompt, {**params, "stop": [stop]}, stream=True))
    final = chunks[-1]
    ids = final["output_ids"]
    tok = engines("NGRAM").tm.tokenizer
    assert final["meta_info"]["finish_reason"] == {"type": "stop", "matched": stop}
    full = tok.decode(ids)
    assert stop in full and stop not in tok.decode(ids[:-1]), "cut at the completing token"
    assert final["text"] == full[: full.find(stop)]
    for c in chunks[:-1]:
        assert final["text"].startswith(c["text"]) and stop not in c["text"]
    steps = [len(b["output_ids"]) - len(a["output_ids"]) for a, b in zip(chunks, chunks[1:])]
    assert max(steps) > 1, "speculative steps stream several tokens at once"
    ok, why = judge.check(engines("plain").tm.tokenize(prompt), ref["output_ids"][: len(ids)],
                          ids)
    assert ok, why


@pytest.mark.parametrize("algo", ALGOS)
def test_client_disconnect_mid_speculation_frees_kv(engines, algo):
    engine = engines(algo)
    before = engine.server_info()

    async def read_a_little():
        stream = await engine.async_generate(
            "Write the word hello two hundred times, separated by spaces.",
            {"max_new_tokens": 500, "ignore_eos": True, "temperature": 0}, stream=True)
        got = 0
        async for chunk in stream:
            got = len(chunk["output_ids"])
            if got >= 12:
                break
        await stream.aclose()  # the client goes away: the request is aborted
        return got

    got = asyncio.run(read_a_little())
    assert 12 <= got < 500
    deadline = time.monotonic() + 60
    while (info := engine.server_info())["num_running_reqs"] and time.monotonic() < deadline:
        time.sleep(0.2)
    assert info["num_running_reqs"] == 0 and info["aborted"] == before["aborted"] + 1
    assert info["spec_verify_steps"] > before["spec_verify_steps"], "it was speculating"
    assert info["kv_used_by_requests"] == 0
    assert engine.flush_cache()
    info = engine.server_info()
    assert info["kv_free"] == info["kv_capacity"]
