"""OpenAI chat messages, checked and put in the one shape the chat templates get."""

from __future__ import annotations

import json
from typing import Any

from specserve.runtime.errors import InvalidRequestError

_CHAT_ROLES = ("system", "developer", "user", "assistant", "tool")
# `name` is accepted and not shown to the model; the others only where they belong
_MESSAGE_KEYS = {"role", "content", "name"}
_ROLE_KEYS = {"assistant": {"tool_calls"}, "tool": {"tool_call_id"}}


def chat_messages(raw: Any) -> list[dict[str, Any]]:
    """OpenAI chat messages as `[{role, content: str}]` for the chat template, assistant
    messages with their earlier `tool_calls` ([{id, type, function: {name, arguments:
    object}}]) and tool results (`role` "tool", with their `tool_call_id`).

    Text parts of a content list are joined with newlines; images, audio and files are
    rejected (we cannot honour them). A "developer" message is a system message.
    """
    if not isinstance(raw, list) or not raw:
        raise InvalidRequestError("messages", "must be a non-empty list of messages")
    return [_message(msg, f"messages.{i}") for i, msg in enumerate(raw)]


def _message(msg: Any, where: str) -> dict[str, Any]:
    if not isinstance(msg, dict):
        raise InvalidRequestError(where, "each message must be an object")
    role = msg.get("role")
    if role not in _CHAT_ROLES:
        raise InvalidRequestError(f"{where}.role", f"must be one of {_CHAT_ROLES}, got "
                                  f"{role!r}")
    allowed = _MESSAGE_KEYS | _ROLE_KEYS.get(role, set())
    for key, value in msg.items():
        # Clients echo assistant messages back with null/empty extras (refusal, audio).
        if key not in allowed and value not in (None, [], {}):
            raise InvalidRequestError(f"{where}.{key}", "is not supported by this server")
    calls = _tool_calls(msg.get("tool_calls"), f"{where}.tool_calls") if role == "assistant" \
        else []
    content = msg.get("content")
    if content is None and calls:
        content = ""
    out: dict[str, Any] = {"role": "system" if role == "developer" else role,
                           "content": _message_text(content, f"{where}.content")}
    if calls:
        out["tool_calls"] = calls
    if role == "tool":
        call_id = msg.get("tool_call_id")
        if call_id is not None and not isinstance(call_id, str):
            raise InvalidRequestError(f"{where}.tool_call_id", "must be a string")
        out["tool_call_id"] = call_id or ""
    return out


def _tool_calls(raw: Any, where: str) -> list[dict]:
    if raw in (None, []):
        return []
    if not isinstance(raw, list):
        raise InvalidRequestError(where, "must be a list of tool calls")
    calls = []
    for j, call in enumerate(raw):
        fn = call.get("function") if isinstance(call, dict) else None
        if not isinstance(fn, dict) or not isinstance(fn.get("name"), str) or \
                not isinstance(fn.get("arguments"), str):
            raise InvalidRequestError(f"{where}.{j}", 'a tool call is {"id": ..., "type": '
                                      '"function", "function": {"name": str, "arguments": str}}')
        try:
            args = json.loads(fn["arguments"])
        except (ValueError, RecursionError):
            args = None
        if not isinstance(args, dict):
            raise InvalidRequestError(f"{where}.{j}.function.arguments", "must be a JSON object "
                                      "(as a string)")
        calls.append({"id": str(call.get("id") or f"call_{j}"), "type": "function",
                      "function": {"name": fn["name"], "arguments": args}})
    return calls


def _message_text(content: Any, where: str) -> str:
    if isinstance(content, str):
        return content
    if not isinstance(content, list):
        raise InvalidRequestError(where, "must be a string or a list of content parts")
    texts = []
    for j, part in enumerate(content):
        if not isinstance(part, dict) or not isinstance(part.get("type"), str):
            raise InvalidRequestError(f"{where}.{j}", "each content part must be an object "
                                      "with a 'type'")
        if part["type"] != "text":
            raise InvalidRequestError(f"{where}.{j}.type", f"content parts of type "
                                      f"{part['type']!r} are not supported (text only)")
        if not isinstance(part.get("text"), str) or set(part) - {"type", "text"}:
            raise InvalidRequestError(f"{where}.{j}", "a text part is {type: 'text', text: str}")
        texts.append(part["text"])
    return "\n".join(texts)
