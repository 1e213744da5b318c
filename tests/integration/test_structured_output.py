"""Structured output on the default model: every request form gives output that matches its
grammar (JSON validated with `jsonschema`, regexes full-matched), tool calls come back from the
model's own output, bad grammars are 400s the server shrugs off, aborted and disconnected
constrained requests free their KV, greedy constrained output equals an independent reference
(the model's forwards and the grammar library's masks in this process,
tests/helpers/grammar_reference.py) and seeded output repeats; with NGRAM and SUFFIX speculation
the output is plain constrained decoding's, token for token. All of it for both grammar backends
(xgrammar, llguidance)."""

from __future__ import annotations

import json
import re
import time

import httpx
import jsonschema
import openai
import pytest

from specserve.runtime.model_loader.default_model import resolve_model_path
from specserve.runtime.model_loader.tokenizer import apply_chat_template, load_tokenizer
from specserve.runtime.model_runner.model_runner import ModelRunner, RunnerConfig
from tests.helpers.grammar_reference import (
    LLGuidanceReference,
    compile_spec,
    masked_greedy,
    xgrammar_compiler,
)
from tests.helpers.schemas import CASES, _obj
from tests.helpers.server_proc import ServerProcess

pytestmark = pytest.mark.slow

NEW = 64
EOS = 2


WEATHER = {"type": "function", "function": {
    "name": "get_weather", "description": "Get the current weather in a city",
    "parameters": _obj({"city": {"type": "string"}})}}
TIME = {"type": "function", "function": {
    "name": "get_time", "description": "Get the local time in a time zone",
    "parameters": _obj({"zone": {"type": "string"}})}}


@pytest.fixture(scope="module", params=["xgrammar", "llguidance"])
def backend(request):
    return request.param


@pytest.fixture(scope="module")
def model():
    """(tokenizer, a runner of this process's own)"""
    d = resolve_model_path(None)
    tok = load_tokenizer(d)
    return tok, ModelRunner(RunnerConfig(str(d), "cpu", "float32", max_total_tokens=1024))


@pytest.fixture(scope="module")
def prompts(model):
    return [apply_chat_template(model[0], [{"role": "user", "content": q}]) for q, _ in CASES]


@pytest.fixture(scope="module")
def reference(model, prompts, backend):
    """Greedy constrained outputs, computed in this process with the backend's library."""
    tok, runner = model
    make = xgrammar_compiler if backend == "xgrammar" else LLGuidanceReference
    rc = make(tok, runner.vocab_size, [EOS])
    return [masked_greedy(runner, compile_spec(rc, "json_schema", json.dumps(s)), p, NEW)
            for p, (_, s) in zip(prompts, CASES)]


@pytest.fixture(scope="module")
def server(backend):
    srv = ServerProcess("--log-level", "warning", "--enable-metrics", "--grammar-backend", backend)
    try:
        yield srv
    finally:
        srv.stop()


def schema_params(i: int, **extra) -> dict:
    return {"json_schema": json.dumps(CASES[i][1]), "max_new_tokens": NEW, "temperature": 0,
            **extra}


def check_json(text: str, schema: dict) -> None:
    jsonschema.validate(json.loads(text), schema)


def test_greedy_constrained_equals_the_reference_and_seeded_output_repeats(server, prompts,
                                                                           reference):
    with server.client() as c:
        outs = c.post("/generate", json={"input_ids": prompts, "sampling_params": [
            schema_params(i) for i in range(len(CASES))]}).json()
        seeded = [schema_params(i, temperature=0.8, seed=11 + i) for i in range(4)]
        twice = [c.post("/generate", json={"input_ids": prompts[:4],
                                           "sampling_params": seeded}).json()
                 for _ in range(2)]
    finished = 0
    for i, (out, ref) in enumerate(zip(outs, reference)):
        assert out["output_ids"] == ref, f"case {i}: {out['text']!r}"
        if out["meta_info"]["finish_reason"]["type"] == "stop":
            finished += 1
            assert ref[-1] == EOS
            check_json(out["text"], CASES[i][1])
    assert finished >= 9
    assert [o["output_ids"] for o in twice[0]] == [o["output_ids"] for o in twice[1]]
    for i, out in enumerate(twice[0]):
        if out["meta_info"]["finish_reason"]["type"] == "stop":
            check_json(out["text"], CASES[i][1])


