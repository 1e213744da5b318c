"""Constrained decoding through the scheduler and the runner worker, in process on a tiny model:
greedy output equals an independent masked-argmax reference in mixed batches, chunked prefill
and retraction; sampled output is valid and seeded output reproducible; logprobs are the
masked distribution's; abort and finish release KV and matchers; with NGRAM speculation, and
with the grammar-forced tokens alone drafted (JUMP_FORWARD), the output is plain constrained
decoding's, and constrained requests' drafts are accepted."""

from __future__ import annotations

import asyncio
import json
import math
import re

import jsonschema
import pytest
import torch

from specserve.runtime.constrained import GrammarSpec, create_backend
from specserve.runtime.constrained.compiler import GrammarCompiler
from specserve.runtime.constrained.runner_grammars import RunnerGrammars
from specserve.runtime.messages import AbortReq, GenerateReq
from specserve.runtime.model_loader.tokenizer import load_tokenizer
from specserve.runtime.model_runner.model_runner import ModelRunner, RunnerConfig
from specserve.runtime.model_runner.runner_process import RunnerWorker
from specserve.runtime.sampling.logprobs import LogprobOptions
from specserve.runtime.sampling.sampling_params import SamplingParams
from specserve.speculative.base import SpecConfig, create_drafter
from specserve.speculative.planning import TreeSizes
from specserve.speculative.worker import SpeculativeWorker
from tests.helpers.grammar_reference import (
    LLGuidanceReference,
    compile_spec,
    masked_greedy,
    xgrammar_compiler,
)
from tests.helpers.tiny_models import EOS_ID, TINY_VOCAB_SIZE
from tests.unit.test_scheduler import Harness, prompts, reference, tiny  # noqa: F401

SCHEMA = {"type": "object", "properties": {
    "kind": {"enum": ["fox", "dog", "cat"]}, "ok": {"type": "boolean"},
    "n": {"type": "integer", "minimum": 0, "maximum": 99}}, "required": ["kind", "ok", "n"]}
REGEX = "[a-z]{2,6}( [a-z]{2,6}){0,3}"
EBNF = 'root ::= ("yes" | "no") " " [0-9] [0-9]?'
GRAMMARS = [("regex", REGEX), ("json_schema", json.dumps(SCHEMA)), ("ebnf", EBNF)]
NEW = 40


@pytest.fixture(scope="module", params=["xgrammar", "llguidance"])
def env(request, tiny):  # noqa: F811
    """(backend factory, compiler, a second runner for references, the library's own compiler)
    for each grammar backend"""
    tok = load_tokenizer(tiny[0])
    backend = create_backend(request.param, tok, TINY_VOCAB_SIZE, [EOS_ID], any_whitespace=False)
    ref_runner = ModelRunner(RunnerConfig(str(tiny[0]), "cpu", "float32", max_total_tokens=512))
    ref = (xgrammar_compiler if request.param == "xgrammar" else LLGuidanceReference)(
        tok, TINY_VOCAB_SIZE, [EOS_ID])
    return (lambda: backend), GrammarCompiler(lambda: backend), ref_runner, ref, tok


def harness(tiny, env, spec=None, **cfg):  # noqa: F811
    h = Harness(tiny, **cfg)
    h.worker = RunnerWorker(tiny[1], spec, RunnerGrammars(env[0]))
    h.sched.run_batch = h.worker.run
    return h


def submit(h, env, rid, ids, kind=None, source=None, **params):
    p = SamplingParams(**{"temperature": 0.0, "max_new_tokens": NEW,
                          **({kind: source} if kind else {}), **params})
    payload = asyncio.run(env[1].compile(p.grammar)) if kind else None
    h.sched.handle(GenerateReq(rid=rid, input_ids=ids, sampling_params=p,
                               grammar=payload))


def expected(env, kind, source, ps, new=NEW):
    compiled = compile_spec(env[3], kind, source, any_whitespace=False)
    return [masked_greedy(env[2], compiled, p, new) for p in ps]


