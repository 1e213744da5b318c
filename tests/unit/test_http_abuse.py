"""Malformed or out-of-range inputs: each gets a 4xx with an OpenAI-shaped JSON error, reaches no
scheduler, and leaves the server serving.
Also the OpenAPI spec, served behind --api-key."""

from __future__ import annotations

import dataclasses
import json

import httpx
import jsonschema
import pytest

from specserve.runtime.entrypoints.field_types import BOUND_KEY
from specserve.runtime.entrypoints.http_server import create_app
from specserve.runtime.entrypoints.request_bodies import MAX_N
from tests.helpers.fake_tm import CONTEXT_LENGTH, MODEL_NAME, make_fake_tm
from tests.helpers.live_server import live_server

API_KEY = "sk-abuse-test"
LONE = '"a\\udcffb"'  # a JSON string escape that parses to a lone surrogate


@pytest.fixture(scope="module")
def env(tmp_path_factory):
    """(client, tm, scheduler) on a server without an API key."""
    tm, sched = make_fake_tm(tmp_path_factory.mktemp("tok"))
    with live_server(create_app(tm, tm.server_args)) as url, \
            httpx.Client(base_url=url, timeout=10) as client:
        yield client, tm, sched


def _post_raw(client: httpx.Client, path: str, body: str) -> httpx.Response:
    return client.post(path, content=body.encode(), headers={"content-type": "application/json"})


@pytest.mark.parametrize(("path", "body", "param"), [
    ("/generate", '{"text": @}', "text"),
    ("/generate", '{"text": ["ok", @]}', "text.1"),
    ("/generate", '{"text": "a", "sampling_params": {"stop": [@]}}',
     "sampling_params.stop.0"),
    ("/generate", '{"text": "a", "rid": @}', "rid"),
    ("/generate", '{@: 1}', "a\\udcffb"),
    ("/v1/completions", '{"prompt": @}', "prompt"),
    ("/v1/chat/completions", '{"messages": [{"role": "user", "content": @}]}',
     "messages.0.content"),
    ("/v1/chat/completions", '{"messages": [{"role": "user", "content": "hi"}], "user": @}',
     "user"),
])
def test_lone_surrogate_is_400_naming_the_field_not_500(env, path, body, param):
    client, _, sched = env
    before = len(sched.requests)
    r = _post_raw(client, path, body.replace("@", LONE))
    assert r.status_code == 400, r.text
    err = r.json()["error"]
    assert err["type"] == "invalid_request_error" and "surrogate" in err["message"]
    assert err["param"] == param
    assert len(sched.requests) == before
    ok = client.post("/generate", json={"text": "a", "sampling_params": {"max_new_tokens": 2}})
    assert ok.status_code == 200


def test_a_paired_surrogate_escape_is_ordinary_text(env):
    client, _, _ = env
    r = _post_raw(client, "/generate", '{"text": "smile \\ud83d\\ude00", '
                  '"sampling_params": {"max_new_tokens": 2}}')
    assert r.status_code == 200, r.text


@pytest.mark.parametrize("path", ["/v1/completions", "/v1/chat/completions"])
def test_unknown_model_is_404_in_openais_shape(env, path):
    client, tm, sched = env
    body = {"prompt": "hi"} if path.endswith("/completions") and "chat" not in path \
        else {"messages": [{"role": "user", "content": "hi"}]}
    before = len(sched.requests)
    for stream in (False, True):
        r = client.post(path, json={**body, "model": "nonexistent", "max_tokens": 2,
                                    "stream": stream})
        assert r.status_code == 404, r.text
        err = r.json()["error"]
        assert err["code"] == "model_not_found" and err["param"] == "model"
        assert "nonexistent" in err["message"]
        assert f"This server serves `{MODEL_NAME}`" in err["message"]  # the name to use
    assert len(sched.requests) == before
    for name in (MODEL_NAME, tm.server_args.model_path, None):
        r = client.post(path, json={**body, "max_tokens": 2,
                                    **({"model": name} if name else {})})
        assert r.status_code == 200, (name, r.text)


@pytest.mark.parametrize(("path", "body", "param"), [
    ("/generate", {"input_ids": [1, 2], "sampling_params": {"max_new_tokens": 10**30}},
     "sampling_params.max_new_tokens"),
    ("/generate", {"input_ids": [1, 2], "sampling_params": {"max_new_tokens": 10**9}},
     "sampling_params.max_new_tokens"),
    ("/generate", {"input_ids": [1, 2], "sampling_params": {
        "max_new_tokens": CONTEXT_LENGTH - 1}}, "sampling_params.max_new_tokens"),
    ("/v1/completions", {"prompt": [1, 2], "max_tokens": 10**9}, "max_tokens"),
    ("/v1/chat/completions", {"messages": [{"role": "user", "content": "hi"}],
                              "max_tokens": 10**9}, "max_tokens"),
    ("/v1/chat/completions", {"messages": [{"role": "user", "content": "hi"}],
                              "max_completion_tokens": 10**9}, "max_completion_tokens"),
])
def test_max_new_tokens_beyond_the_context_is_400_as_in_sglang(env, path, body, param):
    client, _, sched = env
    before = len(sched.requests)
    r = client.post(path, json=body)
    assert r.status_code == 400, r.text
    err = r.json()["error"]
    assert err["param"] == param and "maximum context length" in err["message"]
    assert len(sched.requests) == before


