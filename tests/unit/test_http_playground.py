"""The playground's routes and the HTTP side of the speculation trace, against a real uvicorn
server and a real TokenizerManager whose scheduler is faked (tests/helpers/fake_tm.py; its
"model" gives three tokens a step, as a verify step of a chain that drafted them)."""

from __future__ import annotations

import dataclasses
import json
import re

import httpx
import pytest

from specserve.runtime.entrypoints.http_server import create_app
from specserve.runtime.entrypoints.playground import ASSETS, STATIC
from specserve.runtime.entrypoints.streaming import StreamCursor
from tests.helpers.fake_tm import make_fake_tm
from tests.helpers.live_server import live_server

KEY = "sk-playground"
CHAT = {"messages": [{"role": "user", "content": "hi"}], "max_tokens": 20, "temperature": 0}


@pytest.fixture(scope="module")
def server(tmp_path_factory):
    """(open client, keyed client, tm, scheduler): one tm behind two apps."""
    tm, sched = make_fake_tm(tmp_path_factory.mktemp("tok"))
    sched.tokens_per_step = 3
    keyed_args = dataclasses.replace(tm.server_args, api_key=KEY)
    with live_server(create_app(tm, tm.server_args)) as url, \
            live_server(create_app(tm, keyed_args)) as keyed_url, \
            httpx.Client(base_url=url, timeout=10) as c, \
            httpx.Client(base_url=keyed_url, timeout=10) as k:
        yield c, k, tm, sched


def sse(r: httpx.Response) -> list[dict]:
    return [json.loads(line[6:]) for line in r.iter_lines()
            if line.startswith("data: ") and line != "data: [DONE]"]


def test_page_and_assets_are_served_with_a_strict_content_policy(server):
    c, _, _, _ = server
    r = c.get("/")
    assert r.status_code == 200 and r.headers["content-type"].startswith("text/html")
    assert r.content == (STATIC / "index.html").read_bytes()
    csp = r.headers["content-security-policy"]
    assert "script-src 'self'" in csp and "default-src 'none'" in csp
    assert "unsafe-inline" not in csp
    for name, media_type in ASSETS.items():
        a = c.get(f"/playground/{name}")
        assert a.status_code == 200 and a.headers["content-type"] == media_type
        assert a.content == (STATIC / name).read_bytes()
    assert c.get("/playground/index.html").status_code == 404
    assert c.get("/playground/../http_server.py").status_code == 404


def test_page_is_open_but_every_api_call_needs_the_key(server):
    _, k, _, _ = server
    assert k.get("/").status_code == 200
    assert k.get("/playground/playground.js").status_code == 200
    for path in ("/v1/models", "/server_info"):
        assert k.get(path).status_code == 401
        assert k.get(path, headers={"Authorization": f"Bearer {KEY}"}).status_code == 200
    r = k.post("/v1/chat/completions", json=CHAT)
    assert r.status_code == 401 and r.json()["error"]["type"] == "authentication_error"


def test_disable_playground_serves_no_page(server, tmp_path):
    _, _, tm, _ = server
    args = dataclasses.replace(tm.server_args, disable_playground=True, api_key=KEY)
    with live_server(create_app(tm, args)) as url, httpx.Client(base_url=url) as c:
        assert c.get("/").status_code == 401  # (no longer an open path)
        auth = {"Authorization": f"Bearer {KEY}"}
        assert c.get("/", headers=auth).status_code == 404
        assert c.get("/playground/playground.js", headers=auth).status_code == 404
        assert c.get("/health").status_code == 200


def test_page_script_never_parses_markup():
    """Model text reaches the page through textContent only (the browser test shows it)."""
    js = (STATIC / "playground.js").read_text()
    for sink in ("innerHTML", "outerHTML", "insertAdjacentHTML", "document.write", "eval(",
                 "new Function"):
        assert sink not in js, sink
    html = (STATIC / "index.html").read_text()
    # no inline script or event handler: the content policy would block them
    assert re.findall(r"<script[^>]*>", html) == [
        '<script src="/playground/playground.js" defer>']
    assert not re.search(r"\son[a-z]+\s*=", html)


