"""bench_serving against a fake streaming server in this process: metric definitions, token
counting (server-reported vs tokenized), failure counting, concurrency limits, and the CLI."""

from __future__ import annotations

import asyncio
import json
import socket
import threading
import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest
import uvicorn
from fastapi import FastAPI, Request
from fastapi.responses import JSONResponse, StreamingResponse

from benchmark import bench_serving
from benchmark.bench_serving import BenchConfig, run_benchmark
from benchmark.serving_metrics import RequestRecord, compute_metrics
from specserve.corpora.datasets import BenchRequest

TTFT_S, ITL_S = 0.2, 0.05
TOL_S = 0.15  # scheduling slack on a loaded 2-core machine


class WordTokenizer:
    all_special_ids: list[int] = []

    def __len__(self) -> int:
        return 100

    def encode(self, text: str, add_special_tokens: bool = True) -> list[int]:
        return [len(w) for w in text.split()]

    def decode(self, ids: list[int]) -> str:
        return " ".join("w" * i for i in ids)

    def apply_chat_template(self, messages: list[dict[str, str]], tokenize: bool = True,
                            **_: Any) -> Any:
        text = " ".join(f"<{m['role']}> {m['content']}" for m in messages) + " <assistant>"
        return self.encode(text) if tokenize else text


def sse(obj: Any) -> str:
    return f"data: {json.dumps(obj) if not isinstance(obj, str) else obj}\n\n"


def make_app(received: list[dict[str, Any]]) -> FastAPI:
    """/generate streams 2 tokens per chunk (like speculative decoding); the OpenAI routes one
    per chunk. A prompt containing BAD gets a 400, ERRCHUNK an error chunk mid-stream, NOUSAGE
    no usage chunk."""
    app = FastAPI()

    def prompt_text(body: dict[str, Any]) -> str:
        return json.dumps([body.get(k) for k in ("text", "input_ids", "prompt", "messages")])

    @app.post("/generate")
    async def generate(request: Request) -> Any:
        body = await request.json()
        received.append(body)
        if "BAD" in prompt_text(body):
            return JSONResponse({"error": "bad prompt"}, status_code=400)
        n = body["sampling_params"]["max_new_tokens"]

        async def stream() -> Any:
            await asyncio.sleep(TTFT_S)
            done = 0
            while done < n:
                done = min(n, done + 2)
                meta: dict[str, Any] = {"prompt_tokens": 11, "completion_tokens": done,
                                        "finish_reason": None}
                if done == n:
                    meta.update(finish_reason={"type": "length", "length": n},
                                spec_accept_length=2.0)
                yield sse({"text": " ".join(["tok"] * done), "meta_info": meta})
                if "ERRCHUNK" in prompt_text(body):
                    yield sse({"error": {"message": "boom"}})
                    return
                if done < n:
                    await asyncio.sleep(ITL_S)
            yield sse("[DONE]")

        return StreamingResponse(stream(), media_type="text/event-stream")

    @app.get("/server_info")
    async def server_info() -> dict[str, Any]:
        return {"internal_states": [{"avg_spec_accept_length": 2.5}]}

    @app.get("/v1/models")
    async def models() -> dict[str, Any]:
        return {"data": [{"id": "fake-model"}]}

    async def openai_stream(request: Request, chat: bool) -> Any:
        body = await request.json()
        received.append(body)
        if "BAD" in prompt_text(body) or body["model"] != "fake-model":
            return JSONResponse({"error": "bad"}, status_code=400)
        n = body["max_tokens"]

        async def stream() -> Any:
            if chat:
                yield sse({"choices": [{"index": 0, "delta": {"role": "assistant"}}]})
            await asyncio.sleep(TTFT_S)
            for k in range(n):
                piece = ("" if k == 0 else " ") + "word"
                choice = {"index": 0, "delta": {"content": piece}} if chat else {
                    "index": 0, "text": piece}
                choice["finish_reason"] = "length" if k == n - 1 else None
                yield sse({"choices": [choice]})
                if k < n - 1:
                    await asyncio.sleep(ITL_S)
            if "NOUSAGE" not in prompt_text(body):
                usage = {"prompt_tokens": 7, "completion_tokens": n, "total_tokens": 7 + n}
                yield sse({"choices": [], "usage": usage})
            yield sse("[DONE]")

        return StreamingResponse(stream(), media_type="text/event-stream")

    @app.post("/v1/completions")
    async def completions(request: Request) -> Any:
        return await openai_stream(request, chat=False)

    @app.post("/v1/chat/completions")
    async def chat_completions(request: Request) -> Any:
        return await openai_stream(request, chat=True)

    return app


@pytest.fixture(scope="module")
def fake_server() -> Iterator[tuple[str, list[dict[str, Any]]]]:
    received: list[dict[str, Any]] = []
    sock = socket.socket()
    sock.bind(("127.0.0.1", 0))
    port = sock.getsockname()[1]
    server = uvicorn.Server(uvicorn.Config(make_app(received), log_level="warning",
                                           lifespan="off", loop="asyncio"))
    thread = threading.Thread(target=server.run, kwargs={"sockets": [sock]}, daemon=True)
    thread.start()
    deadline = time.monotonic() + 20
    while not server.started:
        assert time.monotonic() < deadline, "fake server did not start"
        time.sleep(0.02)
    yield f"http://127.0.0.1:{port}", received
    server.should_exit = True
    thread.join(timeout=5)
    sock.close()