def test_max_new_tokens_that_fits_or_is_unset_runs_to_the_context_limit(env):
    client, _, _ = env
    exact = {"input_ids": [1, 2], "sampling_params": {"max_new_tokens": CONTEXT_LENGTH - 2,
                                                      "ignore_eos": True}}
    r = client.post("/generate", json=exact)
    assert r.status_code == 200, r.text
    assert r.json()["meta_info"]["completion_tokens"] == CONTEXT_LENGTH - 2
    r = client.post("/v1/chat/completions", json={
        "messages": [{"role": "user", "content": "hi"}], "ignore_eos": True})
    assert r.status_code == 200, r.text
    usage = r.json()["usage"]
    assert usage["total_tokens"] == CONTEXT_LENGTH  # OpenAI's default: until the context is full


def test_openapi_spec_is_served_with_request_body_schemas(env):
    client, _, _ = env
    spec = client.get("/openapi.json").json()
    for path in ("/generate", "/v1/completions", "/v1/chat/completions", "/abort_request"):
        schema = spec["paths"][path]["post"]["requestBody"]["content"]["application/json"][
            "schema"]
        assert schema["type"] == "object" and schema["additionalProperties"] is False
        assert "$ref" not in str(schema)  # self-contained: no dangling pydantic $defs
    chat = spec["paths"]["/v1/chat/completions"]["post"]["requestBody"]["content"][
        "application/json"]["schema"]["properties"]
    assert chat["messages"]["type"] == "array"
    # what a body must hold, told to clients and fuzzers (the checks are the server's own)
    body = {path: spec["paths"][path]["post"]["requestBody"]["content"]["application/json"][
        "schema"] for path in ("/generate", "/v1/completions", "/v1/chat/completions")}
    assert body["/v1/completions"]["required"] == ["prompt"]
    assert body["/v1/chat/completions"]["required"] == ["messages"]
    assert body["/generate"]["oneOf"] == [{"required": ["text"]}, {"required": ["input_ids"]}]
    assert chat["stream_options"]["anyOf"][0]["properties"]["include_usage"]
    assert client.get("/docs").status_code == 200


def test_the_spec_states_this_servers_bounds_and_is_valid_json_schema(env):
    """Generated from the body types, with the server's own numbers: what a fuzzer draws from
    it is what the server accepts."""
    client, tm, _ = env
    spec = client.get("/openapi.json").json()
    bodies = {path: spec["paths"][path]["post"]["requestBody"]["content"]["application/json"][
        "schema"] for path in ("/generate", "/v1/completions", "/v1/chat/completions")}
    for schema in bodies.values():
        jsonschema.Draft202012Validator.check_schema(schema)
        text = json.dumps(schema)
        assert BOUND_KEY not in text and '"ge"' not in text and '"le"' not in text
    ids = bodies["/generate"]["properties"]["input_ids"]["anyOf"][0]
    assert ids["items"]["maximum"] == tm.vocab_size - 1 and ids["minItems"] == 1
    sampling = bodies["/generate"]["properties"]["sampling_params"]["anyOf"][0]["properties"]
    assert sampling["max_new_tokens"]["anyOf"][0]["maximum"] == CONTEXT_LENGTH - 1
    assert sampling["top_p"]["anyOf"][0] == {"type": "number", "exclusiveMinimum": 0,
                                             "maximum": 1}
    chat = bodies["/v1/chat/completions"]["properties"]
    named = chat["tool_choice"]["anyOf"][1]
    assert named["properties"]["function"]["properties"]["name"]["type"] == "string"
    assert chat["logit_bias"]["anyOf"][0]["maxProperties"] == 0  # served empty only
    n_max = min(MAX_N, tm.server_args.max_sequences_per_request)
    assert chat["n"]["anyOf"][0]["maximum"] == n_max
    args = dataclasses.replace(tm.server_args, max_sequences_per_request=8)
    with live_server(create_app(tm, args)) as url, httpx.Client(base_url=url, timeout=10) as c:
        small = c.get("/openapi.json").json()["paths"]["/v1/chat/completions"]["post"]
    assert small["requestBody"]["content"]["application/json"]["schema"]["properties"]["n"][
        "anyOf"][0]["maximum"] == 8


def test_a_named_tool_choice_whose_name_is_an_object_is_a_400_naming_its_path(env):
    client, _, sched = env
    before = len(sched.requests)
    r = _post_raw(client, "/v1/chat/completions", '{"messages":[{"role":"user","content":"hi"}],'
                  '"tools":[],"tool_choice":{"type":"function","function":{"name":{}}},'
                  '"max_tokens":4}')
    assert r.status_code == 400, r.text
    assert r.json()["error"]["param"] == "tool_choice.function.name"
    assert len(sched.requests) == before


def test_openapi_spec_sits_behind_the_api_key(env):
    _, tm, _ = env
    args = dataclasses.replace(tm.server_args, api_key=API_KEY)
    with live_server(create_app(tm, args)) as url, httpx.Client(base_url=url, timeout=10) as c:
        for path in ("/openapi.json", "/docs"):
            assert c.get(path).status_code == 401
        ok = c.get("/openapi.json", headers={"Authorization": f"Bearer {API_KEY}"})
        assert ok.status_code == 200 and "/generate" in ok.json()["paths"]