def test_every_request_form_matches_its_grammar(server):
    oai = openai.OpenAI(base_url=f"{server.url}/v1", api_key="x", max_retries=0, timeout=120)
    q, schema = CASES[0]
    msgs = [{"role": "user", "content": q}]
    for strict in (True, False):
        r = oai.chat.completions.create(
            model="SmolLM2-135M-Instruct", messages=msgs, max_tokens=NEW, temperature=0, n=2,
            seed=5, response_format={"type": "json_schema", "json_schema": {
                "name": "person", "schema": schema, "strict": strict}})
        for choice in r.choices:
            assert choice.finish_reason == "stop"
            check_json(choice.message.content, schema)
    r = oai.chat.completions.create(model="SmolLM2-135M-Instruct", max_tokens=2 * NEW,
                                    messages=[{"role": "user", "content": 'Return a JSON '
                                               'object with a key "ok" set to true.'}],
                                    temperature=0, response_format={"type": "json_object"})
    assert r.choices[0].finish_reason == "stop"
    assert isinstance(json.loads(r.choices[0].message.content), dict)
    r = oai.completions.create(model="SmolLM2-135M-Instruct", prompt="A person, as JSON:",
                               max_tokens=NEW, temperature=0, extra_body={"response_format": {
                                   "type": "json_schema", "json_schema": {
                                       "name": "person", "schema": schema}}})
    check_json(r.choices[0].text, schema)
    with server.client() as c:
        regex = c.post("/generate", json={"text": "The year the Eiffel Tower was built:",
                                          "sampling_params": {"regex": "[0-9]{4}",
                                                              "max_new_tokens": 8,
                                                              "temperature": 0}}).json()
        ebnf = c.post("/generate", json={"text": "Is water wet? Answer: ", "sampling_params": {
            "ebnf": 'root ::= ("yes" | "no") ", because " [a-z ]{1,40} "."',
            "max_new_tokens": 40, "temperature": 0.7, "seed": 3}}).json()
    assert re.fullmatch("[0-9]{4}", regex["text"])
    assert regex["meta_info"]["finish_reason"] == {"type": "stop", "matched": EOS}
    assert re.fullmatch(r"(yes|no), because [a-z ]{1,40}\.", ebnf["text"]), ebnf["text"]


@pytest.mark.parametrize("stream", [False, True])
def test_the_model_calls_the_tools_it_is_made_to(server, stream):
    oai = openai.OpenAI(base_url=f"{server.url}/v1", api_key="x", max_retries=0, timeout=120)
    msgs = [{"role": "user", "content": "What is the weather in Paris?"}]
    for choice, name in (("required", None),
                         ({"type": "function", "function": {"name": "get_time"}}, "get_time")):
        kw = dict(model="SmolLM2-135M-Instruct", messages=msgs, max_tokens=NEW,
                  temperature=0, tools=[WEATHER, TIME], tool_choice=choice)
        if stream:
            calls, reasons = {}, []
            for chunk in oai.chat.completions.create(stream=True, **kw):
                for c in chunk.choices:
                    reasons.append(c.finish_reason)
                    for d in c.delta.tool_calls or []:
                        calls[d.index] = (d.function.name, d.function.arguments)
            assert reasons[-1] == "tool_calls"
            calls = list(calls.values())
        else:
            r = oai.chat.completions.create(**kw).choices[0]
            assert r.finish_reason == "tool_calls"
            calls = [(c.function.name, c.function.arguments) for c in r.message.tool_calls]
        assert calls, "a forced call"
        for fn, args in calls:
            assert fn == (name or fn) and fn in ("get_weather", "get_time")
            tool = WEATHER if fn == "get_weather" else TIME
            jsonschema.validate(json.loads(args), tool["function"]["parameters"])


