"""Abort under grammars and speculation (`python -m benchmark.soak --mode grammar-abort`).

`--streams` concurrent streamed chat requests, each shaped by a grammar: a JSON schema
(`response_format`) or a forced tool call (`tools` with `tool_choice: "required"`); a third of
them are disconnected mid-stream. Afterwards nothing may be left in use (/server_info: KV slots
held by requests, the model runner's request records, grammar matchers, drafter state, the front
end's open requests), a flush must give every KV slot back, and every other request must have
completed with valid JSON: the schema's object, or calls of the offered tools whose arguments
match the tool's parameters.

    python -m benchmark.soak --mode grammar-abort --streams 64 \\
        --server-args "--speculative-algorithm EAGLE3 --speculative-disable-adaptive"
"""

from __future__ import annotations

import asyncio
import json
import time
from typing import Any

import httpx
import jsonschema

CITIES = ("Paris", "Oslo", "Lima", "Cairo", "Tokyo", "Quito", "Perth", "Dakar")
WEATHER = {"type": "object", "properties": {
    "city": {"enum": list(CITIES)}, "temp_c": {"type": "integer", "minimum": -40,
                                               "maximum": 50},
    "sunny": {"type": "boolean"}}, "required": ["city", "temp_c", "sunny"],
    "additionalProperties": False}
TOOLS = [{"type": "function", "function": {
    "name": "get_weather", "description": "Get the current weather in a city",
    "parameters": {"type": "object", "properties": {"city": {"enum": list(CITIES)}},
                   "required": ["city"], "additionalProperties": False}}},
    {"type": "function", "function": {
        "name": "get_time", "description": "Get the local time in a city",
        "parameters": {"type": "object", "properties": {"city": {"enum": list(CITIES)}},
                       "required": ["city"], "additionalProperties": False}}}]
# the requests that disconnect ask for long output, so they are still generating when they go
REPORT = {"type": "string", "minLength": 400, "maxLength": 600}
LONG_WEATHER = {**WEATHER, "properties": {**WEATHER["properties"], "report": REPORT},
                "required": [*WEATHER["required"], "report"]}
FILE_REPORT = {"type": "function", "function": {
    "name": "file_report", "description": "File a long weather report",
    "parameters": {"type": "object", "properties": {"text": REPORT}, "required": ["text"],
                   "additionalProperties": False}}}
# what must be back to 0 once every request has finished or gone
HELD = ("kv_used_by_requests", "runner_requests", "grammar_matchers", "drafter_requests",
        "open_requests")


def request_body(i: int, max_tokens: int, long: bool = False) -> dict:
    """Request i: a JSON-schema answer (even i) or a forced tool call (odd i); `long`: one
    that must write a report of 400+ characters (the named tool `file_report`)."""
    city = CITIES[i % len(CITIES)]
    body: dict[str, Any] = {"stream": True, "max_tokens": 4 * max_tokens if long else max_tokens,
                            "temperature": 0.0}
    if i % 2 == 0:
        q = f"Report the weather in {city} as JSON (city, temp_c, sunny)."
        body["response_format"] = {"type": "json_schema", "json_schema": {
            "name": "weather", "schema": LONG_WEATHER if long else WEATHER}}
    elif long:
        q = f"File a long weather report for {city}."
        body.update(tools=[*TOOLS, FILE_REPORT], tool_choice={
            "type": "function", "function": {"name": "file_report"}})
    else:
        q = f"What is the weather and the local time in {city}?"
        body.update(tools=TOOLS, tool_choice="required")
    body["messages"] = [{"role": "user", "content": q}]
    return body


def check_output(body: dict, content: str, calls: dict[int, dict], reason: str | None) -> None:
    """Raise (AssertionError or a JSON/jsonschema error) unless the answer is valid JSON of
    the request's shape."""
    if "response_format" in body:
        assert reason == "stop", f"finish_reason {reason!r}: {content!r}"
        jsonschema.validate(json.loads(content), WEATHER)
        return
    assert reason == "tool_calls" and calls, f"finish_reason {reason!r}, calls {calls}"
    params = {t["function"]["name"]: t["function"]["parameters"] for t in TOOLS}
    for call in calls.values():
        jsonschema.validate(json.loads(call["arguments"]), params[call["name"]])


async def one(client: httpx.AsyncClient, i: int, disconnect: bool, max_tokens: int) -> None:
    """Request i, streamed; disconnected after its first event when `disconnect` (the event
    goes out once the request has its first token; a tool call's text is held back until the
    call is whole, so a later event could come after the end)."""
    body = request_body(i, max_tokens, long=disconnect)
    content, calls, reason = "", {}, None
    async with client.stream("POST", "/v1/chat/completions", json=body) as r:
        r.raise_for_status()
        async for line in r.aiter_lines():
            if not line.startswith("data: {"):
                continue
            if disconnect:
                return  # leaving the block drops the connection mid-stream
            for choice in json.loads(line[6:])["choices"]:
                delta = choice["delta"]
                content += delta.get("content") or ""
                for call in delta.get("tool_calls") or []:
                    calls[call["index"]] = dict(call["function"])
                reason = choice["finish_reason"] or reason
    check_output(body, content, calls, reason)


async def drained(client: httpx.AsyncClient, timeout_s: float) -> dict:
    """/server_info once nothing runs or waits and nothing is held (or at the timeout)."""
    deadline = time.monotonic() + timeout_s
    while True:
        info = (await client.get("/server_info")).json()
        idle = info["num_running_reqs"] == 0 and info["num_waiting_reqs"] == 0
        if (idle and not any(info.get(k) for k in HELD)) or time.monotonic() > deadline:
            return info
        await asyncio.sleep(0.25)


async def grammar_abort(url: str, streams: int, max_tokens: int = 64,
                        drain_timeout_s: float = 60.0) -> dict[str, Any]:
    """Run the check against the server at `url`; the figures and `ok`."""
    timeout = httpx.Timeout(600.0, connect=30.0)
    limits = httpx.Limits(max_connections=streams + 8)
    gone = [i for i in range(streams) if i % 3 == 0]  # a third disconnect
    async with httpx.AsyncClient(base_url=url, timeout=timeout, limits=limits) as client:
        before = (await client.get("/server_info")).json()
        t0 = time.monotonic()
        outcomes = await asyncio.gather(*(one(client, i, i in gone, max_tokens)
                                          for i in range(streams)), return_exceptions=True)
        elapsed = time.monotonic() - t0
        info = await drained(client, drain_timeout_s)
        flushed = (await client.post("/flush_cache")).json()
        kv = (await client.get("/server_info")).json()
    failures = [f"request {i}: {out!r}" for i, out in enumerate(outcomes) if out is not None]
    held = {k: info.get(k) for k in HELD}
    return {
        "requests": streams, "disconnected": len(gone), "completed": streams - len(gone),
        "failures": failures[:20], "num_failures": len(failures), "elapsed_s": elapsed,
        "held_after": held, "aborted": info["aborted"] - before["aborted"],
        "flush": flushed, "kv_free": kv["kv_free"], "kv_capacity": kv["kv_capacity"],
        "spec_verify_steps": info.get("spec_verify_steps", 0) - before.get("spec_verify_steps", 0),
        # every disconnected request was still generating: the server aborted it
        "ok": not failures and not any(held.values()) and flushed.get("success") is True
        and kv["kv_free"] == kv["kv_capacity"] and info["aborted"] - before["aborted"] == len(gone),
    }
