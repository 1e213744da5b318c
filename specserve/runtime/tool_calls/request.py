"""A chat request's `tools`, `tool_choice` and `parallel_tool_calls`, checked, and its messages
rendered for a chat template that may or may not know about tools."""

from __future__ import annotations

import json
import re
from dataclasses import dataclass
from typing import Any

from specserve.runtime.constrained.spec import MAX_GRAMMAR_BYTES
from specserve.runtime.errors import InvalidRequestError
from specserve.runtime.tool_calls.formats import ToolFormat

_NAME = re.compile(r"^[A-Za-z0-9_.-]{1,64}$")  # OpenAI's function names (plus dots)
_FUNCTION_KEYS = ("name", "description", "parameters", "strict")
MAX_TOOLS = 128


@dataclass(frozen=True)
class ToolRequest:
    """The tools a request offers and how it lets the model use them: `choice` is "none",
    "auto", "required" or "function" (then `function` names the one it must call)."""

    tools: list[dict]
    choice: str
    function: str | None = None
    parallel: bool = True

    @property
    def names(self) -> set[str]:
        return {t["function"]["name"] for t in self.tools}

    @property
    def offered(self) -> bool:
        """The model is shown the tools and its output read for calls."""
        return bool(self.tools) and self.choice != "none"

    @property
    def forced(self) -> bool:
        """The output must be a call (a grammar forces it)."""
        return self.choice in ("required", "function")

    def forcing_grammar(self, fmt: ToolFormat) -> str:
        """The structural tag that admits only the calls this request allows."""
        tools = [t for t in self.tools if self.function in (None, t["function"]["name"])]
        return fmt.grammar(tools, self.parallel and self.function is None)


def parse_tool_request(tools: Any, tool_choice: Any, parallel: Any) -> ToolRequest:
    """OpenAI's fields checked (a 400 naming the field otherwise)."""
    checked = _tools(tools)
    if parallel is not None and not isinstance(parallel, bool):
        raise InvalidRequestError("parallel_tool_calls", "must be a boolean")
    choice, function = _choice(tool_choice, {t["function"]["name"] for t in checked})
    if choice in ("required", "function") and not checked:
        raise InvalidRequestError("tool_choice", f"{tool_choice!r} needs `tools`")
    return ToolRequest(checked, choice, function, parallel is not False)


def _tools(tools: Any) -> list[dict]:
    if tools is None:
        return []
    if not isinstance(tools, list) or len(tools) > MAX_TOOLS:
        raise InvalidRequestError("tools", f"must be a list of at most {MAX_TOOLS} tools")
    out, seen = [], set()
    for i, tool in enumerate(tools):
        where = f"tools.{i}"
        if not isinstance(tool, dict) or tool.get("type") != "function" or \
                not isinstance(tool.get("function"), dict) or set(tool) - {"type", "function"}:
            raise InvalidRequestError(where, 'must be {"type": "function", "function": {...}}')
        fn = tool["function"]
        for key in fn:
            if key not in _FUNCTION_KEYS:
                raise InvalidRequestError(f"{where}.function.{key}", "unknown parameter")
        name = fn.get("name")
        if not isinstance(name, str) or not _NAME.match(name):
            raise InvalidRequestError(f"{where}.function.name", "must be 1-64 characters of "
                                      "a-z, A-Z, 0-9, '_', '-', '.'")
        if name in seen:
            raise InvalidRequestError(f"{where}.function.name", f"{name!r} is named twice")
        seen.add(name)
        if fn.get("description") is not None and not isinstance(fn["description"], str):
            raise InvalidRequestError(f"{where}.function.description", "must be a string")
        if fn.get("parameters") is not None and not isinstance(fn["parameters"], dict):
            raise InvalidRequestError(f"{where}.function.parameters", "must be a JSON Schema "
                                      "object")
        if fn.get("strict") is not None and not isinstance(fn["strict"], bool):
            raise InvalidRequestError(f"{where}.function.strict", "must be a boolean")
        out.append({"type": "function", "function": {k: fn[k] for k in _FUNCTION_KEYS
                                                     if fn.get(k) is not None}})
    if len(json.dumps(out)) > MAX_GRAMMAR_BYTES:
        raise InvalidRequestError("tools", f"the tools take more than {MAX_GRAMMAR_BYTES} bytes")
    return out


def _choice(choice: Any, names: set[str]) -> tuple[str, str | None]:
    if choice is None:
        return ("auto" if names else "none"), None
    if choice in ("none", "auto", "required"):
        return choice, None
    if isinstance(choice, dict) and choice.get("type") == "function" and \
            isinstance(choice.get("function"), dict):
        name = choice["function"].get("name")
        if name not in names:
            raise InvalidRequestError("tool_choice.function.name",
                                      f"{name!r} is not one of the request's tools")
        return "function", name
    raise InvalidRequestError("tool_choice", 'must be "none", "auto", "required" or '
                              '{"type": "function", "function": {"name": ...}}')


def render_messages(messages: list[dict], req: ToolRequest, fmt: ToolFormat,
                    template_renders_tools: bool) -> tuple[list[dict], list[dict] | None]:
    """(messages, tools) for the chat template. A template that renders tools gets them and
    the messages as OpenAI has them (a call's arguments as an object); for one that does not,
    the tools go into a system message in `fmt`'s shape (after the request's own system text),
    earlier calls into their assistant messages and tool results into user turns."""
    if template_renders_tools:
        return messages, req.tools if req.offered else None
    out = []
    for m in messages:
        if m["role"] == "tool":
            out.append({"role": "user", "content": fmt.render_result(m["content"])})
        elif m.get("tool_calls"):
            calls = fmt.render_calls([c["function"] for c in m["tool_calls"]])
            text = f"{m['content']}\n{calls}" if m["content"] else calls
            out.append({"role": "assistant", "content": text})
        else:
            out.append({"role": m["role"], "content": m["content"]})
    if req.offered:
        block = fmt.system_prompt(req.tools)
        if out and out[0]["role"] == "system":
            out[0] = {"role": "system", "content": f"{out[0]['content']}\n\n{block}"}
        else:
            out.insert(0, {"role": "system", "content": block})
    return out, None
