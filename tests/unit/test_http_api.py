"""HTTP front end (native endpoints, errors, auth, limits, disconnects) against a real uvicorn
server and a real TokenizerManager whose scheduler is faked (tests/helpers/fake_tm.py)."""

from __future__ import annotations

import asyncio
import dataclasses
import json

import httpx
import pytest

from specserve.runtime.entrypoints.http_server import create_app
from specserve.runtime.entrypoints.streaming import SSEResponse
from tests.helpers.fake_tm import CONTEXT_LENGTH, MODEL_NAME, fake_logprob, make_fake_tm
from tests.helpers.live_server import live_server, wait_for

MAX_BODY = 64 * 1024
API_KEY = "sk-test-key"


@pytest.fixture(scope="module")
def env(tmp_path_factory):
    """(client, tm, scheduler): metrics on, no API key, a 64 KiB body limit."""
    tm, sched = make_fake_tm(tmp_path_factory.mktemp("tok"), enable_metrics=True,
                             max_request_bytes=MAX_BODY)
    with live_server(create_app(tm, tm.server_args)) as url, \
            httpx.Client(base_url=url, timeout=10) as client:
        yield client, tm, sched


@pytest.fixture(scope="module")
def keyed(env):
    """A client of a second server with an API key (and metrics off), over the same tm."""
    _, tm, _ = env
    args = dataclasses.replace(tm.server_args, api_key=API_KEY, enable_metrics=False)
    with live_server(create_app(tm, args)) as url, httpx.Client(base_url=url, timeout=10) as c:
        yield c


@pytest.fixture(autouse=True)
def _reset(env):
    _, tm, sched = env
    sched.token_delay, sched.flush_ok, tm.healthy = 0.0, True, True
    sched.die_after_tokens = None
    yield
    tm.healthy = True


def _sse(lines) -> list:
    """Parsed `data:` payloads of an SSE body ('[DONE]' kept as a string)."""
    out = []
    for line in lines:
        if line.startswith("data: "):
            data = line[len("data: "):]
            out.append(data if data == "[DONE]" else json.loads(data))
    return out


def test_generate_returns_text_ids_and_meta_info(env):
    client, tm, _ = env
    r = client.post("/generate", json={"text": "hello", "sampling_params": {"max_new_tokens": 5}})
    assert r.status_code == 200, r.text
    out = r.json()
    assert len(out["output_ids"]) == 5
    assert out["text"] == tm.tokenizer.decode(out["output_ids"], skip_special_tokens=True)
    meta = out["meta_info"]
    assert meta["finish_reason"] == {"type": "length", "length": 5}
    assert meta["prompt_tokens"] == len(tm.tokenize("hello"))
    assert meta["completion_tokens"] == 5 and meta["cached_tokens"] == 0
    assert meta["e2e_latency"] >= 0 and meta["spec_accept_length"] == 2.5  # passed through


def test_generate_stream_is_cumulative_utf8_clean_and_ends_with_done(env):
    client, tm, sched = env
    # precondition: some prefix of the reply decodes to a broken character
    ids = sched.reply_ids
    assert any(tm.tokenizer.decode(ids[:k]).endswith("\ufffd") for k in range(1, len(ids)))
    with client.stream("POST", "/generate", json={"input_ids": [5, 6, 7], "stream": True}) as r:
        assert r.status_code == 200 and r.headers["content-type"].startswith("text/event-stream")
        events = _sse(r.iter_lines())
    assert events[-1] == "[DONE]" and len(events) > 3
    chunks = events[:-1]
    for prev, cur in zip(chunks, chunks[1:]):
        assert cur["text"].startswith(prev["text"])
        assert cur["output_ids"][: len(prev["output_ids"])] == prev["output_ids"]
    assert all("\ufffd" not in c["text"] for c in chunks)
    assert all(c["meta_info"]["finish_reason"] is None for c in chunks[:-1])
    final = chunks[-1]
    assert final["meta_info"]["finish_reason"]["type"] == "stop"  # the fake ends with EOS
    assert final["output_ids"] == ids and final["text"] == tm.tokenizer.decode(
        ids, skip_special_tokens=True)


