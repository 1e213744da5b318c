"""What a request may ask for at once: SGLang's parallel sampling (`sampling_params.n` on
/generate), the cap on sequences per HTTP request (--max-sequences-per-request, a 400) and the
queue bound (--max-queued-requests, a 503 "The request queue is full." as SGLang answers).
A refused request reaches no scheduler; the server keeps serving."""

from __future__ import annotations

import json
import threading
import time

import httpx
import pytest

from specserve.launch.server_args import ServerArgs
from specserve.runtime.entrypoints.http_server import create_app
from specserve.runtime.errors import InvalidRequestError, QueueFullError
from tests.helpers.fake_tm import make_fake_tm
from tests.helpers.live_server import live_server, wait_for


@pytest.fixture(scope="module")
def env(tmp_path_factory):
    """(client, tm, scheduler): 2 running + 2 queued at most, 4 sequences per request."""
    tm, sched = make_fake_tm(tmp_path_factory.mktemp("tok"), max_running_requests=2,
                             max_queued_requests=2, max_sequences_per_request=4,
                             enable_metrics=True)
    with live_server(create_app(tm, tm.server_args)) as url, \
            httpx.Client(base_url=url, timeout=10) as client:
        yield client, tm, sched


def _finals(lines) -> dict[int, dict]:
    out = {}
    for line in lines:
        if line.startswith("data: ") and line != "data: [DONE]":
            chunk = json.loads(line[6:])
            if chunk["meta_info"]["finish_reason"]:
                out[chunk["index"]] = chunk
    return out


def test_n_samples_each_prompt_in_sglangs_order_with_seed_plus_j(env):
    client, tm, sched = env
    sched.token_delay = 0.0
    body = {"text": ["a", "hello world"],  # 4 sequences: fit while nothing else runs
            "sampling_params": {"max_new_tokens": 3, "seed": 5, "n": 2}}
    r = client.post("/generate", json=body)
    assert r.status_code == 200, r.text
    out = r.json()
    # prompt by prompt, its samples in a row
    assert [o["meta_info"]["prompt_tokens"] for o in out] == [
        len(tm.tokenize("a"))] * 2 + [len(tm.tokenize("hello world"))] * 2
    # the fake model starts `seed` tokens into its reply: sample j ran with seed 5 + j
    seed_of = {req.rid: req.sampling_params.seed for req in sched.requests[-4:]}
    assert [seed_of[o["meta_info"]["id"]] for o in out] == [5, 6, 5, 6]
    assert out[0]["output_ids"] != out[1]["output_ids"]
    assert out[0]["output_ids"] == out[2]["output_ids"]  # same seed, same draws
    again = client.post("/generate", json=body).json()
    assert [o["output_ids"] for o in again] == [o["output_ids"] for o in out]


def test_n_on_a_single_prompt_answers_a_list_and_streams_indexed_chunks(env):
    client, _, sched = env
    sched.token_delay = 0.0
    r = client.post("/generate", json={"input_ids": [1, 2], "rid": "par",
                                       "sampling_params": {"max_new_tokens": 2, "n": 3}})
    assert r.status_code == 200, r.text
    assert isinstance(r.json(), list) and len(r.json()) == 3
    assert [req.rid for req in sched.requests[-3:]] == ["par-0", "par-1", "par-2"]
    body = {"input_ids": [1, 2], "stream": True, "sampling_params": {"max_new_tokens": 2,
                                                                      "n": 2}}
    with client.stream("POST", "/generate", json=body) as r:
        finals = _finals(r.iter_lines())
    assert sorted(finals) == [0, 1]
    # n = 1 is plain: a dict, the rid as given
    r = client.post("/generate", json={"input_ids": [1], "rid": "solo",
                                       "sampling_params": {"max_new_tokens": 1, "n": 1}})
    assert isinstance(r.json(), dict) and sched.requests[-1].rid == "solo"


@pytest.mark.parametrize(("sp", "message"), [
    ({"n": 0}, "[1, 128]"), ({"n": 129}, "[1, 128]"), ({"n": "2"}, "[1, 128]"),
    ({"n": True}, "[1, 128]"), ({"n": 1.5}, "[1, 128]"),
    ([{"n": 2}, {"n": 3}], "the same for every prompt"),
])
def test_a_bad_n_is_400_naming_it(env, sp, message):
    client, _, sched = env
    before = len(sched.requests)
    body = {"text": ["a", "b"] if isinstance(sp, list) else "a", "sampling_params": sp}
    r = client.post("/generate", json=body)
    assert r.status_code == 400, r.text
    err = r.json()["error"]
    assert err["param"] == "sampling_params.n" and message in err["message"]
    assert len(sched.requests) == before


CHAT = [{"role": "user", "content": "hi"}]


