"""Property tests of the request parsers (hypothesis, seeded): arbitrary input gives a result or
an `InvalidRequestError` (the server's 400) naming a path into the request, never another
exception. Covered: whole bodies, `tool_choice` and `tools`, `stop` and `stop_token_ids`,
`logit_bias`, the grammar fields (compiled by the real grammar backend), and the tool calls read
out of a model's output."""

from __future__ import annotations

import asyncio
import json

import pytest
from hypothesis import HealthCheck, find, given, settings
from hypothesis import strategies as st

from specserve.runtime.constrained import create_backend
from specserve.runtime.constrained.compiler import GrammarCompiler
from specserve.runtime.entrypoints.protocol import parse_model
from specserve.runtime.entrypoints.request_bodies import (
    ChatCompletionRequest,
    CompletionRequest,
    GenerateRequest,
)
from specserve.runtime.errors import InvalidRequestError
from specserve.runtime.model_loader.tokenizer import load_tokenizer
from specserve.runtime.sampling.sampling_params import SamplingParams
from specserve.runtime.tool_calls.formats import HermesFormat, SmolLM2Format
from specserve.runtime.tool_calls.request import parse_tool_request
from specserve.runtime.tool_calls.stream import ToolCallReader, read_all
from tests.helpers.tiny_models import EOS_ID, TINY_VOCAB_SIZE, write_tiny_tokenizer_files

SEEDED = settings(max_examples=150, deadline=None, derandomize=True, database=None,
                  suppress_health_check=[HealthCheck.too_slow])
MESSAGES = [{"role": "user", "content": "hi"}]
WEATHER = {"type": "function", "function": {"name": "get_weather", "parameters": {
    "type": "object", "properties": {"city": {"type": "string"}}}}}
# JSON values of every kind; keys without "." so an error's dotted path splits back into them
KEYS = st.text(st.characters(blacklist_characters="."), max_size=8)
SCALARS = st.none() | st.booleans() | st.integers(-2**70, 2**70) | \
    st.floats(allow_nan=False, allow_infinity=False) | st.text(max_size=12)
JSON = st.recursive(SCALARS, lambda inner: st.lists(inner, max_size=4)
                    | st.dictionaries(KEYS, inner, max_size=4), max_leaves=10)


def resolves(data: dict, field: str) -> bool:
    """Whether an error's dotted path leads into `data` (its last part may be a missing key)."""
    if field == "body":
        return True
    node, parts = data, field.split(".")
    for i, part in enumerate(parts):
        if isinstance(node, dict) and part in node:
            node = node[part]
        elif isinstance(node, list) and part.isdigit() and int(part) < len(node):
            node = node[int(part)]
        elif i < len(parts) - 1 or not isinstance(node, dict):
            return False
    return True


def parsed_or_400(cls, body: dict):
    """The typed body, or None after checking the 400 names a path into `body`."""
    try:
        return parse_model(cls, body)
    except InvalidRequestError as exc:
        assert resolves(body, exc.field), (exc.field, body)
        return None


def bodies(base: dict, cls) -> st.SearchStrategy[dict]:
    """`base` with fields of `cls` (and unknown ones) set to arbitrary JSON."""
    names = st.sampled_from(sorted(cls.model_fields)) | KEYS
    return st.dictionaries(names, JSON, max_size=4).map(lambda extra: {**base, **extra})


@pytest.mark.parametrize(("cls", "base"), [
    (GenerateRequest, {"text": "hi"}), (CompletionRequest, {"prompt": "hi"}),
    (ChatCompletionRequest, {"messages": MESSAGES})])
def test_any_body_is_typed_or_a_400_naming_a_path_in_it(cls, base):
    @SEEDED
    @given(bodies(base, cls))
    def check(body):
        parsed_or_400(cls, body)

    check()


TOOL_CHOICES = st.sampled_from(["none", "auto", "required"]) | JSON | st.builds(
    lambda name, kind: {"type": kind, "function": {"name": name}},
    st.sampled_from(["get_weather", "nope"]) | JSON, st.sampled_from(["function", "tool"]))
TOOLS = st.lists(st.just(WEATHER), max_size=2) | st.lists(st.just(WEATHER) | JSON, max_size=3) \
    | JSON


@SEEDED
@given(TOOLS, TOOL_CHOICES, st.sampled_from([None, True, False]) | JSON)
def test_tool_choice_forms_give_a_tool_request_or_a_400(tools, choice, parallel):
    body = {"messages": MESSAGES, "tools": tools, "tool_choice": choice,
            "parallel_tool_calls": parallel}
    typed = parsed_or_400(ChatCompletionRequest, body)
    if typed is None:
        return
    try:
        req = parse_tool_request(typed.tools_json(), typed.tool_choice_json(), parallel)
    except InvalidRequestError as exc:
        assert exc.field.split(".")[0] in ("tools", "tool_choice")
        return
    assert req.choice in ("none", "auto", "required", "function")
    assert req.function is None or req.function in req.names