def test_incremental_streaming_output_sends_only_what_is_new(env):
    """--incremental-streaming-output (SGLang's): each /generate chunk holds the text, ids and
    output logprobs new since the previous one; joined they are the cumulative stream's last
    chunk; the prompt's logprobs come whole; non-streamed responses are unchanged."""
    client, tm, sched = env
    body = {"input_ids": [5, 6, 7, 8], "stream": True, "return_logprob": True,
            "top_logprobs_num": 2, "logprob_start_len": 1, "return_text_in_logprobs": True}
    with client.stream("POST", "/generate", json=body) as r:
        whole = _sse(r.iter_lines())[-2]
    args = dataclasses.replace(tm.server_args, incremental_streaming_output=True)
    with live_server(create_app(tm, args)) as url, httpx.Client(base_url=url, timeout=10) as c:
        with c.stream("POST", "/generate", json=body) as r:
            events = _sse(r.iter_lines())
        plain = c.post("/generate", json={**body, "stream": False}).json()
    assert events[-1] == "[DONE]"
    chunks = events[:-1]
    assert len(chunks) > 3
    assert all(len(ch["output_ids"]) < len(whole["output_ids"]) for ch in chunks)
    assert "".join(ch["text"] for ch in chunks) == whole["text"] == plain["text"]
    assert [t for ch in chunks for t in ch["output_ids"]] == whole["output_ids"]
    meta = whole["meta_info"]
    for key in ("output_token_logprobs", "output_top_logprobs"):
        assert [e for ch in chunks for e in ch["meta_info"][key]] == meta[key]
    assert all(ch["meta_info"]["input_token_logprobs"] == meta["input_token_logprobs"]
               for ch in chunks)
    assert plain["output_ids"] == whole["output_ids"]
    assert plain["meta_info"]["output_token_logprobs"] == meta["output_token_logprobs"]


def test_generate_batch_returns_one_result_per_prompt_in_order(env):
    client, tm, _ = env
    r = client.post("/generate", json={"text": ["a", "hello world"],
                                       "sampling_params": [{"max_new_tokens": 2},
                                                           {"max_new_tokens": 4}]})
    assert r.status_code == 200, r.text
    out = r.json()
    assert [len(o["output_ids"]) for o in out] == [2, 4]
    assert [o["meta_info"]["prompt_tokens"] for o in out] == [
        len(tm.tokenize("a")), len(tm.tokenize("hello world"))]
    body = {"input_ids": [[1, 2], [3]], "stream": True, "sampling_params": {"max_new_tokens": 3}}
    with client.stream("POST", "/generate", json=body) as r:
        chunks = _sse(r.iter_lines())[:-1]
    finals = {c["index"]: c for c in chunks if c["meta_info"]["finish_reason"]}
    assert sorted(finals) == [0, 1]
    assert [finals[i]["meta_info"]["prompt_tokens"] for i in (0, 1)] == [2, 1]


def test_generate_logprobs_in_sglang_shape(env):
    client, tm, _ = env
    prompt = [5, 6, 7, 8]
    body = {"input_ids": prompt, "sampling_params": {"max_new_tokens": 6},
            "return_logprob": True, "top_logprobs_num": 2, "logprob_start_len": 0,
            "return_text_in_logprobs": True}
    out = client.post("/generate", json=body).json()
    meta, ids = out["meta_info"], out["output_ids"]
    assert [e[1] for e in meta["output_token_logprobs"]] == ids
    assert [e[0] for e in meta["output_token_logprobs"]] == [fake_logprob(t) for t in ids]
    assert [e[2] for e in meta["output_token_logprobs"]] == [tm.tokenizer.decode([t])
                                                             for t in ids]
    assert [len(top) for top in meta["output_top_logprobs"]] == [2] * len(ids)
    assert all(top[0][:2] == [fake_logprob(t), t] for top, t in
               zip(meta["output_top_logprobs"], ids))
    # the prompt from position 0: its first token has no logprob
    assert [e[1] for e in meta["input_token_logprobs"]] == prompt
    assert meta["input_token_logprobs"][0][0] is None
    assert [e[0] for e in meta["input_token_logprobs"][1:]] == [fake_logprob(t)
                                                                for t in prompt[1:]]
    assert meta["input_top_logprobs"][0] is None and len(meta["input_top_logprobs"]) == 4
    # from position 2, without text or alternatives
    body.update(logprob_start_len=2, top_logprobs_num=0, return_text_in_logprobs=False)
    meta = client.post("/generate", json=body).json()["meta_info"]
    assert meta["input_token_logprobs"] == [[fake_logprob(t), t, None] for t in prompt[2:]]
    assert "input_top_logprobs" not in meta and "output_top_logprobs" not in meta
    # the default start (-1): output tokens only; streamed chunks carry them cumulatively
    del body["logprob_start_len"]
    body["stream"] = True
    with client.stream("POST", "/generate", json=body) as r:
        chunks = _sse(r.iter_lines())[:-1]
    for c in chunks:
        assert [e[1] for e in c["meta_info"]["output_token_logprobs"]] == c["output_ids"]
        assert "input_token_logprobs" not in c["meta_info"]
    # without return_logprob, no logprob fields
    plain = client.post("/generate", json={"input_ids": prompt}).json()["meta_info"]
    assert not any("logprobs" in k for k in plain)