@pytest.mark.parametrize(("path", "too_many", "fits"), [
    ("/generate", {"text": ["a"] * 5}, {"text": ["a"] * 4}),
    ("/generate", {"text": ["a", "b", "c"], "sampling_params": {"n": 2}},
     {"text": ["a", "b"], "sampling_params": {"n": 2}}),
    ("/v1/completions", {"prompt": ["a", "b"], "n": 3}, {"prompt": ["a", "b"], "n": 2}),
    ("/v1/chat/completions", {"messages": CHAT, "n": 5}, {"messages": CHAT, "n": 4}),
])
def test_more_sequences_than_one_request_may_hold_is_400_before_any_runs(env, path, too_many,
                                                                          fits):
    client, _, sched = env
    sched.token_delay = 0.0
    before = len(sched.requests)
    for stream in (False, True):
        r = client.post(path, json={**too_many, "stream": stream})
        assert r.status_code == 400, r.text
        assert "--max-sequences-per-request" in r.json()["error"]["message"]
    assert len(sched.requests) == before
    r = client.post(path, json={**fits, "max_tokens": 2} if path.startswith("/v1") else fits)
    assert r.status_code == 200, r.text


def test_a_full_queue_is_503_at_once_and_frees_when_requests_finish(env):
    client, tm, sched = env
    sched.token_delay = 0.05
    body = {"input_ids": [1], "sampling_params": {"max_new_tokens": 40, "ignore_eos": True}}
    results: list[int] = []

    def long_request():
        with httpx.Client(base_url=str(client.base_url), timeout=30) as c:
            results.append(c.post("/generate", json=body).status_code)

    threads = [threading.Thread(target=long_request) for _ in range(4)]
    for t in threads:
        t.start()
    try:
        # 2 running + 2 queued: the bound
        assert wait_for(lambda: len(tm._states) == 4)
        before = len(sched.requests)
        t0 = time.monotonic()
        for path, extra in (("/generate", {"input_ids": [2]}),
                            ("/v1/completions", {"prompt": "hi", "max_tokens": 2}),
                            ("/v1/chat/completions",
                             {"messages": [{"role": "user", "content": "hi"}]})):
            for stream in (False, True):
                r = client.post(path, json={**extra, "stream": stream})
                assert r.status_code == 503, r.text
                err = r.json()["error"]
                assert err["message"] == "The request queue is full."
                assert err["type"] == "service_unavailable_error"
        assert time.monotonic() - t0 < 2.0  # refused at once, not after waiting
        assert len(sched.requests) == before
        metrics = client.get("/metrics").text
        assert "specserve_rejected_requests_total" in metrics
    finally:
        for t in threads:
            t.join()
    assert results == [200] * 4
    sched.token_delay = 0.0
    # room again; and a batch that fits once the queue has drained
    r = client.post("/generate", json={"input_ids": [[1], [2], [3]],
                                       "sampling_params": {"max_new_tokens": 2}})
    assert r.status_code == 200, r.text


def test_a_batch_that_would_overfill_the_queue_is_refused_whole(env):
    client, tm, sched = env
    sched.token_delay = 0.05
    body = {"input_ids": [1], "stream": True,
            "sampling_params": {"max_new_tokens": 40, "ignore_eos": True}}
    with client.stream("POST", "/generate", json=body) as held:
        assert wait_for(lambda: len(tm._states) == 1)
        before = len(sched.requests)
        # 1 in flight + 4 = 5 > 2 running + 2 queued: none of the four may start
        r = client.post("/generate", json={"input_ids": [[1], [2], [3], [4]]})
        assert r.status_code == 503, r.text
        assert len(sched.requests) == before
        held.close()
    sched.token_delay = 0.0
    assert wait_for(lambda: not tm._states)  # the closed stream was aborted and let go


def test_engine_batches_skip_the_per_request_cap_but_not_the_queue(env):
    _, tm, _ = env
    assert wait_for(lambda: not tm._states)
    tm.admit(4, per_request_cap=False)  # 0 in flight + 4 <= 2 running + 2 queued
    with pytest.raises(InvalidRequestError):
        tm.admit(5)  # over 4 sequences per request
    with pytest.raises(QueueFullError):  # past the cap check, refused by the queue's
        tm.admit(5, per_request_cap=False)


@pytest.mark.parametrize(("field", "value"), [("max_queued_requests", -1),
                                              ("max_sequences_per_request", 0),
                                              ("shared_prefill_min_tokens", -1),
                                              ("priority_scheduling_preemption_threshold",
                                               -1)])
def test_admission_limits_are_checked_at_start(tmp_path, field, value):
    with pytest.raises(ValueError, match=field.replace("_", "-")):
        ServerArgs(model_path=str(tmp_path), **{field: value}).resolve()