def check_valid(tok, kind, source, ids):
    """The output (its EOS cut off) matches the grammar, when it finished it."""
    assert ids[-1] == EOS_ID, "the grammar ended the request"
    text = tok.decode(ids[:-1])
    if kind == "regex":
        assert re.fullmatch(source, text), text
    elif kind == "json_schema":
        jsonschema.validate(json.loads(text), json.loads(source))
    else:
        assert re.fullmatch(r"(yes|no) [0-9][0-9]?", text), text


def test_greedy_constrained_equals_masked_reference_in_mixed_chunked_batches(tiny, env):  # noqa: F811
    ps = prompts(9, seed=41)
    h = harness(tiny, env, chunked_prefill_size=16, max_running_requests=6)
    want = {}
    for i, p in enumerate(ps):
        kind, source = GRAMMARS[i % 3]
        submit(h, env, f"g{i}", p, kind, source)
        want[f"g{i}"] = expected(env, kind, source, [p])[0]
        submit(h, env, f"u{i}", p, ignore_eos=True)  # unconstrained neighbours
    plain = reference(tiny, ps, ignore_eos=True, max_new_tokens=NEW)
    h.run()
    for i in range(len(ps)):
        kind, source = GRAMMARS[i % 3]
        assert h.outputs[f"g{i}"] == want[f"g{i}"], f"g{i} ({kind})"
        check_valid(env[4], kind, source, h.outputs[f"g{i}"])
        assert h.finish[f"g{i}"] == {"type": "stop", "matched": EOS_ID}
        assert h.outputs[f"u{i}"] == plain[i]
    assert not h.worker.states and len(h.worker.grammars.live) == 0
    h.sched.check_no_leak()


def test_a_complete_grammar_stops_the_request_even_with_ignore_eos(tiny, env):  # noqa: F811
    h = harness(tiny, env)
    submit(h, env, "a", prompts(1, seed=5)[0], "ebnf", EBNF, ignore_eos=True)
    h.run()
    assert h.outputs["a"][-1] == EOS_ID and h.finish["a"] == {"type": "stop", "matched": EOS_ID}
    h.sched.check_no_leak()


def test_sampled_constrained_output_is_valid_and_seeded_output_reproducible(tiny, env):  # noqa: F811
    ps = prompts(6, seed=42)
    runs = []
    for concurrency in (1, 6):
        h = harness(tiny, env, max_running_requests=concurrency)
        for i, p in enumerate(ps):
            kind, source = GRAMMARS[i % 3]
            submit(h, env, f"s{i}", p, kind, source, temperature=0.9, top_p=0.95, seed=100 + i)
            submit(h, env, f"x{i}", p, kind, source, temperature=1.0)  # unseeded
        h.run()
        for i in range(len(ps)):
            for rid in (f"s{i}", f"x{i}"):
                if h.finish[rid]["type"] == "stop":
                    check_valid(env[4], *GRAMMARS[i % 3], h.outputs[rid])
        runs.append([h.outputs[f"s{i}"] for i in range(len(ps))])
        h.sched.check_no_leak()
    assert runs[0] == runs[1]