LONG_TEXT = "the quick brown fox " * 100


@pytest.mark.parametrize(("body", "param"), [
    ({}, "text"),
    ({"text": "a", "input_ids": [1]}, "text"),
    ({"text": ""}, "text"),
    ({"text": 5}, "text"),
    ({"text": []}, "text"),
    ({"text": LONG_TEXT}, "text"),
    ({"input_ids": []}, "input_ids"),
    ({"input_ids": [1, "a"]}, "input_ids"),
    ({"input_ids": [1, True]}, "input_ids"),
    ({"input_ids": [10**9]}, "input_ids"),
    ({"input_ids": list(range(CONTEXT_LENGTH))}, "input_ids"),
    ({"text": "a", "sampling_params": {"max_new_tokens": 0}}, "sampling_params.max_new_tokens"),
    ({"text": "a", "sampling_params": {"max_new_tokens": -3}}, "sampling_params.max_new_tokens"),
    ({"text": "a", "sampling_params": {"max_new_tokens": "5"}}, "sampling_params.max_new_tokens"),
    ({"text": "a", "sampling_params": {"temperature": -1}}, "sampling_params.temperature"),
    ({"text": "a", "sampling_params": {"top_p": 1.5}}, "sampling_params.top_p"),
    ({"text": "a", "sampling_params": {"stop": [""]}}, "sampling_params.stop.0"),
    ({"text": "a", "sampling_params": {"bogus": 1}}, "sampling_params.bogus"),
    ({"text": "a", "sampling_params": [{}]}, "sampling_params"),
    ({"text": ["a", "b"], "sampling_params": [{}]}, "sampling_params"),
    ({"text": "a", "stream": "yes"}, "stream"),
    ({"text": "a", "rid": 5}, "rid"),
    ({"text": "a", "return_logprob": True, "top_logprobs_num": 21}, "top_logprobs_num"),
    ({"text": "a", "return_logprob": True, "logprob_start_len": -2}, "logprob_start_len"),
    ({"text": "a", "return_logprob": True, "logprob_start_len": 1}, "logprob_start_len"),
    ({"text": "a", "return_logprob": True, "top_logprobs_num": "3"}, "top_logprobs_num"),
    ({"text": "a", "unknown_field": 1}, "unknown_field"),
])
def test_generate_bad_input_is_400_naming_the_field(env, body, param):
    client, _, sched = env
    before = len(sched.requests)
    for stream in (False, True):
        r = client.post("/generate", json={**body, "stream": body.get("stream", stream)})
        assert r.status_code == 400, r.text
        err = r.json()["error"]
        assert err["param"] == param and param in err["message"]
        assert err["type"] == "invalid_request_error" and err["code"] == 400
    assert len(sched.requests) == before  # nothing reached the scheduler


@pytest.mark.parametrize("content", [b"{not json", b"", b"[1, 2]", b"\xff\xfe", b"[" * 5000])
def test_malformed_json_body_is_400(env, content):
    client, _, _ = env
    r = client.post("/generate", content=content, headers={"content-type": "application/json"})
    assert r.status_code == 400 and r.json()["error"]["param"] == "body"


