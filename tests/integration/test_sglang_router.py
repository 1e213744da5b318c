"""specserve as an sglang-router worker: the real router (PyPI `sglang-router`, a Rust binary)
in front of one server on loopback forwards /generate, /v1/completions and
/v1/chat/completions (streamed too) with the fields it adds to every body, and the answers are
the server's own; a field the router passes through at a value we cannot serve is still a
400 naming it."""

from __future__ import annotations

import json
import subprocess
import sys
import time

import httpx
import pytest

from benchmark.common import free_port
from tests.helpers.server_proc import ServerProcess

pytest.importorskip("sglang_router", reason="sglang-router is not installed (pip install -e "
                    "'.[dev]')")
pytestmark = pytest.mark.slow

GREEDY = {"max_new_tokens": 12, "temperature": 0}


@pytest.fixture(scope="module")
def routed():
    srv = ServerProcess("--log-level", "warning", "--speculative-algorithm", "NGRAM")
    port, metrics = free_port(), free_port()
    router = subprocess.Popen(
        [sys.executable, "-m", "sglang_router.launch_router", "--worker-urls", srv.url,
         "--policy", "cache_aware", "--host", "127.0.0.1", "--port", str(port),
         "--prometheus-port", str(metrics), "--log-level", "warn"],
        stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
    url = f"http://127.0.0.1:{port}"
    try:
        deadline = time.monotonic() + 60
        while True:
            try:
                if httpx.get(f"{url}/health", timeout=2).status_code == 200:
                    break
            except httpx.HTTPError:
                pass
            assert router.poll() is None and time.monotonic() < deadline, "router did not start"
            time.sleep(0.3)
        yield srv, url
    finally:
        router.terminate()
        router.wait(timeout=10)
        srv.stop()


def test_the_router_forwards_every_api_and_the_answers_are_the_servers(routed):
    srv, url = routed
    model = httpx.get(f"{url}/v1/models", timeout=10).json()["data"][0]["id"]
    gen = {"text": "The capital of France is", "sampling_params": GREEDY}
    chat = {"model": model, "messages": [{"role": "user", "content": "Name three colours."}],
            "max_tokens": 12, "temperature": 0}
    comp = {"model": model, "prompt": "One, two, three,", "max_tokens": 12, "temperature": 0}
    with httpx.Client(timeout=120) as c:
        for path, body, text in (("/generate", gen, lambda r: r["text"]),
                                 ("/v1/chat/completions", chat,
                                  lambda r: r["choices"][0]["message"]["content"]),
                                 ("/v1/completions", comp, lambda r: r["choices"][0]["text"])):
            via = c.post(url + path, json=body)
            assert via.status_code == 200, via.text
            direct = c.post(srv.url + path, json=body).json()
            assert text(via.json()) == text(direct) and text(direct)
        streamed = []
        with c.stream("POST", url + "/v1/chat/completions", json={**chat, "stream": True}) as r:
            assert r.status_code == 200
            for line in r.iter_lines():
                if line.startswith("data: {"):
                    for choice in json.loads(line[6:])["choices"]:
                        streamed.append(choice["delta"].get("content") or "")
        assert "".join(streamed) == c.post(srv.url + "/v1/chat/completions",
                                           json=chat).json()["choices"][0]["message"]["content"]
        # what the router passes through unchanged is checked as ever
        bad = c.post(url + "/v1/chat/completions", json={**chat, "no_stop_trim": True})
        assert bad.status_code == 400 and bad.json()["error"]["param"] == "no_stop_trim"
    assert srv.wait_idle(timeout_s=30)["kv_used_by_requests"] == 0