def check_steps(steps: list[dict], output_ids: list[int], text: str) -> None:
    assert [t for s in steps for t in s["output"]] == output_ids
    assert "".join(p for s in steps for p in s["text"]) == text
    for k, s in enumerate(steps):
        assert s["start"] == sum(len(x["output"]) for x in steps[:k])
        assert len(s["text"]) == len(s["output"]) and s["step_ms"] > 0
        tree = s["tree"]
        if tree is None:
            continue
        n = len(tree["tokens"])
        assert len(tree["parents"]) == len(tree["texts"]) == n and tree["parents"][0] == -1
        acc = tree["accepted"]
        assert [tree["tokens"][u] for u in acc[1:]] + [tree["bonus"]] == s["output"]


def test_generate_returns_the_trace_and_nothing_unless_asked(server):
    c, _, _, sched = server
    body = {"text": "hello", "sampling_params": {"max_new_tokens": 10, "temperature": 0}}
    plain = c.post("/generate", json=body).json()
    assert "spec_trace" not in plain["meta_info"]
    r = c.post("/generate", json={**body, "return_spec_trace": True}).json()
    steps = r["meta_info"]["spec_trace"]
    assert r["text"] == plain["text"] and any(s["tree"] for s in steps)
    check_steps(steps, r["output_ids"], r["text"])
    chunks = sse(c.post("/generate", json={**body, "return_spec_trace": True,
                                           "stream": True}))
    assert chunks[-1]["meta_info"]["spec_trace"] == steps  # cumulative, like the text
    assert sched.requests[-1].spec_trace and not sched.requests[-3].spec_trace


def test_incremental_streams_cut_the_trace_by_steps():
    cursor = StreamCursor()
    steps = [{"start": 0, "output": [1, 2]}, {"start": 2, "output": [3]}]
    a = cursor.cut({"text": "ab", "output_ids": [1, 2], "meta_info": {"spec_trace": steps[:1]}})
    b = cursor.cut({"text": "abc", "output_ids": [1, 2, 3], "meta_info": {"spec_trace": steps}})
    assert a["meta_info"]["spec_trace"] == steps[:1] and b["meta_info"]["spec_trace"] == steps[1:]
    assert b["output_ids"] == [3] and b["text"] == "c"


def test_chat_streams_new_steps_with_each_event(server):
    c, _, _, _ = server
    events = sse(c.post("/v1/chat/completions",
                        json={**CHAT, "stream": True, "return_spec_trace": True}))
    steps = [s for e in events for ch in e["choices"] for s in ch.get("spec_trace", [])]
    text = "".join(ch["delta"].get("content", "") for e in events for ch in e["choices"])
    final = c.post("/v1/chat/completions", json={**CHAT, "return_spec_trace": True}).json()
    choice = final["choices"][0]
    assert choice["message"]["content"] == text
    assert choice["spec_trace"] == steps
    assert sum(len(s["output"]) for s in steps) == final["usage"]["completion_tokens"]
    check_steps(steps, [t for s in steps for t in s["output"]],
                "".join(p for s in steps for p in s["text"]))
    assert "".join(p for s in steps for p in s["text"]).startswith(text)
    plain = c.post("/v1/chat/completions", json=CHAT).json()
    assert "spec_trace" not in plain["choices"][0]


def test_disable_speculation_travels_and_bad_flags_are_400s(server):
    c, _, _, sched = server
    r = c.post("/v1/chat/completions", json={**CHAT, "disable_speculation": True})
    assert r.status_code == 200 and sched.requests[-1].disable_speculation
    r = c.post("/generate", json={"text": "x", "disable_speculation": True})
    assert r.status_code == 200 and sched.requests[-1].disable_speculation
    for body in ({**CHAT, "return_spec_trace": "yes"}, {**CHAT, "disable_speculation": 1},
                 {"text": "x", "return_spec_trace": None}):
        path = "/generate" if "text" in body else "/v1/chat/completions"
        r = c.post(path, json=body)
        assert r.status_code == 400, body
        field = r.json()["error"]["param"]
        assert field in ("return_spec_trace", "disable_speculation")
