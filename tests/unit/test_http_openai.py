"""OpenAI-compatible endpoints, driven by the official `openai` client against a real uvicorn
server (a real TokenizerManager over a fake scheduler)."""

from __future__ import annotations

import time

import httpx
import openai
import pytest

from specserve.runtime.entrypoints.http_server import create_app
from tests.helpers.fake_tm import MODEL_NAME, make_fake_tm
from tests.helpers.live_server import live_server

API_KEY = "sk-openai-test"
MESSAGES = [{"role": "system", "content": "be brief"}, {"role": "user", "content": "hello"}]


@pytest.fixture(scope="module")
def env(tmp_path_factory):
    """(openai client, raw httpx client, tm, scheduler)"""
    tm, sched = make_fake_tm(tmp_path_factory.mktemp("tok"), api_key=API_KEY)
    with live_server(create_app(tm, tm.server_args)) as url:
        oai = openai.OpenAI(base_url=f"{url}/v1", api_key=API_KEY, max_retries=0, timeout=10)
        headers = {"Authorization": f"Bearer {API_KEY}"}
        with httpx.Client(base_url=url, headers=headers, timeout=10) as raw:
            yield oai, raw, tm, sched


@pytest.fixture(autouse=True)
def _fast(env):
    env[3].token_delay = 0.0


def test_models_lists_the_served_model(env):
    oai, _, tm, _ = env
    models = oai.models.list().data
    assert [m.id for m in models] == [MODEL_NAME]


def test_chat_completion_with_n_choices_and_usage(env):
    oai, _, tm, _ = env
    resp = oai.chat.completions.create(model=MODEL_NAME, messages=MESSAGES, max_tokens=6, n=2,
                                       seed=3)
    assert resp.object == "chat.completion" and resp.model == MODEL_NAME
    assert resp.id.startswith("chatcmpl-")
    assert [c.index for c in resp.choices] == [0, 1]
    assert all(c.message.role == "assistant" and c.finish_reason == "length"
               for c in resp.choices)
    assert resp.choices[0].message.content != resp.choices[1].message.content  # seed + i
    prompt_tokens = len(tm.chat_ids(MESSAGES, add_generation_prompt=True))
    assert resp.usage.prompt_tokens == prompt_tokens
    assert resp.usage.completion_tokens == 12 and resp.usage.total_tokens == prompt_tokens + 12
    again = oai.chat.completions.create(model=MODEL_NAME, messages=MESSAGES, max_tokens=6, n=2,
                                        seed=3)
    assert [c.message.content for c in again.choices] == [
        c.message.content for c in resp.choices]  # reproducible


def test_chat_stream_deltas_rebuild_the_full_message(env):
    oai, _, _, _ = env
    full = oai.chat.completions.create(model=MODEL_NAME, messages=MESSAGES, max_tokens=200)
    assert full.choices[0].finish_reason == "stop"  # the fake's reply ends with EOS
    stream = oai.chat.completions.create(model=MODEL_NAME, messages=MESSAGES, max_tokens=200,
                                         stream=True, stream_options={"include_usage": True})
    chunks = list(stream)
    assert all(c.object == "chat.completion.chunk" for c in chunks)
    assert chunks[0].choices[0].delta.role == "assistant"
    deltas = [c.choices[0].delta.content or "" for c in chunks if c.choices]
    assert all("\ufffd" not in d for d in deltas)
    assert "".join(deltas) == full.choices[0].message.content
    reasons = [c.choices[0].finish_reason for c in chunks if c.choices]
    assert reasons[-1] == "stop" and not any(reasons[:-1])
    assert chunks[-1].choices == [] and chunks[-1].usage.total_tokens == full.usage.total_tokens


def test_completions_stream_and_non_stream_with_n(env):
    oai, _, tm, _ = env
    resp = oai.completions.create(model=MODEL_NAME, prompt=["hi", "hello world"], n=2, seed=0)
    assert resp.object == "text_completion" and [c.index for c in resp.choices] == [0, 1, 2, 3]
    assert all(c.finish_reason == "length" for c in resp.choices)  # OpenAI default max_tokens 16
    assert resp.usage.completion_tokens == 4 * 16
    assert resp.usage.prompt_tokens == len(tm.tokenize("hi")) + len(tm.tokenize("hello world"))
    stream = oai.completions.create(model=MODEL_NAME, prompt="hi", n=2, seed=0, max_tokens=16,
                                    stream=True)
    texts = ["", ""]
    for chunk in stream:
        for c in chunk.choices:
            texts[c.index] += c.text
    assert texts == [resp.choices[0].text, resp.choices[1].text]
    by_ids = oai.completions.create(model=MODEL_NAME, prompt=tm.tokenize("hi"), seed=0)
    assert by_ids.choices[0].text == resp.choices[0].text


