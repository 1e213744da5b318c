"""The playground in a real browser (headless Chromium) against a fake model whose reply is
markup: `<script>`, an `<img onerror>` and tags must show as the characters they are, in the
chat text and in the drawn draft trees, with the speculation trace on and off."""

from __future__ import annotations

import pytest

from tests.helpers.browser import (
    chromium,
    js,
    send_prompt,
    severe_console_errors,
    wait_answered,
    wait_until,
)
from tests.helpers.fake_tm import make_fake_tm
from tests.helpers.live_server import live_server
from tests.helpers.tiny_models import EOS_ID

REPLY = ('<script>window.pwned = 1</script><img src=x onerror="window.pwned = 2">'
         '<b>bold</b> &amp; <a href="javascript:alert(1)">link</a> <style>*{display:none}</style>')


@pytest.fixture(scope="module")
def page_url(tmp_path_factory):
    from specserve.runtime.entrypoints.http_server import create_app

    tm, sched = make_fake_tm(tmp_path_factory.mktemp("tok"))
    sched.reply_ids = tm.tokenize(REPLY) + [EOS_ID]
    sched.tokens_per_step = 3  # verify steps of three tokens: trees to draw
    with live_server(create_app(tm, tm.server_args)) as url:
        yield url


def assistant_texts(driver) -> list[str]:
    return js(driver, "return [...document.querySelectorAll('.msg.assistant .run .body')]"
                      ".map(b => b.textContent)")


def test_model_markup_renders_as_text(page_url):
    with chromium() as d:
        d.get(page_url + "/")
        wait_until(d, lambda d: js(d, "return document.getElementById('status').textContent")
                   == "ready", 20, "the page to load")
        title = d.title
        field = d.find_element("id", "max_tokens")
        field.clear()
        field.send_keys("180")  # the reply is 154 tokens; the fake's context 256
        before = send_prompt(d, "Say something dangerous.")
        wait_answered(d, before)
        assert assistant_texts(d) == [REPLY]
        # the coloured tokens of the traced answer are text, and there were verify steps
        kinds = js(d, "return [...document.querySelectorAll('.msg.assistant .tok')]"
                      ".map(s => s.className)")
        assert "tok bonus" in kinds and any(k.startswith("tok d") for k in kinds)
        assert js(d, "return document.querySelectorAll('#trees svg').length") >= 1
        labels = js(d, "return [...document.querySelectorAll('#trees text')]"
                       ".map(t => t.textContent).join('')")
        assert "<" in labels or "script" in labels, "the trees label nodes with token text"
        assert_no_markup_ran(d, title)
        # the same without the trace (a new conversation: the fake's context holds one turn)
        d.find_element("id", "clear").click()
        js(d, "document.getElementById('trace').click()")
        before = send_prompt(d, "Again, please.")
        wait_answered(d, before)
        assert assistant_texts(d) == [REPLY]
        assert js(d, "return document.querySelectorAll('.msg.assistant .tok').length") == 0
        assert_no_markup_ran(d, title)
        assert severe_console_errors(d) == []


def assert_no_markup_ran(d, title: str) -> None:
    """Nothing the model wrote became an element or ran."""
    found = js(d, "return document.querySelectorAll('#messages *:is(script, img, b, a, "
                  "style), #trees script, #trees foreignObject').length")
    assert found == 0
    assert js(d, "return window.pwned === undefined") and d.title == title
