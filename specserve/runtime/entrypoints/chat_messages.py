"""OpenAI chat messages: their types, and the one shape the chat templates get."""

from __future__ import annotations

import json
from typing import Annotated, Any, Literal

from annotated_types import MinLen
from pydantic import Field, model_validator

from specserve.runtime.entrypoints.field_types import Body
from specserve.runtime.entrypoints.openai_types import TextPart
from specserve.runtime.errors import InvalidRequestError

Content = str | list[TextPart]


class _Message(Body):
    name: str | None = None  # accepted, not shown to the model

    @model_validator(mode="before")
    @classmethod
    def _drop_empty_extras(cls, data: Any) -> Any:
        # Clients echo assistant messages back with null or empty extras (refusal, audio).
        if isinstance(data, dict):
            return {k: v for k, v in data.items()
                    if k in cls.model_fields or v not in (None, [], {})}
        return data


class SystemMessage(_Message):
    role: Literal["system", "developer"]  # a "developer" message is a system message
    content: Content


class UserMessage(_Message):
    role: Literal["user"]
    content: Content


class CallFunction(Body):
    name: str
    arguments: str  # a JSON object, as text


class ToolCallIn(Body):
    """An earlier call the assistant made, as a client sends it back."""

    id: str | None = None
    type: Literal["function"] = "function"
    function: CallFunction


class AssistantMessage(_Message):
    role: Literal["assistant"]
    content: Content | None = None  # null when the message is calls only
    tool_calls: list[ToolCallIn] | None = None


class ToolMessage(_Message):
    role: Literal["tool"]
    content: Content
    tool_call_id: str | None = None


Message = Annotated[SystemMessage | UserMessage | AssistantMessage | ToolMessage,
                    Field(discriminator="role")]
Messages = Annotated[list[Message], MinLen(1)]


def chat_messages(messages: list[Message]) -> list[dict[str, Any]]:
    """The messages as `[{role, content: str}]` for the chat template, assistant messages with
    their earlier `tool_calls` ([{id, type, function: {name, arguments: object}}]) and tool
    results (`role` "tool", with their `tool_call_id`). Text parts of a content list are joined
    with newlines."""
    return [_message(m, f"messages.{i}") for i, m in enumerate(messages)]


def _message(msg: Any, where: str) -> dict[str, Any]:
    calls = _tool_calls(msg.tool_calls or [], f"{where}.tool_calls") \
        if isinstance(msg, AssistantMessage) else []
    content = msg.content
    if content is None:
        if not calls:  # (what a type cannot say: null content needs calls)
            raise InvalidRequestError(f"{where}.content", "must be a string or a list of "
                                      "content parts unless the message makes tool calls")
        content = ""
    out: dict[str, Any] = {"role": "system" if msg.role == "developer" else msg.role,
                           "content": _text(content)}
    if calls:
        out["tool_calls"] = calls
    if isinstance(msg, ToolMessage):
        out["tool_call_id"] = msg.tool_call_id or ""
    return out


def _tool_calls(calls: list[ToolCallIn], where: str) -> list[dict]:
    out = []
    for j, call in enumerate(calls):
        try:
            args = json.loads(call.function.arguments)
        except (ValueError, RecursionError):
            args = None
        if not isinstance(args, dict):
            raise InvalidRequestError(f"{where}.{j}.function.arguments", "must be a JSON object "
                                      "(as a string)")
        out.append({"id": call.id or f"call_{j}", "type": "function",
                    "function": {"name": call.function.name, "arguments": args}})
    return out


def _text(content: str | list[TextPart]) -> str:
    if isinstance(content, str):
        return content
    return "\n".join(part.text for part in content)
