"""Structured output over HTTP (a real TokenizerManager and uvicorn, the scheduler faked): the
request fields as SGLang and OpenAI spell them reach the scheduler as a compiled grammar, bad
grammars are 400s naming their field (the server answers on), tool calls come back parsed,
whole and streamed, and the OpenAPI spec, /metrics and /server_info show the new parts."""

from __future__ import annotations

import json
import threading
import time
import zlib
from concurrent.futures import ThreadPoolExecutor

import httpx
import openai
import pytest

from specserve.runtime.constrained.compiler import GrammarCompiler
from specserve.runtime.entrypoints.http_server import create_app
from tests.helpers import fake_tm
from tests.helpers.fake_tm import MODEL_NAME, REPLY_TEXT, make_fake_tm
from tests.helpers.live_server import live_server
from tests.helpers.tiny_models import EOS_ID

SCHEMA = {"type": "object", "properties": {"a": {"type": "integer"}}, "required": ["a"]}
WEATHER = {"type": "function", "function": {
    "name": "get_weather", "parameters": {"type": "object", "properties": {
        "city": {"type": "string"}}, "required": ["city"]}}}
MESSAGES = [{"role": "user", "content": "Weather in Paris?"}]
CALL = '<tool_call>[\n{"name": "get_weather", "arguments": {"city": "Paris"}}\n]</tool_call>'


@pytest.fixture(scope="module")
def env(tmp_path_factory):
    """(openai client, raw client, tm, scheduler)"""
    tm, sched = make_fake_tm(tmp_path_factory.mktemp("tok"), enable_metrics=True)
    with pytest.MonkeyPatch.context() as mp, live_server(create_app(tm, tm.server_args)) as url, \
            httpx.Client(base_url=url, timeout=10) as raw:
        # a tool prompt takes ~800 of the tiny tokenizer's tokens
        mp.setattr(tm, "context_length", 4096)
        mp.setattr(fake_tm, "CONTEXT_LENGTH", 4096)
        oai = openai.OpenAI(base_url=f"{url}/v1", api_key="x", max_retries=0, timeout=10)
        yield oai, raw, tm, sched


@pytest.fixture(autouse=True)
def _reply(env):
    _, _, tm, sched = env
    sched.reply_ids = tm.tokenize(REPLY_TEXT) + [EOS_ID]


def last_grammar(sched):
    return sched.requests[-1].grammar


@pytest.mark.parametrize(("sampling", "kind"), [
    ({"regex": "[0-9]+"}, "regex"),
    ({"json_schema": json.dumps(SCHEMA)}, "json_schema"),
    ({"ebnf": 'root ::= "yes" | "no"'}, "ebnf"),
])
def test_generate_sends_the_compiled_grammar(env, sampling, kind):
    _, raw, _, sched = env
    r = raw.post("/generate", json={"text": "hi", "sampling_params": {"max_new_tokens": 4,
                                                                       **sampling}})
    assert r.status_code == 200, r.text
    g = last_grammar(sched)
    assert g.kind == kind and json.loads(zlib.decompress(g.data))  # xgrammar's serialized grammar


@pytest.mark.parametrize(("body", "param", "words"), [
    ({"sampling_params": {"regex": "[0-9]+", "json_schema": json.dumps(SCHEMA)}},
     "sampling_params.regex", "only one of json_schema, regex"),
    ({"sampling_params": {"regex": "[0-9"}}, "sampling_params.regex", "Unclosed"),
    ({"sampling_params": {"ebnf": "root ::= x"}}, "sampling_params.ebnf", "not defined"),
    ({"sampling_params": {"json_schema": '{"type": "strin"}'}}, "sampling_params.json_schema",
     "Unsupported type"),
    ({"sampling_params": {"json_schema": "{"}}, "sampling_params.json_schema", "valid JSON"),
    ({"sampling_params": {"regex": "[^\\s\\S]"}}, "sampling_params.regex", "no output"),
    ({"text": ["a", "b"], "sampling_params": [{}, {"regex": "("}]}, "sampling_params.regex",
     "item 1"),
    ({"sampling_params": {"json_schema": {"type": "object"}}}, "sampling_params.json_schema",
     "must be a string"),
    ({"text": ["a", "b"], "sampling_params": [{}, {"ebnf": 5}]}, "sampling_params.1.ebnf",
     "must be a string"),
])
def test_a_bad_grammar_is_a_400_naming_it_and_the_server_answers_on(env, body, param, words):
    _, raw, _, sched = env
    before = len(sched.requests)
    for stream in (False, True):
        r = raw.post("/generate", json={"text": "hi", **body, "stream": stream})
        assert r.status_code == 400, r.text
        err = r.json()["error"]
        assert err["param"] == param and words in err["message"], err
    assert len(sched.requests) == before  # nothing was queued
    assert raw.post("/generate", json={"text": "hi", "sampling_params": {
        "max_new_tokens": 2}}).status_code == 200


