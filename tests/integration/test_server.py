"""A real server (three processes, default model) driven over HTTP."""

from __future__ import annotations

import asyncio
import json
import os
import signal
import threading
import time

import httpx
import pytest

from specserve.runtime.model_loader.default_model import resolve_model_path
from specserve.runtime.model_loader.tokenizer import apply_chat_template, load_tokenizer
from tests.helpers.near_tie import NearTieJudge
from tests.helpers.server_proc import ServerProcess, children_of, pid_alive

pytestmark = pytest.mark.slow
KEY = "test-key"

TOPICS = ["the ocean", "a bicycle", "volcanoes", "chess", "bread", "the moon", "rainforests",
          "trains", "honeybees", "glaciers", "jazz", "the internet", "coffee", "deserts",
          "penguins", "libraries"]


def chat_prompts(n: int) -> list[list[int]]:
    tok = load_tokenizer(resolve_model_path(None))
    asks = ["Write two sentences about {}.", "Give three facts about {}."]
    msgs = [asks[i % 2].format(TOPICS[i % len(TOPICS)]) for i in range(n)]
    return [apply_chat_template(tok, [{"role": "user", "content": m}]) for m in msgs]


@pytest.fixture(scope="module")
def server():
    srv = ServerProcess("--enable-metrics", "--max-running-requests", "32", api_key=KEY)
    yield srv
    assert srv.stop() == 0, srv.read_log()[-3000:]


def generate(srv, ids, max_new=32, **sp):
    with srv.client() as c:
        r = c.post("/generate", json={"input_ids": ids, "sampling_params": {
            "max_new_tokens": max_new, "temperature": 0, **sp}})
    assert r.status_code == 200, r.text
    return r.json()


def test_openai_client_chat_and_completions(server):
    openai = pytest.importorskip("openai")
    client = openai.OpenAI(base_url=f"{server.url}/v1", api_key=KEY)
    model = client.models.list().data[0].id
    chat = client.chat.completions.create(
        model=model, messages=[{"role": "user", "content": "Say hello."}], max_tokens=12,
        temperature=0,
    )
    assert chat.choices[0].message.content and chat.usage.completion_tokens > 0
    streamed = "".join(
        (c.choices[0].delta.content or "") for c in client.chat.completions.create(
            model=model, messages=[{"role": "user", "content": "Say hello."}], max_tokens=12,
            temperature=0, stream=True) if c.choices
    )
    assert streamed == chat.choices[0].message.content
    comp = client.completions.create(model=model, prompt="Once upon a time", max_tokens=10,
                                     temperature=0)
    assert comp.choices[0].text and comp.usage.prompt_tokens > 0
    pieces = [c.choices[0].text for c in client.completions.create(
        model=model, prompt="Once upon a time", max_tokens=10, temperature=0, stream=True)]
    assert "".join(pieces) == comp.choices[0].text


def test_32_concurrent_streams_equal_sequential_outputs(server):
    prompts = chat_prompts(32)
    sequential = [generate(server, p)["output_ids"] for p in prompts]

    async def stream_one(client, ids):
        out = None
        async with client.stream("POST", "/generate", json={
            "input_ids": ids, "stream": True,
            "sampling_params": {"max_new_tokens": 32, "temperature": 0}}) as r:
            assert r.status_code == 200
            async for line in r.aiter_lines():
                if line.startswith("data: ") and line != "data: [DONE]":
                    out = json.loads(line[6:])
        return out["output_ids"]

    async def run_all():
        async with httpx.AsyncClient(base_url=server.url, headers=server.headers,
                                     timeout=300) as client:
            return await asyncio.gather(*(stream_one(client, p) for p in prompts))

    concurrent = asyncio.run(run_all())
    judge = NearTieJudge()
    for p, a, b in zip(prompts, sequential, concurrent):
        ok, why = judge.check(p, a, b)
        assert ok, why
    print(judge.report())


def test_disconnects_abort_and_free_kv(server):
    with server.client() as c:
        with c.stream("POST", "/generate", json={
            "text": "Tell me a very long story.", "stream": True,
            "sampling_params": {"max_new_tokens": 2000, "ignore_eos": True}}) as r:
            for i, _ in enumerate(r.iter_lines()):
                if i > 5:
                    break  # closing the stream disconnects the client
    with pytest.raises(httpx.ReadTimeout):
        with httpx.Client(base_url=server.url, headers=server.headers, timeout=1.0) as c:
            c.post("/generate", json={"text": "Count to a thousand.", "sampling_params": {
                "max_new_tokens": 2000, "ignore_eos": True}})
    info = server.wait_idle(timeout_s=10)
    assert info["kv_used_by_requests"] == 0 and info["aborted"] >= 2
    with server.client() as c:
        assert c.post("/flush_cache").status_code == 200
    assert server.server_info()["kv_free"] == server.server_info()["kv_capacity"]


BAD_INPUTS = [
    ("/generate", b"{not json", "body"),
    ("/generate", {"text": 5}, "text"),
    ("/generate", {"text": "hi", "sampling_params": {"max_new_tokens": 4, "nope": 1}}, "nope"),
    ("/generate", {"text": "hi", "sampling_params": {"max_new_tokens": -1}}, "max_new_tokens"),
    ("/generate", {"text": "hi", "sampling_params": {"temperature": -0.5}}, "temperature"),
    ("/generate", {"text": "hi", "sampling_params": {"top_p": 1.5}}, "top_p"),
    ("/generate", {"text": ""}, "text"),
    ("/generate", {"text": "word " * 9000}, "prompt"),
    ("/v1/completions", {"prompt": "hi", "max_tokens": 0}, "max_tokens"),
    ("/v1/chat/completions", {"messages": [], "max_tokens": 5}, "messages"),
    ("/v1/chat/completions", {"messages": [{"role": "user", "content": "hi"}],
                              "top_logprobs": 3}, "top_logprobs"),
    ("/generate", {"text": "hi", "return_logprob": True, "logprob_start_len": 99},
     "logprob_start_len"),
]


