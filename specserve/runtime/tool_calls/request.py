"""A chat request's `tools`, `tool_choice` and `parallel_tool_calls`, checked, and its messages
rendered for a chat template that may or may not know about tools."""

from __future__ import annotations

import json
from dataclasses import dataclass

from specserve.runtime.constrained.spec import MAX_GRAMMAR_BYTES
from specserve.runtime.errors import InvalidRequestError
from specserve.runtime.tool_calls.formats import ToolFormat

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


def parse_tool_request(tools: list[dict] | None, tool_choice: str | dict | None,
                       parallel: bool | None) -> ToolRequest:
    """OpenAI's fields, their shapes already checked (the HTTP layer's types,
    specserve/runtime/entrypoints/openai_types.py), checked for what a type cannot say: no
    function named twice, the tools within the grammar size limit, a named or required call
    among the request's tools (a 400 naming the field otherwise)."""
    checked = _tools(tools or [])
    names = {t["function"]["name"] for t in checked}
    choice, function = _choice(tool_choice, names)
    if choice in ("required", "function") and not checked:
        raise InvalidRequestError("tool_choice", f"{tool_choice!r} needs `tools`")
    return ToolRequest(checked, choice, function, parallel is not False)


def _tools(tools: list[dict]) -> list[dict]:
    out, seen = [], set()
    for i, tool in enumerate(tools):
        fn = tool["function"]
        if fn["name"] in seen:
            raise InvalidRequestError(f"tools.{i}.function.name", f"{fn['name']!r} is named "
                                      "twice")
        seen.add(fn["name"])
        out.append({"type": "function", "function": {k: fn[k] for k in _FUNCTION_KEYS
                                                     if fn.get(k) is not None}})
    if len(json.dumps(out)) > MAX_GRAMMAR_BYTES:
        raise InvalidRequestError("tools", f"the tools take more than {MAX_GRAMMAR_BYTES} bytes")
    return out


def _choice(choice: str | dict | None, names: set[str]) -> tuple[str, str | None]:
    if choice is None:
        return ("auto" if names else "none"), None
    if isinstance(choice, str):
        return choice, None
    name = choice["function"]["name"]
    if name not in names:
        raise InvalidRequestError("tool_choice.function.name",
                                  f"{name!r} is not one of the request's tools")
    return "function", name


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
