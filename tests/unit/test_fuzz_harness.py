"""The schemathesis harness the suite fuzzes the server with (benchmark/fuzz_openapi.py), over
the real HTTP front end with its scheduler faked: it passes a sound server, and it catches a
handler that raises (a 500), reporting the case as a curl line. The real server's fuzz is
tests/integration/test_fuzz_openapi.py."""

from __future__ import annotations

import pytest

from benchmark.fuzz_openapi import MISMATCH, run_schemathesis
from specserve.runtime.entrypoints import openai_api
from specserve.runtime.entrypoints.http_server import create_app
from specserve.runtime.errors import InvalidRequestError
from tests.helpers.fake_tm import make_fake_tm
from tests.helpers.live_server import live_server

SEED = 29


@pytest.fixture(scope="module")
def tm(tmp_path_factory):
    return make_fake_tm(tmp_path_factory.mktemp("tok"), enable_metrics=True)[0]


def test_a_sound_front_end_passes_the_fuzz_with_no_mismatch_warning(tm):
    with live_server(create_app(tm, tm.server_args)) as url:
        result = run_schemathesis(url, None, max_examples=6, seed=SEED, phases="fuzzing")
    assert result.failures == 0, result.output[-4000:]
    assert MISMATCH not in result.warnings
    assert result.cases >= 30  # every operation ran, the POST ones several times


def test_a_handler_that_raises_fails_the_fuzz_with_a_curl_line(tm, monkeypatch):
    def broken(*args, **kwargs):
        raise TypeError("unhashable type: 'dict'")  # a dict name hashed by a hand parse

    monkeypatch.setattr(openai_api, "parse_tool_request", broken)
    with live_server(create_app(tm, tm.server_args)) as url:
        result = run_schemathesis(url, None, max_examples=5, seed=SEED, phases="fuzzing",
                                  include_path="/v1/chat/completions")
    assert result.failures >= 1 and not result.ok
    assert any(c.startswith("curl -X POST") and c.endswith(f"{url}/v1/chat/completions")
               for c in result.curls), result.output[-4000:]


def test_a_server_stricter_than_its_spec_gets_the_mismatch_warning(tm, monkeypatch):
    def refuse(cls, data):
        raise InvalidRequestError("messages", "refused whatever the spec allows")

    monkeypatch.setattr(openai_api, "parse_model", refuse)
    with live_server(create_app(tm, tm.server_args)) as url:
        result = run_schemathesis(url, None, max_examples=5, seed=SEED, phases="fuzzing",
                                  include_path="/v1/chat/completions")
    assert result.failures == 0 and MISMATCH in result.warnings and not result.ok