def test_body_over_the_limit_is_413_with_or_without_content_length(env):
    client, _, sched = env
    before = len(sched.requests)
    big = json.dumps({"text": "x" * (MAX_BODY + 10)}).encode()
    assert client.post("/generate", content=big).status_code == 413

    def chunked():  # no Content-Length: the server must count what arrives
        for i in range(0, len(big), 4096):
            yield big[i:i + 4096]

    r = client.post("/generate", content=chunked())
    assert r.status_code == 413 and "limit" in r.json()["error"]["message"]
    assert len(sched.requests) == before


def test_api_key_is_required_everywhere_but_health(keyed):
    assert keyed.get("/health").status_code == 200
    body = {"text": "a", "sampling_params": {"max_new_tokens": 1}}
    for path, method in [("/generate", "POST"), ("/v1/models", "GET"), ("/server_info", "GET"),
                         ("/metrics", "GET"), ("/health_generate", "GET")]:
        for headers in ({}, {"Authorization": "Bearer wrong"}, {"Authorization": API_KEY}):
            r = keyed.request(method, path, json=body, headers=headers)
            assert r.status_code == 401, (path, headers)
            assert r.json()["error"]["type"] == "authentication_error"
    ok = {"Authorization": f"Bearer {API_KEY}"}
    assert keyed.post("/generate", json=body, headers=ok).status_code == 200
    assert keyed.get("/v1/models", headers=ok).status_code == 200


def test_server_info_redacts_the_api_key_and_reports_internal_states(keyed):
    r = keyed.get("/server_info", headers={"Authorization": f"Bearer {API_KEY}"})
    assert r.status_code == 200
    info = r.json()
    assert API_KEY not in r.text and info["api_key"] == "<redacted>"
    assert info["served_model_name"] == MODEL_NAME and info["num_running_reqs"] == 0
    assert info["internal_states"][0]["avg_spec_accept_length"] == 2.5
    assert keyed.get("/get_server_info", headers={"Authorization": f"Bearer {API_KEY}"}).json()[
        "internal_states"] == info["internal_states"]


def test_metrics_are_404_when_disabled_and_prometheus_text_when_enabled(env, keyed):
    r = keyed.get("/metrics", headers={"Authorization": f"Bearer {API_KEY}"})
    assert r.status_code == 404
    client, _, _ = env
    client.post("/generate", json={"text": "a", "sampling_params": {"max_new_tokens": 2}})
    r = client.get("/metrics")
    assert r.status_code == 200 and r.headers["content-type"].startswith("text/plain")
    assert f'specserve_token_usage{{model_name="{MODEL_NAME}"}} 0.125' in r.text  # refreshed
    assert "specserve_requests_total" in r.text


def test_health_is_503_when_the_backend_is_dead(env):
    client, tm, _ = env
    assert client.get("/health").status_code == 200
    assert client.get("/health_generate").status_code == 200
    tm.healthy, tm.dead_reason = False, "scheduler exited"
    r = client.get("/health")
    assert r.status_code == 503 and "scheduler exited" in r.json()["error"]["message"]
    assert client.get("/health_generate").status_code == 503
    for stream in (False, True):
        r = client.post("/generate", json={"text": "a", "stream": stream})
        assert r.status_code == 503 and "scheduler exited" in r.json()["error"]["message"]


def test_backend_death_mid_request_is_503_or_an_error_event(env):
    client, tm, sched = env
    sched.die_after_tokens = 3
    body = {"text": "a", "sampling_params": {"max_new_tokens": 50}}
    r = client.post("/generate", json=body)
    assert r.status_code == 503 and "scheduler died" in r.json()["error"]["message"]
    tm.healthy = True
    with client.stream("POST", "/generate", json={**body, "stream": True}) as r:
        assert r.status_code == 200  # the headers went out with the first token
        events = _sse(r.iter_lines())
    assert events[-1] == "[DONE]" and events[-2]["error"]["code"] == 503
    assert "text" in events[0]