def test_logprobs_are_the_masked_distributions_and_penalties_apply(tiny, env):  # noqa: F811
    from specserve.runtime.messages import TokenOut

    p = prompts(1, seed=43)[0]
    h = harness(tiny, env)
    got = []
    inner = h.emit
    h.sched.emit = lambda msg: (inner(msg), isinstance(msg, TokenOut) and got.extend(
        lp for lp in (msg.logprobs or []) if lp))
    params = SamplingParams(temperature=0.0, max_new_tokens=NEW, repetition_penalty=1.3,
                            regex=REGEX)
    payload = asyncio.run(env[1].compile(params.grammar))
    h.sched.handle(GenerateReq(rid="r", input_ids=p, sampling_params=params,
                               grammar=payload, logprobs=LogprobOptions(top=3)))
    h.run()
    out = h.outputs["r"]
    check_valid(env[4], "regex", REGEX, out)
    lp = [v for part in got for v in part["lp"]]
    tops = [t for part in got for t in part["top_lp"]]
    assert len(lp) == len(out)
    # teacher-forced: the masked raw logits at each position (penalties do not enter logprobs)
    matcher = env[0]().matcher(env[0]().compile(GrammarSpec("regex", REGEX)))
    for k, token in enumerate(out):
        logits = env[2].forward(_full(p + out[:k])).logits[-1:].clone()
        masks = matcher.backend.allocate_masks(1)
        matcher.fill_mask(masks, 0)
        forbidden = matcher.backend.forbidden(masks, TINY_VOCAB_SIZE)[0]
        logits[0].masked_fill_(torch.from_numpy(forbidden), -math.inf)
        want = torch.log_softmax(logits[0], -1)
        assert lp[k] == pytest.approx(want[token].item(), abs=1e-5)
        assert all(v == -9999.0 or math.isfinite(v) for v in tops[k])
        assert matcher.accept(token)
    h.sched.check_no_leak()


def _full(ids):
    from specserve.runtime.forward_batch import ForwardBatch, ForwardMode

    return ForwardBatch.build(ForwardMode.EXTEND, [ids], [torch.arange(1, len(ids) + 1)], [0])


def test_retracted_constrained_requests_resume_with_their_matchers(tiny, env):  # noqa: F811
    ps = prompts(6, seed=44)
    h = harness(tiny, env, capacity=150, chunked_prefill_size=64, decode_reserve_ratio=0.0)
    want = {}
    for i, p in enumerate(ps):
        kind, source = GRAMMARS[i % 3]
        submit(h, env, f"r{i}", p, kind, source)
        want[f"r{i}"] = expected(env, kind, source, [p])[0]
    h.run()
    assert h.sched.totals["retracted"] > 0, "capacity was meant to force retractions"
    assert {r: h.outputs[r] for r in want} == want
    h.sched.check_no_leak()
    assert not h.worker.states and len(h.worker.grammars.live) == 0


def test_abort_mid_grammar_frees_kv_and_the_matcher(tiny, env):  # noqa: F811
    h = harness(tiny, env)
    ps = prompts(3, seed=45)
    for i, p in enumerate(ps):
        submit(h, env, f"a{i}", p, *GRAMMARS[1], max_new_tokens=NEW)
    for _ in range(4):
        h.sched.step()
    assert len(h.worker.grammars.live) == 3
    for i in range(3):
        h.sched.handle(AbortReq(rid=f"a{i}"))
    h.run()
    assert all(h.finish[f"a{i}"]["type"] == "abort" for i in range(3))
    assert not h.worker.states and len(h.worker.grammars.live) == 0
    h.sched.check_no_leak()


@pytest.mark.parametrize("algo", ["NGRAM", "SUFFIX"])
def test_aborts_mid_speculation_leave_no_runner_state_in_the_servers_counts(tiny, env,  # noqa: F811
                                                                          algo):
    """What /server_info reports the runner holds (records, grammar matchers, drafter state)
    is there while constrained requests speculate, and all 0 once a third were aborted and
    the rest finished."""
    cfg = SpecConfig(algo, 8)
    spec = SpeculativeWorker(cfg, create_drafter(cfg, tiny[1]), tiny[1])
    h = harness(tiny, env, spec, num_draft_tokens=8, max_running_requests=6)
    for i, p in enumerate(prompts(6, seed=48)):
        submit(h, env, f"c{i}", p, *GRAMMARS[i % 3], max_new_tokens=NEW)
    for _ in range(3):
        h.sched.step()
    held, live = h.sched.info(), len(h.sched.running) + len(h.sched.released)
    assert live >= 4 and held["runner_requests"] == live  # (released: on the next batch)
    assert held["grammar_matchers"] == held["drafter_requests"] == live
    aborted = [r.rid for r in h.sched.running[:2]]
    for rid in aborted:
        h.sched.handle(AbortReq(rid=rid))
    h.run()
    assert [h.finish[rid]["type"] for rid in aborted] == ["abort", "abort"]
    info = h.sched.info()
    assert (info["runner_requests"], info["grammar_matchers"], info["drafter_requests"]) == \
        (0, 0, 0)
    assert info["kv_used_by_requests"] == 0
    h.sched.check_no_leak()


