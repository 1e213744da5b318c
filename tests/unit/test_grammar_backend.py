"""The grammar layer on a tiny tokenizer: which grammar a request sets, both backends
(xgrammar, llguidance: compile errors, an empty grammar, bytes across processes, matcher
moves), the tokenizer process's compiler (cache, one compile per grammar, cached failures,
timeout, size cap) and masking a forward's logits rows."""

from __future__ import annotations

import asyncio
import json
import threading
import zlib

import pytest
import torch

from specserve.runtime.constrained import GrammarSpec, create_backend, grammar_of
from specserve.runtime.constrained.base import GrammarCompileError
from specserve.runtime.constrained.compiler import GrammarCompiler
from specserve.runtime.constrained.runner_grammars import (
    FORBIDDEN_LOGPROB,
    RunnerGrammars,
    finite_logprobs,
    mask_output,
)
from specserve.runtime.constrained.spec import MAX_GRAMMAR_BYTES
from specserve.runtime.errors import InvalidRequestError
from specserve.runtime.model_loader.tokenizer import load_tokenizer
from specserve.runtime.models.llama import ModelOutput
from specserve.runtime.sampling.logprobs import LogitStats, logprob_rows
from specserve.runtime.sampling.sampling_params import SamplingParams
from tests.helpers.tiny_models import EOS_ID, TINY_VOCAB_SIZE, write_tiny_tokenizer_files

SCHEMA = json.dumps({"type": "object", "properties": {"n": {"type": "integer"}},
                     "required": ["n"]})


@pytest.fixture(scope="module")
def tok(tmp_path_factory):
    d = tmp_path_factory.mktemp("grammar_tok")
    write_tiny_tokenizer_files(d)
    return load_tokenizer(d)


@pytest.fixture(scope="module", params=["xgrammar", "llguidance"])
def backend(request, tok):
    return create_backend(request.param, tok, TINY_VOCAB_SIZE, [EOS_ID], any_whitespace=False)


def allowed(backend, matcher) -> set[int]:
    masks = backend.allocate_masks(1)
    matcher.fill_mask(masks, 0)
    return set((~backend.forbidden(masks, TINY_VOCAB_SIZE)[0]).nonzero()[0].tolist())


def walk(backend, matcher, text: str) -> list[int]:
    """Feed `text` token by token (the tokenizer's own split) and return the ids."""
    ids = backend.tokenizer.encode(text, add_special_tokens=False)
    for t in ids:
        assert t in allowed(backend, matcher), f"{t} not allowed"
        assert matcher.accept(t)
    return ids


@pytest.mark.parametrize(("values", "field"), [
    ({"regex": "a", "json_schema": "{}"}, "regex"),
    ({"ebnf": 'root ::= "a"', "structural_tag": "{}"}, "structural_tag"),
    ({"regex": 5}, "regex"),
    ({"json_schema": "{not json"}, "json_schema"),
    ({"json_schema": "[1]"}, "json_schema"),
    ({"ebnf": " "}, "ebnf"),
    ({"regex": "a" * (MAX_GRAMMAR_BYTES + 1)}, "regex"),
])
def test_a_bad_grammar_field_is_named(values, field):
    with pytest.raises(InvalidRequestError) as info:
        grammar_of(values)
    assert info.value.field == field
    with pytest.raises(InvalidRequestError) as info:
        SamplingParams.from_dict(values)
    assert info.value.field == field


def test_sampling_params_carry_one_grammar():
    p = SamplingParams.from_dict({"regex": "[0-9]+", "temperature": 0})
    assert p.grammar == GrammarSpec("regex", "[0-9]+")
    assert SamplingParams.from_dict({}).grammar is None
    assert SamplingParams(**p.to_dict()).grammar == p.grammar  # (the wire form)
    assert grammar_of({"json_schema": "true"}) == GrammarSpec("json_schema", "true")
    assert GrammarSpec("regex", "a").key() != GrammarSpec("ebnf", "a").key()


