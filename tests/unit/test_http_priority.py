"""The `priority` field (SGLang's on /generate; vLLM's and SGLang's on the OpenAI endpoints):
validated on every endpoint, carried to the scheduler under --enable-priority-scheduling, and
otherwise ignored (SGLang's default) or refused with --abort-on-priority-when-disabled."""

from __future__ import annotations

import contextlib

import httpx
import pytest

from runtime.entrypoints.http_server import create_app
from tests.helpers.fake_tm import make_fake_tm
from tests.helpers.live_server import live_server

BODIES = {
    "/generate": {"text": "hi", "sampling_params": {"max_new_tokens": 2}},
    "/v1/completions": {"prompt": "hi", "max_tokens": 2},
    "/v1/chat/completions": {"messages": [{"role": "user", "content": "hi"}], "max_tokens": 2},
}


@pytest.fixture(scope="module")
def servers(tmp_path_factory):
    """{mode: (client, fake scheduler)} for priority scheduling on, off, off + refuse."""
    modes = {"on": {"enable_priority_scheduling": True}, "off": {},
             "refuse": {"abort_on_priority_when_disabled": True}}
    with contextlib.ExitStack() as stack:
        out = {}
        for mode, args in modes.items():
            tm, sched = make_fake_tm(tmp_path_factory.mktemp(mode), **args)
            url = stack.enter_context(live_server(create_app(tm, tm.server_args)))
            out[mode] = (stack.enter_context(httpx.Client(base_url=url, timeout=10)), sched)
        yield out


@pytest.mark.parametrize("path", list(BODIES))
def test_priority_reaches_the_scheduler_when_priority_scheduling_is_on(servers, path):
    client, sched = servers["on"]
    for priority in (7, -3, 2**31 - 1):
        r = client.post(path, json={**BODIES[path], "priority": priority})
        assert r.status_code == 200, r.text
        assert sched.requests[-1].priority == priority
    r = client.post(path, json=BODIES[path])  # none given: None, the scheduler's last rank
    assert r.status_code == 200 and sched.requests[-1].priority is None


def test_every_sequence_of_a_batch_gets_the_requests_priority(servers):
    client, sched = servers["on"]
    r = client.post("/generate", json={"text": ["a", "b"], "priority": 4,
                                       "sampling_params": {"max_new_tokens": 1, "n": 2}})
    assert r.status_code == 200, r.text
    assert [q.priority for q in sched.requests[-4:]] == [4] * 4


@pytest.mark.parametrize("path", list(BODIES))
@pytest.mark.parametrize("bad", ["1", 1.5, True, 2**31, -(2**31) - 1, [1]])
def test_a_malformed_priority_is_a_400_naming_the_field(servers, path, bad):
    client, sched = servers["on"]
    seen = len(sched.requests)
    r = client.post(path, json={**BODIES[path], "priority": bad})
    assert r.status_code == 400, r.text
    assert r.json()["error"]["param"] == "priority"
    assert len(sched.requests) == seen  # nothing reached the scheduler


@pytest.mark.parametrize("path", list(BODIES))
def test_without_priority_scheduling_a_priority_is_ignored_or_refused(servers, path):
    client, sched = servers["off"]
    r = client.post(path, json={**BODIES[path], "priority": 9})
    assert r.status_code == 200, r.text
    assert sched.requests[-1].priority is None
    client, sched = servers["refuse"]
    seen = len(sched.requests)
    r = client.post(path, json={**BODIES[path], "priority": 9})
    assert r.status_code == 400
    err = r.json()["error"]
    assert err["param"] == "priority" and "--enable-priority-scheduling" in err["message"]
    assert client.post(path, json={**BODIES[path], "priority": 0}).status_code == 400
    assert len(sched.requests) == seen
    assert client.post(path, json=BODIES[path]).status_code == 200