def test_model_info_flush_cache_and_unknown_route(env):
    client, _, sched = env
    for path in ("/model_info", "/get_model_info"):
        info = client.get(path).json()
        assert info["served_model_name"] == MODEL_NAME
        assert info["context_length"] == CONTEXT_LENGTH and info["max_total_tokens"] == 4096
    assert client.post("/flush_cache").status_code == 200
    sched.flush_ok = False
    assert client.post("/flush_cache").status_code == 400
    r = client.get("/no/such/route")
    assert r.status_code == 404 and r.json()["error"]["code"] == 404


def test_abort_request_finishes_a_running_stream_as_abort(env):
    client, _, sched = env
    sched.token_delay = 0.02
    body = {"text": "a", "rid": "to-abort", "stream": True,
            "sampling_params": {"max_new_tokens": 200, "ignore_eos": True}}
    with client.stream("POST", "/generate", json=body) as r:
        lines = r.iter_lines()
        assert _sse([next(lines)])  # running
        assert client.post("/abort_request", json={"rid": "to-abort"}).json()["success"]
        events = _sse(lines)
    assert events[-1] == "[DONE]"
    assert events[-2]["meta_info"]["finish_reason"]["type"] == "abort"
    assert "to-abort" in sched.aborted
    r = client.post("/abort_request", json={"rid": 7})
    assert r.status_code == 400 and r.json()["error"]["param"] == "rid"


def test_disconnect_during_stream_aborts_the_request(env):
    client, _, sched = env
    sched.token_delay = 0.05
    body = {"text": "a", "rid": "gone-stream", "stream": True,
            "sampling_params": {"max_new_tokens": 200, "ignore_eos": True}}
    with client.stream("POST", "/generate", json=body) as r:
        next(r.iter_lines())
    # leaving the block closes the connection mid-stream
    assert wait_for(lambda: "gone-stream" in sched.aborted)
    assert wait_for(lambda: "gone-stream" not in sched.running)


def test_disconnect_during_non_streaming_request_aborts_it(env):
    client, _, sched = env
    sched.token_delay = 0.05
    body = {"text": ["a", "b"], "rid": ["gone-1", "gone-2"],
            "sampling_params": {"max_new_tokens": 200, "ignore_eos": True}}
    with pytest.raises(httpx.ReadTimeout):
        client.post("/generate", json=body, timeout=0.3)
    assert wait_for(lambda: {"gone-1", "gone-2"} <= set(sched.aborted))
    assert wait_for(lambda: not sched.running)


def test_duplicate_rid_in_a_batch_is_400_and_aborts_the_started_item(env):
    client, _, sched = env
    sched.token_delay = 0.05
    for stream in (False, True):
        before = sched.aborted.count("dup")
        body = {"input_ids": [[1], [2]], "rid": ["dup", "dup"], "stream": stream}
        r = client.post("/generate", json=body)
        assert r.status_code == 400 and r.json()["error"]["param"] == "rid"
        assert wait_for(lambda n=before + 1: sched.aborted.count("dup") == n)


def test_huge_max_new_tokens_is_400_not_500(env):
    client, _, sched = env
    before = len(sched.requests)
    body = {"input_ids": [1, 2], "sampling_params": {"max_new_tokens": 10**30,
                                                     "ignore_eos": True}}
    r = client.post("/generate", json=body)  # beyond msgpack's int range and the context
    assert r.status_code == 400, r.text
    assert str(CONTEXT_LENGTH) in r.json()["error"]["message"]
    assert len(sched.requests) == before


def test_sse_response_closes_an_iterator_left_suspended_by_a_disconnect():
    closed = asyncio.Event()
    sent_first = asyncio.Event()

    async def events():
        try:
            for i in range(100):
                yield f"data: {i}\n\n"
        finally:
            closed.set()

    async def receive():
        await sent_first.wait()
        return {"type": "http.disconnect"}

    async def send(message):
        if message.get("body"):
            sent_first.set()
            await asyncio.sleep(3600)  # the client stopped reading: send blocks

    async def main():
        response = SSEResponse(events())
        scope = {"type": "http", "asgi": {"spec_version": "2.3"}}
        await asyncio.wait_for(response(scope, receive, send), 5)
        return closed.is_set()

    assert asyncio.run(main())