def prompts(*texts: str, max_new_tokens: int = 5) -> list[BenchRequest]:
    return [BenchRequest(id=f"r{i}", prompt_len=len(t.split()), prompt=t,
                         max_new_tokens=max_new_tokens) for i, t in enumerate(texts)]


def run(reqs: list[BenchRequest], **cfg: Any) -> dict[str, Any]:
    config = BenchConfig(disable_tqdm=True, warmup_requests=0, **cfg)
    return asyncio.run(run_benchmark(reqs, config, WordTokenizer()))


def test_specserve_stream_metrics_failures_and_accept_length(fake_server) -> None:
    url, received = fake_server
    reqs = prompts("a b", "c d e", "this is BAD", "ERRCHUNK here")
    reqs.append(BenchRequest(id="chat", prompt_len=5, max_new_tokens=5,
                             messages=[{"role": "user", "content": "hi there"}]))
    received.clear()
    out = run(reqs, base_url=url, ignore_eos=True)
    m, recs = out["metrics"], {r.id: r for r in out["records"]}
    assert (m["completed"], m["failed"]) == (3, 2)
    assert "HTTP 400" in recs["r2"].error and "boom" in recs["r3"].error
    for r in (recs["r0"], recs["r1"], recs["chat"]):
        assert r.success and r.output_len == 5 and r.output_len_source == "server"
        assert r.prompt_len == 11  # the server's count wins over the dataset's
        assert r.num_chunks == 3 and len(r.itl) == 2  # chunks of 2, 2, 1 tokens
        assert TTFT_S <= r.ttft < TTFT_S + TOL_S
        assert all(ITL_S - 0.005 <= g < ITL_S + TOL_S for g in r.itl)
        assert r.e2e == pytest.approx(r.ttft + sum(r.itl), abs=TOL_S)
        assert r.finish_reason == "length" and r.output_len_retokenized == 5
    assert m["total_output_tokens"] == 15 and m["total_input_tokens"] == 33
    assert TTFT_S * 1000 <= m["ttft_ms"]["median"] < (TTFT_S + TOL_S) * 1000
    expected_tpot = [(r.e2e - r.ttft) / 4 * 1000 for r in (recs["r0"], recs["r1"], recs["chat"])]
    assert m["tpot_ms"]["mean"] == pytest.approx(sum(expected_tpot) / 3)
    assert m["avg_spec_accept_length"] == 2.5 and m["mean_spec_accept_length"] == 2.0
    assert out["server_info"]["internal_states"][0]["avg_spec_accept_length"] == 2.5
    bodies = {json.dumps(b.get("text")): b for b in received}
    assert bodies['"a b"']["sampling_params"] == {"max_new_tokens": 5, "temperature": 0.0,
                                                  "ignore_eos": True}
    chat_body = next(b for b in received if "input_ids" in b)
    assert chat_body["input_ids"] == WordTokenizer().apply_chat_template(reqs[-1].messages)
    assert all(b["stream"] is True for b in received)


@pytest.mark.parametrize("endpoint", ["chat", "completions"])
def test_openai_streams_count_usage_or_tokenize(fake_server, endpoint: str) -> None:
    url, received = fake_server
    received.clear()
    out = run(prompts("one two", "NOUSAGE please", "BAD one", max_new_tokens=4),
              base_url=url, backend="openai", endpoint=endpoint, api_key="k")
    m, recs = out["metrics"], {r.id: r for r in out["records"]}
    assert (m["completed"], m["failed"]) == (2, 1)
    assert (recs["r0"].output_len, recs["r0"].output_len_source) == (4, "server")
    assert (recs["r1"].output_len, recs["r1"].output_len_source) == (4, "tokenizer")
    assert recs["r0"].prompt_len == 7 and recs["r1"].prompt_len == 2
    for r in (recs["r0"], recs["r1"]):
        assert TTFT_S <= r.ttft < TTFT_S + TOL_S  # a role-only first chunk is not a token
        assert r.generated_text == "word word word word" and len(r.itl) == 3
    assert out["server_info"] is None and m["avg_spec_accept_length"] is None
    key = "messages" if endpoint == "chat" else "prompt"
    assert all(key in b and b["model"] == "fake-model" for b in received)
    assert all(b["stream_options"] == {"include_usage": True} for b in received)


def test_max_concurrency_one_serialises_requests(fake_server) -> None:
    url, _ = fake_server
    out = run(prompts("a", "b", "c", max_new_tokens=1), base_url=url, max_concurrency=1,
              request_rate=50.0)
    recs = sorted(out["records"], key=lambda r: r.start)
    assert all(r.success for r in recs)
    for prev, nxt in zip(recs, recs[1:]):
        assert nxt.start >= prev.start + prev.e2e - 0.01
    m = out["metrics"]
    assert m["duration_s"] >= 3 * TTFT_S
    assert 0.8 < m["concurrency"] <= 1.0 + 1e-6
    assert m["tpot_ms"]["mean"] == 0.0  # one output token: no TPOT samples


