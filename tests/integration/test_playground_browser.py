"""The playground in a real browser (headless Chromium) against a real NGRAM server on the
default model, behind an API key: the page asks for the key, streams an answer whose text is
the API's for the same request, draws draft trees whose accepted paths the target took, and
runs the same prompt without speculation side by side, to the same text. Writes a screenshot
(to $SPECSERVE_PLAYGROUND_SCREENSHOT when set, for the docs)."""

from __future__ import annotations

import os
import time

import pytest

from tests.helpers.browser import (
    chromium,
    js,
    send_prompt,
    severe_console_errors,
    skip_reason,
    wait_answered,
    wait_until,
)
from tests.helpers.server_proc import ServerProcess

pytestmark = pytest.mark.slow
KEY = "playground-key"
MAX_TOKENS = 80
PROMPT = ("Repeat this sentence three times, exactly: The quick brown fox jumps over the "
          "lazy dog near the river bank.")


@pytest.fixture(scope="module")
def server():
    if skip_reason() is not None:
        pytest.skip(skip_reason())
    srv = ServerProcess("--speculative-algorithm", "NGRAM", "--enable-metrics", api_key=KEY)
    yield srv
    assert srv.stop() == 0, srv.read_log()[-3000:]


def api_text(server) -> str:
    """What the API answers to the page's request (greedy; the page's other fields at their
    defaults, sent as the page sends them)."""
    body = {"messages": [{"role": "user", "content": PROMPT}], "temperature": 0, "top_p": 1,
            "max_tokens": MAX_TOKENS, "frequency_penalty": 0, "presence_penalty": 0,
            "repetition_penalty": 1}
    with server.client() as c:
        r = c.post("/v1/chat/completions", json=body)
    assert r.status_code == 200, r.text
    return r.json()["choices"][0]["message"]["content"]


def bodies(d) -> list[str]:
    return js(d, "return [...document.querySelectorAll('.msg.assistant .run .body')]"
                 ".map(b => b.textContent)")


def test_playground_chat_trace_and_side_by_side(server, tmp_path):
    expect = api_text(server)
    with chromium() as d:
        started = time.monotonic()
        d.get(server.url + "/")
        wait_until(d, lambda d: d.find_element("id", "key-bar").is_displayed(), 20,
                   "the API key prompt")
        d.find_element("id", "api-key").send_keys(KEY)
        d.find_element("id", "key-save").click()
        wait_until(d, lambda d: d.find_element("id", "algorithm").text == "NGRAM", 20,
                   "the page to load with the key")
        # the browser logs the 401 that made the page ask for the key (reading empties the log)
        assert all("401" in e for e in severe_console_errors(d))
        field = d.find_element("id", "max_tokens")
        field.clear()
        field.send_keys(str(MAX_TOKENS))

        before = send_prompt(d, PROMPT)
        wait_answered(d, before)
        assert bodies(d) == [expect], "the page shows the API's text"
        accepted = js(d, "return document.querySelectorAll('#trees circle.acc').length")
        assert js(d, "return document.querySelectorAll('#trees svg').length") >= 1
        assert accepted >= 1, "a drawn tree with an accepted path"
        assert js(d, "return document.querySelectorAll('.msg.assistant .tok.d1').length") >= 1
        assert js(d, "return document.querySelectorAll('#histogram rect').length") >= 1

        d.find_element("id", "clear").click()
        d.find_element("id", "compare").click()
        before = send_prompt(d, PROMPT)
        wait_answered(d, before, runs=2)
        assert bodies(d) == [expect, expect]
        assert js(d, "return document.querySelectorAll('.run')[1].dataset.same") == "yes"
        wait_until(d, lambda d: "NGRAM acceptance" in d.find_element("id", "server").text,
                   10, "the server view")
        assert severe_console_errors(d) == []
        shot = os.environ.get("SPECSERVE_PLAYGROUND_SCREENSHOT") or str(tmp_path / "pg.png")
        assert d.save_screenshot(shot)
        assert time.monotonic() - started < 60