def test_bad_grammars_are_400s_and_aborts_free_kv(server):
    with server.client() as c:
        for sp, param in ((({"regex": "[0-9", "json_schema": "{}"}), "sampling_params.regex"),
                          ({"regex": "(a"}, "sampling_params.regex"),
                          ({"ebnf": "root ::= nothing"}, "sampling_params.ebnf"),
                          ({"json_schema": '{"type": "integr"}'}, "sampling_params.json_schema")):
            r = c.post("/generate", json={"text": "hi", "sampling_params": sp})
            assert r.status_code == 400 and r.json()["error"]["param"] == param, r.text
        # a grammar that never ends: only max_new_tokens (or the client) stops it
        loop = {"ebnf": "root ::= [a-z ] root", "max_new_tokens": 1000, "temperature": 0.9}
        # disconnect while streaming, and a non-streamed request whose client gives up
        with c.stream("POST", "/generate", json={"text": "List words:", "stream": True,
                                                 "sampling_params": loop}) as resp:
            next(resp.iter_lines())
        with pytest.raises(httpx.ReadTimeout):
            c.post("/generate", json={"text": "More words:", "sampling_params": loop},
                   timeout=1.0)
        # and /abort_request while it streams
        with c.stream("POST", "/generate", json={"text": "Words:", "stream": True,
                                                 "rid": "to-abort", "sampling_params": loop},
                      ) as resp:
            lines = resp.iter_lines()
            next(lines)
            assert c.post("/abort_request", json={"rid": "to-abort"}).json()["success"]
            events = [json.loads(x[6:]) for x in lines if x.startswith("data: {")]
        assert events[-1]["meta_info"]["finish_reason"]["type"] == "abort"
        info = server.wait_idle(timeout_s=30)
        assert info["kv_used_by_requests"] == 0
        assert info["kv_free"] + info["radix_cache_tokens"] == info["kv_capacity"]
        assert c.post("/generate", json={"text": "hi", "sampling_params": {
            "regex": "[a-z]+", "max_new_tokens": 4}}).status_code == 200
        metrics = c.get("/metrics").text
    assert re.search(r"specserve_grammar_cache_misses_total\{[^}]*\} [1-9]", metrics)


@pytest.mark.parametrize("algo", ["NGRAM", "SUFFIX"])
def test_speculation_gives_plain_constrained_output(algo, prompts, reference, backend):
    """Ten schema prompts, eight at a time, beside two unconstrained copy-heavy requests: every
    constrained output is the plain reference token for token, and constrained requests drafted
    (their drafter's tokens and the grammar's forced ones) and had drafts accepted."""
    from specserve.launch import Engine
    from tests.helpers.engine_runs import run_concurrent

    copy = "Repeat exactly: the quick brown fox jumps over the lazy dog. " * 3
    with Engine(log_level="warning", speculative_algorithm=algo, grammar_backend=backend,
                speculative_disable_adaptive=True, speculative_verify_cost="table") as spec:
        extra = [spec.tm.tokenize(copy)] * 2
        params = [schema_params(i) for i in range(len(CASES))] + \
            [{"max_new_tokens": 48, "temperature": 0}] * 2
        t0 = time.perf_counter()
        outs = run_concurrent(spec, prompts + extra, params, 8)
        info = spec.server_info()
        spec.flush_cache()
        idle = spec.server_info()
    print(algo, f"{time.perf_counter() - t0:.1f}s", info.get("avg_spec_accept_length"))
    assert [o["output_ids"] for o in outs[: len(CASES)]] == reference
    constrained = [o["meta_info"] for o in outs[: len(CASES)]]
    assert sum(m.get("spec_num_proposed_drafts", 0) for m in constrained) > 0
    assert max(m.get("spec_accept_length", 1.0) for m in constrained) > 1.5
    assert info["spec_decode_num_draft_tokens"] > 0
    assert idle["kv_free"] == idle["kv_capacity"]