def test_bad_inputs_get_400_while_a_good_request_completes(server):
    async def run():
        async with httpx.AsyncClient(base_url=server.url, headers=server.headers,
                                     timeout=120) as client:
            good = asyncio.create_task(client.post("/generate", json={
                "text": "List five fruits.",
                "sampling_params": {"max_new_tokens": 48, "temperature": 0}}))
            results = []
            for path, body, field in BAD_INPUTS:
                kw = {"content": body} if isinstance(body, bytes) else {"json": body}
                r = await client.post(path, **kw)
                results.append((path, field, r.status_code, r.json()))
            return (await good), results

    good, results = asyncio.run(run())
    for path, field, status, body in results:
        assert status == 400, (path, field, body)
        assert field in json.dumps(body["error"]), (field, body)
    assert good.status_code == 200 and good.json()["meta_info"]["completion_tokens"] > 0


def test_auth_and_size_limits(server):
    r = httpx.post(f"{server.url}/generate", json={"text": "hi"})
    assert r.status_code == 401
    r = httpx.post(f"{server.url}/generate", json={"text": "hi"},
                   headers={"Authorization": "Bearer wrong"})
    assert r.status_code == 401
    assert httpx.get(f"{server.url}/health").status_code == 200
    with server.client() as c:
        r = c.post("/generate", content=b"x" * (5 * 1024 * 1024),
                   headers={"Content-Type": "application/json"})
        assert r.status_code == 413
        metrics = c.get("/metrics").text
    assert "specserve_time_to_first_token_seconds_bucket" in metrics
    assert "specserve_num_running_reqs" in metrics


def test_repeated_long_prompt_hits_the_radix_cache(server):
    with server.client() as c:
        assert c.post("/flush_cache").status_code == 200
    text = " ".join(f"Item {i}: a note about topic number {i}." for i in range(90))

    def ttft() -> tuple[float, dict]:
        t0 = time.perf_counter()
        first = None
        final = None
        with server.client() as c:
            with c.stream("POST", "/generate", json={
                "text": text, "stream": True,
                "sampling_params": {"max_new_tokens": 4, "temperature": 0}}) as r:
                for line in r.iter_lines():
                    if line.startswith("data: {"):
                        first = first or time.perf_counter() - t0
                        final = json.loads(line[6:])
        return first, final["meta_info"]

    cold, meta_cold = ttft()
    warm, meta_warm = ttft()
    assert meta_cold["cached_tokens"] == 0
    assert meta_warm["cached_tokens"] >= meta_cold["prompt_tokens"] - 1
    assert warm < cold


def test_n_samples_prefill_their_prompt_once(server):
    """/generate's SGLang `n` and /v1/completions' `n`: the samples after the first start
    once its prompt is prefilled and take the prompt from the prefix cache."""
    text = " ".join(f"Step {i}: check the valve on line {i} twice." for i in range(30))
    for path, body in (("/generate", {"text": text, "sampling_params": {
            "n": 3, "max_new_tokens": 4, "temperature": 0.8, "seed": 1}}),
            ("/v1/completions", {"prompt": text + " Done.", "n": 3, "max_tokens": 4,
                                 "temperature": 0.8, "seed": 1})):
        with server.client() as c:
            assert c.post("/flush_cache").status_code == 200
            before = c.get("/server_info").json()
            r = c.post(path, json=body)
            assert r.status_code == 200, r.text
            info = c.get("/server_info").json()
        out = r.json()
        if path == "/generate":
            assert len(out) == 3
            cached = [o["meta_info"]["cached_tokens"] for o in out]
            n_prompt = out[0]["meta_info"]["prompt_tokens"]
            assert cached[0] == 0 and cached[1:] == [n_prompt - 1] * 2
        else:
            assert len(out["choices"]) == 3
            n_prompt = out["usage"]["prompt_tokens"]
        assert info["cached_tokens"] - before["cached_tokens"] == 2 * (n_prompt - 1)
        assert info["kv_used_by_requests"] == 0


def test_killing_the_model_runner_stops_the_launcher_with_no_orphans():
    srv = ServerProcess("--max-total-tokens", "4096")
    launcher = srv.proc.pid
    kids = children_of(launcher)
    assert len(kids) >= 2, kids
    with srv.client() as c:
        runner = c.get("/model_info").json()["runner_pid"]
    assert runner in kids
    with srv.client() as c:
        pending = c.build_request("POST", "/generate", json={
            "text": "Write a long essay.", "sampling_params": {"max_new_tokens": 3000,
                                                              "ignore_eos": True}})
        result = {}
        t = threading.Thread(target=lambda: result.setdefault("r", _send(c, pending)))
        t.start()
        time.sleep(1.0)
        t_kill = time.monotonic()
        os.kill(runner, signal.SIGKILL)
        code = srv.proc.wait(10)
        elapsed = time.monotonic() - t_kill
        t.join(10)
    assert code != 0
    assert elapsed < 5.0, f"launcher took {elapsed:.1f}s to exit"
    assert "model_runner" in srv.read_log()
    time.sleep(0.5)
    assert not any(pid_alive(p) for p in kids), "orphaned child processes"
    r = result.get("r")
    assert r is None or isinstance(r, Exception) or r.status_code >= 500


def _send(client, request):
    try:
        return client.send(request)
    except Exception as exc:  # noqa: BLE001 - the connection may simply drop
        return exc
