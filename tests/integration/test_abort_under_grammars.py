"""Abort under grammars and speculation, on the real server: concurrent streamed chat requests
shaped by JSON schemas and forced tool calls, a third disconnected mid-stream, under SUFFIX and
under EAGLE-3 drafting on every step; afterwards /server_info shows nothing held (KV slots of
requests, the runner's records, grammar matchers, drafter state, open requests), a flush gives
every slot back, and every other request completed with valid JSON
(benchmark/soak_abort.py; `python -m benchmark.soak --mode grammar-abort` runs 64)."""

from __future__ import annotations

import asyncio

import pytest

from benchmark.soak_abort import HELD, grammar_abort
from tests.helpers.server_proc import ServerProcess

pytestmark = pytest.mark.slow
STREAMS = 12


@pytest.mark.parametrize("algo", [("SUFFIX",), ("EAGLE3", "--speculative-disable-adaptive")],
                         ids=["SUFFIX", "EAGLE3-forced"])
def test_disconnects_under_grammars_and_speculation_leave_nothing_held(algo):
    srv = ServerProcess("--speculative-algorithm", *algo, "--speculative-verify-cost", "table",
                        "--log-level", "warning")
    try:
        result = asyncio.run(grammar_abort(srv.url, STREAMS, max_tokens=48))
    finally:
        srv.stop()
    report = str(result)
    assert not result["failures"], report
    assert result["held_after"] == dict.fromkeys(HELD, 0), report
    assert result["aborted"] == result["disconnected"] == STREAMS // 3, report
    assert result["kv_free"] == result["kv_capacity"] and result["flush"]["success"], report
    assert result["spec_verify_steps"] > 0, "the requests speculated"
    assert result["ok"]