def test_integer_fields_take_json_numbers_without_a_fraction(env):
    """`"n": 2.0` is the integer 2 (JSON Schema's "integer"; SGLang's parser takes it), on the
    typed OpenAI fields and in /generate's sampling dict alike; 2.5 and "2" stay 400s."""
    client, _, sched = env
    r = client.post("/v1/completions", json={"prompt": "hi", "max_tokens": 3.0, "n": 2.0,
                                             "seed": 5.0, "top_k": 4.0,
                                             "logprobs": 1.0, "stop_token_ids": [7.0]})
    assert r.status_code == 200, r.text
    assert len(r.json()["choices"]) == 2
    req = sched.requests[-1]
    assert req.sampling_params.max_new_tokens == 3
    assert sorted(q.sampling_params.seed for q in sched.requests[-2:]) == [5, 6]  # seed + j
    assert req.sampling_params.top_k == 4 and req.sampling_params.stop_token_ids == [7]
    r = client.post("/generate", json={"text": "hi", "sampling_params": {
        "max_new_tokens": 2.0, "n": 2.0, "seed": 1.0}})
    assert r.status_code == 200, r.text
    assert len(r.json()) == 2 and sched.requests[-1].sampling_params.max_new_tokens == 2
    r = client.post("/generate", json={"input_ids": [5.0, 6], "sampling_params": {
        "max_new_tokens": 1}})
    assert r.status_code == 200 and sched.requests[-1].input_ids == [5, 6]
    r = client.post("/v1/completions", json={"prompt": [[5.0], [6]], "max_tokens": 1})
    assert r.status_code == 200 and [q.input_ids for q in sched.requests[-2:]] == [[5], [6]]
    for path, body, param in (
            ("/generate", {"input_ids": [5.5]}, "input_ids"),
            ("/v1/completions", {"prompt": [True]}, "prompt"),
            ("/v1/completions", {"prompt": "hi", "n": 2.5}, "n"),
            ("/v1/completions", {"prompt": "hi", "max_tokens": "3"}, "max_tokens"),
            ("/generate", {"text": "hi", "sampling_params": {"max_new_tokens": 2.5}},
             "sampling_params.max_new_tokens"),
            ("/v1/chat/completions", {"messages": [{"role": "user", "content": "hi"}],
                                      "max_tokens": True}, "max_tokens")):
        r = client.post(path, json=body)
        assert r.status_code == 400, (path, body, r.text)
        assert r.json()["error"]["param"] == param


def test_the_fields_sglang_router_adds_are_served_at_its_values_and_others_are_400s(env):
    client, _, _ = env
    router = {"model": None, "return_text_in_logprobs": False, "log_metrics": True,
              "return_hidden_states": False, "background": False, "no_logs": False,
              "return_bytes": False, "return_entropy": False}
    r = client.post("/generate", json={"text": "hi", "sampling_params": {"max_new_tokens": 3},
                                       **router})
    assert r.status_code == 200, r.text
    chat = {"messages": [{"role": "user", "content": "hi"}], "max_completion_tokens": 3,
            "no_stop_trim": False, "ignore_eos": False, "continue_final_message": False,
            "skip_special_tokens": True, "separate_reasoning": True, "stream_reasoning": True,
            "return_hidden_states": False}
    assert client.post("/v1/chat/completions", json=chat).status_code == 200
    comp = {"prompt": "hi", "max_tokens": 3, "echo": False, "no_stop_trim": False,
            "ignore_eos": False, "skip_special_tokens": True, "return_hidden_states": False}
    assert client.post("/v1/completions", json=comp).status_code == 200
    for path, body, field in (("/generate", {"text": "hi", "return_hidden_states": True},
                               "return_hidden_states"),
                              ("/v1/chat/completions", {**chat, "continue_final_message": True},
                               "continue_final_message"),
                              ("/v1/completions", {**comp, "skip_special_tokens": False},
                               "skip_special_tokens")):
        r = client.post(path, json=body)
        assert r.status_code == 400 and r.json()["error"]["param"] == field, r.text
