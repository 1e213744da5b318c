"""The `priority` field (SGLang's on /generate; vLLM's and SGLang's on the OpenAI endpoints):
validated on every endpoint, carried to the scheduler under --enable-priority-scheduling, and
otherwise ignored (SGLang's default) or refused with --abort-on-priority-when-disabled."""

from __future__ import annotations

import contextlib

import httpx
import pytest

from specserve.runtime.entrypoints.http_server import create_app
from specserve.runtime.errors import QueueFullError
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
    for priority in (7, -3, 2**31 - 1, 6.0):  # (6.0: a JSON number that is the integer 6)
        r = client.post(path, json={**BODIES[path], "priority": priority})
        assert r.status_code == 200, r.text
        assert sched.requests[-1].priority == priority
        assert type(sched.requests[-1].priority) is int
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


@pytest.mark.parametrize("path", list(BODIES))
@pytest.mark.parametrize("stream", [False, True])
def test_a_request_the_scheduler_refuses_at_a_full_queue_is_a_503(servers, path, stream):
    """Under priority scheduling the scheduler bounds the queue; its refusal (an abort with
    status 503 before any token) is answered as the front end's own: HTTP 503, SGLang's
    message, counted as rejected."""
    client, sched = servers["on"]
    sched.refusal = {"type": "abort", "status_code": 503,
                     "message": "The request queue is full."}
    try:
        r = client.post(path, json={**BODIES[path], "priority": 1, "stream": stream})
    finally:
        sched.refusal = None
    assert r.status_code == 503, r.text
    err = r.json()["error"]
    assert err["message"] == "The request queue is full."
    assert err["type"] == "service_unavailable_error"
    assert client.post(path, json=BODIES[path]).status_code == 200  # the server serves on


def test_under_priority_scheduling_the_front_end_leaves_the_queue_bound_to_the_scheduler(
        tmp_path):
    tm, _ = make_fake_tm(tmp_path, max_running_requests=1, max_queued_requests=0,
                         enable_priority_scheduling=True)
    tm.admit(5)  # no refusal by count: the scheduler may drop a less urgent queued request
    tm, _ = make_fake_tm(tmp_path, max_running_requests=1, max_queued_requests=0)
    with pytest.raises(QueueFullError):
        tm.admit(2)