def test_ignored_parameters_do_not_change_the_output(env):
    oai, _, _, _ = env
    base = oai.completions.create(model=MODEL_NAME, prompt="hi", max_tokens=8, temperature=0)
    same = oai.completions.create(model=MODEL_NAME, prompt="hi", max_tokens=8, temperature=0,
                                  user="u1", echo=False, best_of=1, suffix="", logit_bias={},
                                  logprobs=0)
    assert same.choices[0].text == base.choices[0].text
    chat = oai.chat.completions.create(model=MODEL_NAME, messages=MESSAGES, max_tokens=8,
                                       temperature=0)
    chat_same = oai.chat.completions.create(
        model=MODEL_NAME, messages=MESSAGES, max_completion_tokens=8, temperature=0, user="u1",
        store=False, metadata={"k": "v"}, response_format={"type": "text"}, tool_choice="none")
    assert chat_same.choices[0].message.content == chat.choices[0].message.content


def test_completion_logprobs_echo_and_stream(env):
    oai, _, tm, _ = env
    resp = oai.completions.create(model=MODEL_NAME, prompt="hello world", max_tokens=8,
                                  logprobs=2)
    lp = resp.choices[0].logprobs
    assert len(lp.tokens) == 8 == resp.usage.completion_tokens
    assert "".join(lp.tokens) == resp.choices[0].text  # this reply has no multi-byte tokens
    assert lp.text_offset == [sum(len(t) for t in lp.tokens[:i]) for i in range(8)]
    assert all(len(top) <= 3 and top[tok] == v
               for tok, v, top in zip(lp.tokens, lp.token_logprobs, lp.top_logprobs))
    # echo: the prompt's text and tokens first, its first token without a logprob
    echo = oai.completions.create(model=MODEL_NAME, prompt="hello world", max_tokens=8,
                                  logprobs=0, echo=True)
    prompt = tm.tokenize("hello world")
    e = echo.choices[0]
    assert e.text == "hello world" + resp.choices[0].text
    assert len(e.logprobs.tokens) == len(prompt) + 8
    assert e.logprobs.token_logprobs[0] is None and e.logprobs.top_logprobs[0] is None
    assert e.logprobs.token_logprobs[len(prompt):] == lp.token_logprobs
    assert all(len(top) == 1 for top in e.logprobs.top_logprobs[1:])  # the chosen token only
    # streamed: the events' pieces add up to the whole
    stream = oai.completions.create(model=MODEL_NAME, prompt="hello world", max_tokens=8,
                                    logprobs=2, stream=True)
    tokens, lps, offsets = [], [], []
    for chunk in stream:
        for c in chunk.choices:
            if c.logprobs is not None:
                tokens += c.logprobs.tokens
                lps += c.logprobs.token_logprobs
                offsets += c.logprobs.text_offset
    assert (tokens, lps, offsets) == (lp.tokens, lp.token_logprobs, lp.text_offset)


def test_chat_logprobs_and_stream(env):
    oai, _, tm, _ = env
    resp = oai.chat.completions.create(model=MODEL_NAME, messages=MESSAGES, max_tokens=200,
                                       logprobs=True, top_logprobs=3)
    content = resp.choices[0].logprobs.content
    assert len(content) == resp.usage.completion_tokens
    assert all(len(c.top_logprobs) == 3 and c.top_logprobs[0].logprob == c.logprob
               and c.bytes == list(c.token.encode()) for c in content)
    stream = oai.chat.completions.create(model=MODEL_NAME, messages=MESSAGES, max_tokens=200,
                                         logprobs=True, stream=True)
    streamed = [item for chunk in stream for c in chunk.choices if c.logprobs
                for item in c.logprobs.content]
    assert [(c.token, c.logprob) for c in streamed] == [(c.token, c.logprob) for c in content]
    assert all(c.top_logprobs == [] for c in streamed)
    plain = oai.chat.completions.create(model=MODEL_NAME, messages=MESSAGES, max_tokens=4)
    assert plain.choices[0].logprobs is None