@pytest.mark.parametrize(("spec", "messages"), [
    (GrammarSpec("json_schema", '{"type": "strin"}'), ('Unsupported type "strin"', "strin")),
    (GrammarSpec("regex", "[0-9"), ("Unclosed '['", 'invalid regex "[0-9"')),
    (GrammarSpec("ebnf", "root ::= foo"), ('Rule "foo" is not defined', "Rule 'foo' not found")),
    (GrammarSpec("structural_tag", '{"type": "structural_tag", "format": {"type": "x"}}'),
     ("", "not 'x'")),
    (GrammarSpec("regex", "[^\\s\\S]"), ("the grammar matches no output",) * 2),
])
def test_compile_errors_say_what_is_wrong(backend, spec, messages):
    with pytest.raises(GrammarCompileError) as info:
        backend.compile(spec)
    assert messages[backend.name == "llguidance"] in str(info.value)
    assert ".cc:" not in str(info.value)  # (xgrammar's source location is cut off)


def test_a_loaded_grammar_masks_as_the_compiled_one(backend):
    compiled = backend.compile(GrammarSpec("json_schema", SCHEMA))
    a, b = backend.matcher(compiled), backend.matcher(backend.load(backend.dump(compiled)))
    for text in ('{"n": ', "12", "}"):
        assert allowed(backend, a) == allowed(backend, b)
        walk(backend, a, text)
        walk(backend, b, text)
    assert allowed(backend, a) == allowed(backend, b) == {EOS_ID}  # only where it may end
    assert a.accept(EOS_ID) and a.is_terminated() and not a.accept(EOS_ID)


def test_matcher_rollback_fork_and_forced_tokens(backend):
    m = backend.matcher(backend.compile(GrammarSpec("regex", "abc(de|fg)[0-9]")))
    first = allowed(backend, m)
    forced = m.forced_tokens()
    assert forced and backend.tokenizer.decode(forced) in "abc"  # the last token held back
    assert allowed(backend, m) == first  # asking moved nothing
    fork = m.fork()
    ids = walk(backend, fork, "abcde")
    assert allowed(backend, m) == first and allowed(backend, fork) != first
    fork.rollback(len(ids))
    assert allowed(backend, fork) == first
    assert not m.accept(backend.tokenizer.encode("z", add_special_tokens=False)[0])
    assert allowed(backend, m) == first  # a refused token changes nothing


def test_forced_tokens_inside_a_multibyte_character_are_accepted_ones_not_an_error(backend):
    """A token that ends inside a character ("â" is two byte tokens here) leaves forced bytes
    that are no UTF-8 text: xgrammar's binding raises decoding them, which in the runner's
    speculative step would end the model runner and the server with it."""
    m = backend.matcher(backend.compile(GrammarSpec("regex", "JJ\u00e22")))
    ids = backend.tokenizer.encode("JJ\u00e22", add_special_tokens=False)
    assert len(ids) > len("JJ\u00e22"), "the character must span tokens"
    for t in ids:
        forced, probe = m.forced_tokens(), m.fork()
        assert all(probe.accept(f) for f in forced)
        assert m.accept(t)
    assert m.accept(EOS_ID) and m.is_terminated()


class _SlowBackend:
    """The tiny backend, its compiles held until `release` is set (counted)."""

    def __init__(self, inner) -> None:
        self.inner, self.compiles, self.release = inner, 0, threading.Event()
        self.compile_options = "slow"

    def compile(self, spec):
        self.compiles += 1
        assert self.release.wait(10)
        return self.inner.compile(spec)

    def dump(self, compiled):
        return self.inner.dump(compiled)


def test_compiler_caches_successes_and_failures_and_compiles_each_grammar_once(backend):
    slow = _SlowBackend(backend)
    compiler = GrammarCompiler(lambda: slow, timeout_s=5)
    good, bad = GrammarSpec("json_schema", SCHEMA), GrammarSpec("regex", "(")

    async def main():
        waiting = [asyncio.ensure_future(compiler.compile(good)) for _ in range(3)]
        await asyncio.sleep(0.05)
        slow.release.set()
        payloads = await asyncio.gather(*waiting)
        assert {p.key for p in payloads} == {good.key("slow")}
        again = await compiler.compile(good)
        for _ in range(2):
            with pytest.raises(InvalidRequestError, match="cannot compile") as info:
                await compiler.compile(bad)
            assert info.value.field == "regex"
        return payloads[0], again

    first, again = asyncio.run(main())
    assert again is first and slow.compiles == 2  # one per distinct grammar
    stats = compiler.info()
    assert (stats["cache_misses"], stats["cache_hits"], stats["compiles"],
            stats["compile_errors"], stats["cached_grammars"]) == (2, 4, 1, 1, 2)
    assert zlib.decompress(first.data)  # the backend's serialization, compressed
    if backend.name == "xgrammar":
        assert json.loads(zlib.decompress(first.data))
    compiler.shutdown()