def test_samples_of_one_prompt_each_follow_their_own_matcher(tiny, env):  # noqa: F811
    p = prompts(1, seed=46)[0]
    alone = []
    for j in range(4):
        h = harness(tiny, env)
        submit(h, env, "s", p, *GRAMMARS[1], temperature=0.8, seed=7 + j)
        h.run()
        alone.append(h.outputs["s"])
    h = harness(tiny, env)
    for j in range(4):  # one payload, four requests in one batch
        submit(h, env, f"s{j}", p, *GRAMMARS[1], temperature=0.8, seed=7 + j)
    h.run()
    assert [h.outputs[f"s{j}"] for j in range(4)] == alone
    assert len(set(map(tuple, alone))) > 1


@pytest.mark.parametrize("algo", ["NGRAM", "JUMP_FORWARD"])
def test_speculation_gives_plain_constrained_output(tiny, env, algo):  # noqa: F811
    """Constrained requests (every grammar kind, greedy and seeded) beside unconstrained ones
    that draft: every output is plain decoding's, and the constrained requests' drafts (the
    grammar-forced tokens at least) are accepted."""
    from tests.integration.test_spec_lossless import copy_heavy_prompts

    ps = copy_heavy_prompts(12, seed=47)
    runs = []
    for speculative in (False, True):
        spec = None
        if speculative:
            cfg = SpecConfig(algo, 8 if algo == "NGRAM" else 1)
            spec = SpeculativeWorker(cfg, create_drafter(cfg, tiny[1]), tiny[1])
        sizes = TreeSizes(1, 1) if speculative and algo == "JUMP_FORWARD" else None
        h = harness(tiny, env, spec, num_draft_tokens=8 if speculative else 1,
                    max_running_requests=6, tree_sizes=sizes)
        for i, p in enumerate(ps):
            if i % 2:
                submit(h, env, f"r{i}", p, *GRAMMARS[i % 3], temperature=0.7 if i % 4 == 1
                       else 0.0, seed=i)
            else:
                submit(h, env, f"r{i}", p, ignore_eos=True, max_new_tokens=24)
        h.run()
        runs.append(dict(h.outputs))
        if speculative:
            constrained = [h.meta[f"r{i}"] for i in range(1, len(ps), 2)]
            assert sum(m.get("spec_num_correct_drafts", 0) for m in constrained) > 0
        h.sched.check_no_leak()
        assert len(h.worker.grammars.live) == 0
    assert runs[0] == runs[1]


def test_a_grammar_that_cannot_load_ends_its_request_only(tiny, env):  # noqa: F811
    from specserve.runtime.messages import GrammarPayload

    h = harness(tiny, env)
    p = SamplingParams(temperature=0.0, max_new_tokens=8, regex="[a-z]+")
    h.sched.handle(GenerateReq(rid="bad", input_ids=[5, 6, 7], sampling_params=p,
                               grammar=GrammarPayload(key="k", kind="regex", data=b"{")))
    submit(h, env, "good", [5, 6, 7], *GRAMMARS[2])
    h.run()
    assert h.finish["bad"]["type"] == "abort" and "grammar" in h.finish["bad"]["message"]
    assert h.finish["good"]["type"] == "stop"
    assert not h.worker.states
    h.sched.check_no_leak()