@pytest.mark.parametrize(("path", "body", "param"), [
    ("completions", {}, "prompt"),
    ("completions", {"prompt": ""}, "prompt"),
    ("completions", {"prompt": []}, "prompt"),
    ("completions", {"prompt": [1, "a"]}, "prompt"),
    ("completions", {"prompt": list(range(300))}, "prompt"),
    ("completions", {"prompt": "a", "max_tokens": 0}, "max_tokens"),
    ("completions", {"prompt": "a", "max_tokens": -2}, "max_tokens"),
    ("completions", {"prompt": "a", "max_tokens": "5"}, "max_tokens"),
    ("completions", {"prompt": "a", "temperature": -0.5}, "temperature"),
    ("completions", {"prompt": "a", "top_p": 0}, "top_p"),
    # float32 makes it 0, and a masked logit's -inf times 0 is NaN (NaN logprobs: a 500)
    ("completions", {"prompt": "a", "repetition_penalty": 5e-324}, "repetition_penalty"),
    ("completions", {"prompt": "a", "n": 0}, "n"),
    ("completions", {"prompt": "a", "stop": [""]}, "stop.0"),
    ("completions", {"prompt": "a", "logit_bias": {"5": 10}}, "logit_bias"),
    ("completions", {"prompt": "a", "logprobs": 21}, "logprobs"),
    ("completions", {"prompt": "a", "logprobs": -1}, "logprobs"),
    ("completions", {"prompt": "a", "logprobs": True}, "logprobs"),
    ("completions", {"prompt": "a", "logprobs": "2"}, "logprobs"),
    ("completions", {"prompt": "a", "best_of": 3}, "best_of"),
    ("completions", {"prompt": "a", "suffix": "end"}, "suffix"),
    ("completions", {"prompt": "a", "max_tokenz": 5}, "max_tokenz"),
    ("chat/completions", {}, "messages"),
    ("chat/completions", {"messages": []}, "messages"),
    ("chat/completions", {"messages": [{"role": "function", "content": "x"}]},
     "messages.0.role"),
    ("chat/completions", {"messages": [{"role": "user"}]}, "messages.0.content"),
    ("chat/completions", {"messages": [{"role": "user", "content": [
        {"type": "text", "text": "look"},
        {"type": "image_url", "image_url": {"url": "http://x/y.png"}}]}]},
     "messages.0.content.1.type"),
    ("chat/completions", {"tools": [{"type": "function", "function": {"name": "f g"}}]},
     "tools.0.function.name"),
    ("chat/completions", {"tool_choice": "required"}, "tool_choice"),
    ("chat/completions", {"response_format": {"type": "json_schema", "json_schema": {}}},
     "response_format.json_schema.name"),
    ("chat/completions", {"top_logprobs": 2}, "top_logprobs"),
    ("chat/completions", {"logprobs": True, "top_logprobs": 21}, "top_logprobs"),
    ("chat/completions", {"logprobs": "yes"}, "logprobs"),
    ("chat/completions", {"max_completion_tokens": 0}, "max_completion_tokens"),
    ("chat/completions", {"max_tokens": 0}, "max_tokens"),
    ("chat/completions", {"temperature": "hot"}, "temperature"),
    ("chat/completions", {"stream_options": {"include_usage": "yes"}},
     "stream_options.include_usage"),
])
def test_openai_bad_input_is_400_naming_the_param(env, path, body, param):
    _, raw, _, sched = env
    if path.startswith("chat") and "messages" not in body and param not in ("messages",):
        body = {"messages": MESSAGES, **body}
    before = len(sched.requests)
    for stream in (False, True):
        r = raw.post(f"/v1/{path}", json={"model": MODEL_NAME, **body, "stream": stream})
        assert r.status_code == 400, r.text
        err = r.json()["error"]
        assert err["param"] == param and param in err["message"], err
    assert len(sched.requests) == before


def test_openai_client_surfaces_errors_as_exceptions(env):
    oai, _, _, _ = env
    with pytest.raises(openai.BadRequestError) as info:
        oai.completions.create(model=MODEL_NAME, prompt="a", max_tokens=0)
    assert "max_tokens" in str(info.value)
    bad = openai.OpenAI(base_url=str(oai.base_url), api_key="wrong", max_retries=0)
    with pytest.raises(openai.AuthenticationError):
        bad.models.list()


def test_disconnect_during_n_choice_chat_stream_aborts_every_choice(env):
    oai, _, _, sched = env
    sched.token_delay = 0.05
    before = set(sched.aborted)
    stream = oai.chat.completions.create(model=MODEL_NAME, messages=MESSAGES, n=2, stream=True,
                                         max_tokens=200, extra_body={"ignore_eos": True})
    next(iter(stream))
    stream.close()
    deadline = time.monotonic() + 5
    while time.monotonic() < deadline and len(set(sched.aborted) - before) < 2:
        time.sleep(0.02)
    new = set(sched.aborted) - before
    assert len(new) == 2 and all(rid.startswith("chatcmpl-") for rid in new)