def test_the_tool_choice_forms_reach_a_name_that_is_no_string():
    """Negative control: the forms above include a named choice whose name is no string (a
    parse that hashes it raises TypeError, a 500); the types answer it with a 400."""
    found = find(TOOL_CHOICES, lambda c: isinstance(c, dict) and c.get("type") == "function"
                 and isinstance(c["function"]["name"], (dict, list)),
                 settings=settings(database=None, derandomize=True))
    with pytest.raises(InvalidRequestError) as info:
        parse_model(ChatCompletionRequest, {"messages": MESSAGES, "tools": [WEATHER],
                                            "tool_choice": found})
    assert info.value.field == "tool_choice.function.name"


STOPS = st.text(max_size=6) | st.lists(st.text(max_size=4), max_size=20) | JSON
TOKEN_IDS = st.lists(st.integers(-5, 400) | st.floats(-5, 400) | JSON, max_size=5) | JSON


@SEEDED
@given(STOPS, TOKEN_IDS, st.booleans())
def test_stop_and_stop_token_ids_give_sampling_params_or_a_400(stop, ids, native):
    if native:
        body = {"text": "hi", "sampling_params": {"stop": stop, "stop_token_ids": ids}}
        typed = parsed_or_400(GenerateRequest, body)
        given_ = None if typed is None else typed.sampling_params.given()
    else:
        typed = parsed_or_400(CompletionRequest, {"prompt": "hi", "stop": stop,
                                                  "stop_token_ids": ids})
        given_ = None if typed is None else typed.base_sampling()
    if given_ is None:
        return
    try:
        params = SamplingParams.from_dict(given_, TINY_VOCAB_SIZE)
    except InvalidRequestError as exc:
        assert exc.field == "stop_token_ids"  # the vocabulary is the server's, not the type's
        return
    assert all(s for s in params.stop) and all(0 <= t < TINY_VOCAB_SIZE
                                               for t in params.stop_token_ids)


@SEEDED
@given(JSON | st.dictionaries(KEYS, JSON, max_size=3))
def test_logit_bias_is_served_empty_and_refused_otherwise_with_a_400(bias):
    typed = parsed_or_400(ChatCompletionRequest, {"messages": MESSAGES, "logit_bias": bias})
    assert (typed is not None) == (bias in (None, {}))


@pytest.fixture(scope="module")
def grammars(tmp_path_factory):
    d = tmp_path_factory.mktemp("tok")
    write_tiny_tokenizer_files(d)
    tok = load_tokenizer(d)
    compiler = GrammarCompiler(lambda: create_backend("xgrammar", tok, TINY_VOCAB_SIZE,
                                                      [EOS_ID], any_whitespace=False),
                               timeout_s=5.0)
    yield compiler
    compiler.shutdown()


GRAMMAR_TEXT = st.text(max_size=24) | st.sampled_from([
    '{"type": "object"}', '{"type": "strin"}', "true", "[a-z]+", "(", "[^\\s\\S]",
    'root ::= "yes" | "no"', "root ::= x", '{"type": "structural_tag"}']) | \
    JSON.map(json.dumps)


GRAMMAR_FIELDS = st.sampled_from(["json_schema", "regex", "ebnf", "structural_tag"])


@settings(SEEDED, max_examples=80)
@given(st.dictionaries(GRAMMAR_FIELDS, GRAMMAR_TEXT, min_size=1, max_size=1)
       | st.dictionaries(GRAMMAR_FIELDS, GRAMMAR_TEXT | JSON, min_size=1, max_size=2))
def test_grammar_fields_compile_or_give_a_400(grammars, fields):
    typed = parsed_or_400(GenerateRequest, {"text": "hi", "sampling_params": fields})
    if typed is None:
        return
    try:
        params = SamplingParams.from_dict(typed.sampling_params.given(), TINY_VOCAB_SIZE)
        if params.grammar is not None:
            asyncio.run(grammars.compile(params.grammar))
    except InvalidRequestError as exc:
        assert exc.field in fields


CALL_PIECES = st.sampled_from([
    "<tool_call>", "</tool_call>", "<tool_", "[", "]", "{", "}", '"name": ', '"get_weather"',
    '"arguments": ', '{"city": "Oslo"}', ", ", "\n", '"nope"', '"{\\"a\\": 1}"', "text "])


@SEEDED
@given(st.lists(CALL_PIECES | st.text(max_size=5), max_size=24), st.booleans(),
       st.lists(st.integers(1, 7), min_size=1, max_size=8))
def test_tool_calls_read_out_of_any_output_whole_or_streamed_alike(pieces, hermes, cuts):
    fmt = HermesFormat() if hermes else SmolLM2Format()
    text, names = "".join(pieces), {"get_weather"}
    content, calls = read_all(fmt, names, text)
    assert all(c.name in names and isinstance(json.loads(c.arguments), dict) for c in calls)
    reader, streamed, got, end, k = ToolCallReader(fmt, names), "", [], 0, 0
    while end < len(text):
        end = min(len(text), end + cuts[k % len(cuts)])
        k += 1
        new, more = reader.feed(text[:end])
        streamed, got = streamed + new, got + more
    new, more = reader.finish(text)
    assert got + more == calls
    said = streamed + new  # (a whole output of calls and whitespace has no content)
    assert said == content if content is not None else calls and not said.strip()