def test_failing_warmup_raises_and_unreachable_server_fails_fast() -> None:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]  # closed again before the benchmark runs
    config = BenchConfig(base_url=f"http://127.0.0.1:{port}", disable_tqdm=True)
    with pytest.raises(RuntimeError, match="warm-up"):
        asyncio.run(run_benchmark(prompts("a"), config, WordTokenizer()))


def test_compute_metrics_follows_sglang_definitions() -> None:
    def rec(ttft: float, e2e: float, out: int, itl: list[float], ok: bool = True) -> RequestRecord:
        return RequestRecord(id="x", prompt_len=10, success=ok, output_len=out, ttft=ttft,
                             e2e=e2e, itl=itl)

    recs = [rec(0.1, 1.1, 11, [0.1] * 10), rec(0.3, 0.3, 1, []), rec(0.2, 2.2, 5, [0.5] * 4),
            rec(9.0, 9.0, 100, [], ok=False)]
    m = compute_metrics(recs, duration_s=4.0)
    assert (m["completed"], m["failed"]) == (3, 1)
    assert (m["total_input_tokens"], m["total_output_tokens"]) == (30, 17)
    assert m["request_throughput"] == pytest.approx(0.75)
    assert m["output_throughput"] == pytest.approx(17 / 4)
    assert m["concurrency"] == pytest.approx((1.1 + 0.3 + 2.2) / 4)
    assert m["tpot_ms"]["mean"] == pytest.approx((100.0 + 500.0) / 2)  # 1-token request skipped
    assert m["ttft_ms"]["median"] == pytest.approx(200.0)
    assert m["itl_ms"]["mean"] == pytest.approx((10 * 100 + 4 * 500) / 14)
    assert m["e2e_ms"]["p90"] == pytest.approx(1100 + 0.8 * 1100)  # linear interpolation
    assert compute_metrics([], 1.0)["ttft_ms"]["p99"] == 0.0


def test_cli_writes_json_and_prints_table_last(fake_server, tmp_path: Path, monkeypatch,
                                               capsys) -> None:
    url, _ = fake_server
    data = tmp_path / "p.jsonl"
    data.write_text('{"prompt": "x y"}\n{"messages": [{"role": "user", "content": "z"}]}\n')
    monkeypatch.setattr(bench_serving, "load_bench_tokenizer", lambda path: WordTokenizer())
    rc = bench_serving.main(["--base-url", url, "--dataset", "custom", "--dataset-path",
                             str(data), "--max-new-tokens", "3", "--disable-tqdm",
                             "--output", str(tmp_path / "out.json")])
    assert rc == 0
    result = json.loads((tmp_path / "out.json").read_text())
    assert result["metrics"]["completed"] == 2 and len(result["requests"]) == 2
    assert result["requests"][0]["output_len"] == 3
    assert result["config"]["request_rate"] == "inf"
    lines = capsys.readouterr().out.strip().splitlines()
    assert lines[-4].strip().startswith("TTFT") and lines[-1].strip().startswith("E2E")


def test_logprobs_ask_each_api_in_its_own_words() -> None:
    tok = WordTokenizer()
    req = BenchRequest(id="r", prompt="one two", max_new_tokens=4, prompt_len=2)
    native = bench_serving.build_call(req, BenchConfig(logprobs=3), tok, "m").payload
    assert native["return_logprob"] is True and native["top_logprobs_num"] == 3
    chat = bench_serving.build_call(req, BenchConfig(backend="openai", logprobs=2), tok,
                                    "m").payload
    assert chat["logprobs"] is True and chat["top_logprobs"] == 2
    cmpl = bench_serving.build_call(
        req, BenchConfig(backend="openai", endpoint="completions", logprobs=0), tok, "m").payload
    assert cmpl["logprobs"] == 0
    plain = bench_serving.build_call(req, BenchConfig(), tok, "m").payload
    assert "return_logprob" not in plain


def test_stream_state_reads_cumulative_and_incremental_generate_chunks() -> None:
    """A /generate stream's chunks hold everything so far, or (a server with
    --incremental-streaming-output) only what is new: fewer ids than completion_tokens. Both
    give the same text, token count and token arrivals."""
    pieces = [("He", [1]), ("llo", [2, 3]), ("", [4]), (" you", [5])]
    cum, inc = bench_serving._StreamState("specserve"), bench_serving._StreamState("specserve")
    text, ids, grew_c, grew_i = "", [], [], []
    for piece, new in pieces:
        text, ids = text + piece, ids + new
        meta = {"completion_tokens": len(ids), "prompt_tokens": 3, "finish_reason": None}
        grew_c.append(cum.update({"text": text, "output_ids": ids, "meta_info": meta}))
        grew_i.append(inc.update({"text": piece, "output_ids": new, "meta_info": meta}))
    assert cum.text == inc.text == "Hello you"
    assert cum.completion_tokens == inc.completion_tokens == 5
    assert grew_c == grew_i == [True, True, True, True]