def test_response_format_maps_to_a_json_schema_grammar(env):
    oai, raw, _, sched = env
    oai.chat.completions.create(model=MODEL_NAME, messages=MESSAGES, max_tokens=4,
                                response_format={"type": "json_object"})
    assert last_grammar(sched).kind == "json_schema"
    assert json.loads(sched.requests[-1].sampling_params.json_schema) == {"type": "object"}
    for strict in (True, False):  # constrained either way
        oai.chat.completions.create(
            model=MODEL_NAME, messages=MESSAGES, max_tokens=4, n=2,
            response_format={"type": "json_schema", "json_schema": {
                "name": "thing", "schema": SCHEMA, "strict": strict}})
        assert [json.loads(r.sampling_params.json_schema) for r in sched.requests[-2:]] \
            == [SCHEMA] * 2
        assert sched.requests[-1].grammar.key == sched.requests[-2].grammar.key
    oai.completions.create(model=MODEL_NAME, prompt="x", max_tokens=4,
                           extra_body={"response_format": {"type": "json_object"}})
    assert last_grammar(sched).kind == "json_schema"
    oai.chat.completions.create(model=MODEL_NAME, messages=MESSAGES, max_tokens=4,
                                response_format={"type": "text"})
    assert last_grammar(sched) is None


@pytest.mark.parametrize(("body", "param"), [
    ({"response_format": {"type": "json_schema", "json_schema": {
        "name": "t", "schema": {"type": "strin"}}}}, "response_format"),
    ({"response_format": {"type": "json_schema", "json_schema": {"name": "t"}}},
     "response_format.json_schema.schema"),
    ({"response_format": {"type": "yaml"}}, "response_format.type"),
    ({"response_format": {"type": "json_schema", "json_schema": {
        "name": "t", "schema": SCHEMA, "strict": "yes"}}}, "response_format.json_schema.strict"),
    ({"tools": [WEATHER], "tool_choice": {"type": "function", "function": {"name": "x"}}},
     "tool_choice.function.name"),
    ({"tools": [WEATHER], "tool_choice": "required", "response_format": {"type": "json_object"}},
     "tool_choice"),
    ({"tools": [{"type": "function", "function": {"name": "f", "parameters": {
        "type": "object", "properties": {"x": {"type": "strin"}}}}}], "tool_choice": "required"},
     "tools"),
    ({"messages": [{"role": "assistant", "content": None, "tool_calls": [
        {"id": "1", "type": "function", "function": {"name": "f", "arguments": "[1]"}}]}]},
     "messages.0.tool_calls.0.function.arguments"),
    ({"functions": [{"name": "f"}]}, "functions"),
    # a wrong shape deep inside: the path, from the types
    ({"tools": [], "tool_choice": {"type": "function", "function": {"name": {}}},
      "max_tokens": 4}, "tool_choice.function.name"),
    ({"tools": [WEATHER], "tool_choice": {"type": "function", "function": {
        "name": ["get_weather"]}}}, "tool_choice.function.name"),
    ({"tools": [{"type": "function", "function": {"name": "f", "parameters": "x"}}]},
     "tools.0.function.parameters"),
    ({"response_format": {"type": "json_schema", "json_schema": {"name": "t", "schema": "x"}}},
     "response_format.json_schema.schema"),
    ({"messages": [{"role": "user", "content": [{"type": "text", "text": 5}]}]},
     "messages.0.content.0.text"),
    ({"messages": [*MESSAGES, {"role": "assistant", "content": None, "tool_calls": [
        {"id": "1", "type": "function", "function": {"name": "f", "arguments": {}}}]}]},
     "messages.1.tool_calls.0.function.arguments"),
])
def test_openai_grammar_fields_are_checked(env, body, param):
    _, raw, _, sched = env
    before = len(sched.requests)
    r = raw.post("/v1/chat/completions", json={"model": MODEL_NAME, "messages": MESSAGES,
                                               **body})
    assert r.status_code == 400, r.text
    assert r.json()["error"]["param"] == param, r.json()
    assert len(sched.requests) == before


def test_tools_are_shown_and_forced_as_asked(env):
    oai, _, tm, sched = env

    def prompt_text():
        return tm.tokenizer.decode(sched.requests[-1].input_ids)

    oai.chat.completions.create(model=MODEL_NAME, messages=MESSAGES, max_tokens=4,
                                tools=[WEATHER])
    assert "<tools>" in prompt_text() and last_grammar(sched) is None  # auto: not forced
    oai.chat.completions.create(model=MODEL_NAME, messages=MESSAGES, max_tokens=4,
                                tools=[WEATHER], tool_choice="none")
    assert "<tools>" not in prompt_text()
    for choice in ("required", {"type": "function", "function": {"name": "get_weather"}}):
        oai.chat.completions.create(model=MODEL_NAME, messages=MESSAGES, max_tokens=4,
                                    tools=[WEATHER], tool_choice=choice)
        assert last_grammar(sched).kind == "structural_tag"
    oai.chat.completions.create(model=MODEL_NAME, max_tokens=4, tools=[WEATHER], messages=[
        *MESSAGES, {"role": "assistant", "content": None, "tool_calls": [
            {"id": "c1", "type": "function",
             "function": {"name": "get_weather", "arguments": '{"city": "Paris"}'}}]},
        {"role": "tool", "tool_call_id": "c1", "content": "sunny"}])
    assert "<tool_response>\nsunny\n</tool_response>" in prompt_text()
    assert '{"name": "get_weather", "arguments": {"city": "Paris"}}' in prompt_text()


