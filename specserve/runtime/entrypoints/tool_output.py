"""Tool calls in OpenAI's response shapes: a whole message's `tool_calls`, and stream deltas."""

from __future__ import annotations

import uuid
from typing import Any

from specserve.runtime.tool_calls.formats import ToolCall, ToolFormat
from specserve.runtime.tool_calls.request import ToolRequest
from specserve.runtime.tool_calls.stream import ToolCallReader, read_all


def call_json(call: ToolCall, index: int | None = None) -> dict[str, Any]:
    """One call as OpenAI gives it (`index` in stream deltas)."""
    out: dict[str, Any] = {} if index is None else {"index": index}
    out.update(id=f"call_{uuid.uuid4().hex[:24]}", type="function",
               function={"name": call.name, "arguments": call.arguments})
    return out


def tool_message(text: str, tools: ToolRequest, fmt: ToolFormat) -> tuple[dict, bool]:
    """A whole chat message with the calls read out of `text`, and whether there were any."""
    content, calls = read_all(fmt, tools.names, text)
    msg: dict[str, Any] = {"role": "assistant", "content": content}
    if calls:
        msg["tool_calls"] = [call_json(c) for c in calls]
    return msg, bool(calls)


class ToolDeltas:
    """One streamed choice's tool-call reading: `delta(text, final)` turns its cumulative text
    into the delta fields that are new (`content`, `tool_calls`)."""

    def __init__(self, tools: ToolRequest, fmt: ToolFormat) -> None:
        self.reader = ToolCallReader(fmt, tools.names)

    @property
    def called(self) -> bool:
        return bool(self.reader.calls)

    def delta(self, text: str, final: bool) -> dict[str, Any]:
        before = len(self.reader.calls)
        content, calls = (self.reader.finish if final else self.reader.feed)(text)
        out: dict[str, Any] = {}
        if content:
            out["content"] = content
        if calls:
            out["tool_calls"] = [call_json(c, before + k) for k, c in enumerate(calls)]
        return out