def test_a_compile_past_the_timeout_is_a_400_and_stays_refused(backend):
    slow = _SlowBackend(backend)
    compiler = GrammarCompiler(lambda: slow, timeout_s=0.05)
    spec = GrammarSpec("ebnf", 'root ::= "x"')

    async def main():
        for _ in range(2):
            with pytest.raises(InvalidRequestError, match="did not compile within") as info:
                await compiler.compile(spec)
            assert info.value.field == "ebnf"

    asyncio.run(main())
    slow.release.set()
    assert slow.compiles == 1 and compiler.stats["compile_timeouts"] == 1
    compiler.shutdown()


def test_a_grammar_that_compiles_too_large_is_refused(backend, monkeypatch):
    import specserve.runtime.constrained.compiler as mod

    monkeypatch.setattr(mod, "MAX_COMPILED_BYTES", 100)
    compiler = GrammarCompiler(lambda: backend)
    with pytest.raises(InvalidRequestError, match="compiles to") as info:
        asyncio.run(compiler.compile(GrammarSpec("json_schema", SCHEMA)))
    assert info.value.field == "json_schema"
    compiler.shutdown()


def test_mask_output_masks_only_its_rows_and_their_argmax_and_logprobs(backend):
    runner_side = RunnerGrammars(lambda: backend)
    payload = asyncio.run(GrammarCompiler(lambda: backend).compile(GrammarSpec("regex",
                                                                               "[0-9]+")))
    m = runner_side.matcher(runner_side.load(payload))
    assert len(runner_side.live) == 1
    gen = torch.Generator().manual_seed(0)
    logits = torch.randn(3, TINY_VOCAB_SIZE, generator=gen)
    raw = logits.clone()
    lse = torch.logsumexp(logits, -1)
    top_vals, top_ids = logits.topk(4)
    out = ModelOutput(logits, {}, None, logits.argmax(-1), LogitStats(lse, top_vals, top_ids))
    masked = mask_output(out, [1], [m])
    digits = allowed(backend, m)
    assert torch.equal(masked.logits[[0, 2]], raw[[0, 2]])
    assert set(torch.nonzero(torch.isfinite(masked.logits[1])).flatten().tolist()) == digits
    assert masked.argmax[1].item() == max(digits, key=lambda t: raw[1, t].item())
    assert masked.argmax[[0, 2]].tolist() == raw[[0, 2]].argmax(-1).tolist()
    assert torch.isnan(masked.logit_stats.lse[1]) and torch.equal(masked.logit_stats.lse[[0, 2]],
                                                                  lse[[0, 2]])
    # logprobs of the masked row: of the grammar's distribution (they sum to 1 over its tokens)
    t = masked.argmax[1].item()
    lp = logprob_rows(masked.logits, [0, t, 0], 3, stats=masked.logit_stats)
    probs = torch.log_softmax(raw[1, sorted(digits)], -1)
    assert lp["lp"][1] == pytest.approx(probs.max().item(), abs=1e-5)
    assert lp["lp"][0] == pytest.approx((raw[0, 0] - lse[0]).item(), abs=1e-6)
    assert m.accept(t) and not m.is_terminated()
    del m
    assert len(runner_side.live) == 0  # dropping the state drops the matcher
    runner_side.shutdown()


def test_forbidden_alternatives_get_vllms_finite_logprob():
    payload = {"lp": [-0.5], "top_lp": [[-0.5, float("-inf")]], "top_ids": [[3, 4]]}
    assert finite_logprobs(payload)["top_lp"] == [[-0.5, FORBIDDEN_LOGPROB]]


def test_llguidance_schemas_follow_xgrammars_strict_mode():
    from specserve.runtime.constrained.llguidance_backend import strict_schema

    schema = {"type": "object", "properties": {"a": {"type": "object", "properties": {}},
                                               "b": {"type": "object"}},
              "$defs": {"t": {"type": "array", "prefixItems": [{"type": "integer"}]}}}
    before = json.dumps(schema)
    out = strict_schema(schema)
    assert json.dumps(schema) == before  # (a copy)
    assert out["additionalProperties"] is False
    assert out["properties"]["a"]["additionalProperties"] is False
    assert "additionalProperties" not in out["properties"]["b"]  # any object, as xgrammar
    assert out["$defs"]["t"]["items"] is False
    assert strict_schema({"properties": {}, "additionalProperties": True}) == {
        "properties": {}, "additionalProperties": True}