def test_tool_calls_come_back_parsed_whole_and_streamed(env):
    oai, _, tm, sched = env
    sched.reply_ids = tm.tokenize(CALL) + [EOS_ID]
    resp = oai.chat.completions.create(model=MODEL_NAME, messages=MESSAGES, max_tokens=200,
                                       tools=[WEATHER], tool_choice="required")
    choice = resp.choices[0]
    assert choice.finish_reason == "tool_calls" and choice.message.content is None
    (call,) = choice.message.tool_calls
    assert call.type == "function" and call.id.startswith("call_")
    assert call.function.name == "get_weather"
    assert json.loads(call.function.arguments) == {"city": "Paris"}
    stream = oai.chat.completions.create(model=MODEL_NAME, messages=MESSAGES, max_tokens=200,
                                         tools=[WEATHER], stream=True)
    calls, content, reasons = [], "", []
    for chunk in stream:
        for c in chunk.choices:
            content += c.delta.content or ""
            calls += c.delta.tool_calls or []
            reasons.append(c.finish_reason)
    assert content == "" and reasons[-1] == "tool_calls"
    assert [(c.index, c.function.name, json.loads(c.function.arguments)) for c in calls] == \
        [(0, "get_weather", {"city": "Paris"})]
    # without tools, the same text is just content
    plain = oai.chat.completions.create(model=MODEL_NAME, messages=MESSAGES, max_tokens=200)
    assert plain.choices[0].message.content == CALL and plain.choices[0].finish_reason == "stop"


def test_openapi_metrics_and_server_info_show_grammars(env):
    _, raw, _, _ = env
    spec = raw.get("/openapi.json").json()
    text = json.dumps(spec)
    for word in ("json_schema", "regex", "ebnf", "structural_tag", "response_format",
                 "tool_choice", "tool_calls", "parallel_tool_calls"):
        assert word in text, word
    raw.post("/generate", json={"text": "hi", "sampling_params": {"regex": "[a-c]+"}})
    raw.post("/generate", json={"text": "hi", "sampling_params": {"regex": "[a-c]+"}})
    info = raw.get("/server_info").json()["grammar"]
    assert info["backend"] == "xgrammar" and info["cache_hits"] >= 1
    assert info["cached_grammars"] >= 1 and info["compile_s_total"] > 0
    metrics = raw.get("/metrics").text
    for name in ("specserve_grammar_cache_hits_total", "specserve_grammar_cache_misses_total",
                 "specserve_grammar_compile_seconds_count"):
        assert name in metrics, name


def test_without_a_grammar_backend_grammars_are_refused(tmp_path):
    tm, sched = make_fake_tm(tmp_path, grammar_backend="none")
    with live_server(create_app(tm, tm.server_args)) as url, \
            httpx.Client(base_url=url, timeout=10) as raw:
        r = raw.post("/generate", json={"text": "hi", "sampling_params": {"regex": "a"}})
        assert r.status_code == 400 and r.json()["error"]["param"] == "sampling_params.regex"
        assert raw.post("/generate", json={"text": "hi"}).status_code == 200


class _HeldBackend:
    """A backend whose compiles wait for `release` (the tokenizer process's threads hold them,
    not its event loop)."""

    def __init__(self, inner, release: threading.Event) -> None:
        self.inner, self.release = inner, release
        self.compile_options = "held"

    def compile(self, spec):
        assert self.release.wait(10)
        return self.inner.compile(spec)

    def dump(self, compiled):
        return self.inner.dump(compiled)


def test_a_request_waits_for_its_grammar_while_others_are_served(env):
    _, raw, tm, sched = env
    release, real = threading.Event(), tm.grammars
    tm.grammars = GrammarCompiler(lambda: _HeldBackend(real.backend, release))
    body = {"text": "hi", "sampling_params": {"regex": "[a-c]{2}", "max_new_tokens": 4}}
    try:
        with ThreadPoolExecutor(1) as pool, httpx.Client(base_url=str(raw.base_url),
                                                         timeout=10) as other:
            waiting = pool.submit(other.post, "/generate", json=body)
            time.sleep(0.2)
            plain = raw.post("/generate", json={"text": "hi", "sampling_params": {
                "max_new_tokens": 4}})
            assert plain.status_code == 200 and not waiting.done()
            release.set()
            assert waiting.result(10).status_code == 200
        assert sched.requests[-1].grammar.kind == "regex"
    finally:
        release.set()
        tm.grammars.shutdown()
        tm.grammars = real
