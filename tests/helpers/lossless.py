"""Greedy speculation equals plain greedy decoding on the default model, for one algorithm: the
check that tests/integration/test_spec_lossless*.py run for every algorithm.

The algorithms are split over two test files because `make test` hands whole files to its two
pytest-xdist workers (`--dist loadfile`): in one file these checks were ~21 minutes of one
worker's time on an AVX2 machine; in two, each worker takes about half (the suite's time on two
cores hardly moved: docs/benchmarks.md, "Test suite time"). The plain outputs they compare
against are computed once per run (`shared_plain_reference`) and shared by both workers.
"""

from __future__ import annotations

import fcntl
import json
from pathlib import Path

from corpora.datasets import sample_requests
from runtime.model_loader.default_model import resolve_model_path
from runtime.model_loader.tokenizer import load_tokenizer
from tests.helpers.engine_runs import alone_then_eight, run_concurrent, second_while_first_runs
from tests.helpers.near_tie import NearTieJudge

# (server-wide accept length above, some request's accept length above): chain drafters of
# this 135M target accept ~0.26-0.30 first drafts (assets/*/README.md); MEDUSA: 1.38 measured
ACCEPT_FLOORS = {"NGRAM": (1.2, 2.0), "EAGLE3": (1.5, 2.0), "STANDALONE": (1.15, 1.5),
                 "EARLY_EXIT": (1.15, 1.5), "SUFFIX": (1.6, 2.0), "LOOKAHEAD": (1.3, 1.5),
                 "MEDUSA": (1.2, 1.5)}
# the two files' shares, balanced by their time (the three that run a draft network of their
# own are the slowest): together every algorithm above, once
GROUPS = (("NGRAM", "SUFFIX", "LOOKAHEAD", "MEDUSA"), ("EAGLE3", "STANDALONE", "EARLY_EXIT"))
assert sorted(sum(GROUPS, ())) == sorted(ACCEPT_FLOORS)
GREEDY = {"max_new_tokens": 48, "temperature": 0}
# every third prompt also asks for logprobs (with two alternatives per token): a request's
# logprobs come from the verify forward's rows, which must be plain decoding's bit for bit
LOGPROBS = {"return_logprob": True, "top_logprobs_num": 2}


def logprob_args(n: int) -> list[dict]:
    return [LOGPROBS if i % 3 == 0 else {} for i in range(n)]


def logprobs_of(out: dict) -> list | None:
    """A request's token logprobs and top alternatives, as JSON gives them back (lists, floats
    exactly: the reference travels between workers as JSON)."""
    meta = out["meta_info"]
    if "output_token_logprobs" not in meta:
        return None
    return json.loads(json.dumps([meta["output_token_logprobs"], meta["output_top_logprobs"]]))


def plain_reference() -> tuple[list[list[int]], list[list[int]], list]:
    """52 held-out prompts (26 rewrite, 26 ShareGPT) and plain greedy decoding's outputs and
    logprobs."""
    from launch import Engine

    tok = load_tokenizer(resolve_model_path(None))
    reqs = sample_requests("rewrite", 26, tok, seed=7, max_new_tokens=48, split="heldout")
    reqs += sample_requests("sharegpt", 26, tok, seed=7, max_new_tokens=48, split="heldout")

    def ids_of(engine, r):
        if r.input_ids:
            return r.input_ids
        return engine.tm.chat_ids(r.messages) if r.messages else engine.tm.tokenize(r.prompt)

    with Engine(log_level="warning") as plain:
        prompts = [ids_of(plain, r) for r in reqs]
        # eight at a time (half the time of one by one): the CPU engine is batch-invariant, so
        # each output is the one-by-one output (tests/integration/test_server.py checks 32
        # streams against sequential runs); on the torch engine the judge allows near-ties
        outs = run_concurrent(plain, prompts, [GREEDY] * len(prompts), 8,
                              logprob_args(len(prompts)))
    return prompts, [o["output_ids"] for o in outs], [logprobs_of(o) for o in outs]


def shared_plain_reference(run_dir: Path):
    """`plain_reference()`, computed by the first worker of this pytest run that asks (under a
    lock) and read back from `run_dir` (the run's base temp directory, common to its xdist
    workers) by the others."""
    path = run_dir / "plain_reference.json"
    with open(run_dir / "plain_reference.lock", "w") as lock:
        fcntl.flock(lock, fcntl.LOCK_EX)
        if not path.exists():
            tmp = path.with_suffix(".tmp")
            tmp.write_text(json.dumps(plain_reference()))
            tmp.replace(path)
        prompts, ref, ref_logprobs = json.loads(path.read_text())
    return prompts, ref, ref_logprobs


def check_greedy_spec_equals_plain(algo: str, reference) -> None:
    """The algorithm's outputs on the reference prompts, 26 of them alone and all 52 eight at a
    time, plus two prompts taken from the prefix cache while their first request still decodes:
    every one the plain output (and its logprobs, where asked) exactly, or a near-tie the judge
    excuses on the torch engine. With no draft path, EAGLE3 / STANDALONE / EARLY_EXIT run the
    head, draft model and exit adapter shipped in assets/ for the default model."""
    from launch import Engine

    prompts, ref, ref_logprobs = reference
    params = GREEDY
    # fixed tree sizes: every step drafts and verifies (the load-aware budget would draft little
    # at concurrency 8 on the CPU engine, leaving the batched verify path untested here); the
    # stored verify-cost table, so SUFFIX cuts the same trees on every machine (and the start
    # skips ~5 s of timing; test_verify_cost.py and the server tests time the curve)
    with Engine(log_level="warning", speculative_algorithm=algo,
                speculative_disable_adaptive=True, speculative_verify_cost="table") as spec:
        # 26 prompts alone (13 rewrites, 13 ShareGPT), all 52 eight at a time
        alone, conc8 = alone_then_eight(spec, prompts, [params] * len(prompts),
                                        logprob_args(len(prompts)))
        info = spec.server_info()
        # a prompt cached while its request still decodes (and drafts: the drafters' own KV
        # of those slots may lag), taken by a second request with it
        pairs = second_while_first_runs(spec, prompts[:2], params)
    batch1 = [o for _, o in alone]
    server_floor, request_floor = ACCEPT_FLOORS[algo]
    print(algo, "server accept length", info["avg_spec_accept_length"], "best request",
          max(o["meta_info"]["spec_accept_length"] for o in batch1))
    assert info["avg_spec_accept_length"] > server_floor
    assert any(o["meta_info"]["spec_accept_length"] > request_floor for o in batch1)
    judge = NearTieJudge()
    runs = alone + list(enumerate(conc8))
    assert len(runs) == 78
    for i, out in runs:
        ok, why = judge.check(prompts[i], ref[i], out["output_ids"])
        assert ok, why
        if out["output_ids"] == ref[i]:  # the same tokens: the same logprobs, exactly
            assert logprobs_of(out) == ref_logprobs[i], f"prompt {i}: logprobs differ"
    assert sum(logprobs_of(out) is not None for _, out in runs) == 18 + 9
    for i, (first, second) in enumerate(pairs):
        assert second["meta_info"]["cached_tokens"] == len(prompts[i]) - 1
        for out in (first, second):
            ok, why = judge.check(prompts[i], ref[i], out["output_ids"])
            assert ok, why
    print(judge.report())
    assert len(judge.excused) <= len(prompts) // 10, judge.report()
