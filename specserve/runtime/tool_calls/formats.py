"""Tool-call formats: how a model family is shown tools and writes its calls.

Both formats here put calls between `<tool_call>` and `</tool_call>`:

- `smollm2`: one block holding a JSON list, `<tool_call>[{"name": ..., "arguments": {...}},
  ...]</tool_call>` (the function-calling format SmolLM2-Instruct was tuned on; its chat
  template ignores `tools`, so the tools are shown in a system block of that format's shape);
- `hermes`: one block per call holding one JSON object, `<tool_call>\\n{"name": ...,
  "arguments": {...}}\\n</tool_call>` (Hermes, Qwen2.5 / Qwen3, whose templates render `tools`).

A new format is a subclass and a line in FORMATS.
"""

from __future__ import annotations

import json
from dataclasses import dataclass
from typing import Any


@dataclass(frozen=True)
class ToolCall:
    name: str
    arguments: str  # a JSON object, as OpenAI's `function.arguments` carries it


class ToolFormat:
    """One family's tool-call format."""

    name = ""
    begin = "<tool_call>"
    end = "</tool_call>"

    def system_prompt(self, tools: list[dict]) -> str:
        """The tools and the call format, for a system message (templates that ignore tools)."""
        raise NotImplementedError

    def render_calls(self, calls: list[dict]) -> str:
        """An assistant message's earlier `tool_calls` ({name, arguments: dict}) as the model
        writes them."""
        raise NotImplementedError

    def render_result(self, content: str) -> str:
        """A `tool` message's content as the model reads it (in a user turn)."""
        return f"<tool_response>\n{content}\n</tool_response>"

    def parse_body(self, body: str, names: set[str]) -> list[ToolCall] | None:
        """The calls in one block's body, or None when it is no valid call of a known tool."""
        try:
            value = json.loads(body)
        except (ValueError, RecursionError):
            return None
        items = value if isinstance(value, list) else [value]
        calls = [_call(item, names) for item in items]
        if not calls or any(c is None for c in calls):
            return None
        return calls

    def grammar(self, tools: list[dict], parallel: bool) -> str:
        """An xgrammar structural tag (JSON) that admits only calls of `tools`, at least one
        (one only unless `parallel`), arguments matching each function's `parameters`."""
        raise NotImplementedError


def _call(item: Any, names: set[str]) -> ToolCall | None:
    if not isinstance(item, dict) or item.get("name") not in names:
        return None
    args = item.get("arguments", item.get("parameters", {}))
    if isinstance(args, str):  # some models write the arguments as a JSON string
        try:
            args = json.loads(args)
        except (ValueError, RecursionError):
            return None
    if not isinstance(args, dict):
        return None
    return ToolCall(item["name"], json.dumps(args, ensure_ascii=False))


def call_schema(tool: dict) -> dict:
    """The JSON Schema of one call of an OpenAI function tool: its name, then its arguments."""
    fn = tool["function"]
    params = fn.get("parameters") or {"type": "object", "properties": {}}
    return {"type": "object", "properties": {"name": {"const": fn["name"]}, "arguments": params},
            "required": ["name", "arguments"], "additionalProperties": False}


def _functions(tools: list[dict]) -> list[dict]:
    return [{k: v for k, v in t["function"].items() if k != "strict"} for t in tools]


class SmolLM2Format(ToolFormat):
    name = "smollm2"

    def system_prompt(self, tools: list[dict]) -> str:
        return (
            "You are an expert in composing functions. You are given a question and a set of "
            "possible functions. Based on the question, make one or more function/tool calls "
            "to achieve the purpose. If none of the functions can be used, say so and do not "
            "call any. If the question lacks the parameters a function requires, say so.\n\n"
            f"You have access to the following tools:\n<tools>{json.dumps(_functions(tools))}"
            "</tools>\n\nThe output MUST strictly adhere to the following format, and NO other "
            "text MUST be included. Make sure each parameter has the right type. If no "
            "function call is needed, make the tool calls an empty list '[]'.\n<tool_call>[\n"
            '{"name": "func_name1", "arguments": {"argument1": "value1", "argument2": '
            '"value2"}},\n... (more tool calls as required)\n]</tool_call>')

    def render_calls(self, calls: list[dict]) -> str:
        lines = _call_lines(calls, ",\n")
        return f"{self.begin}[\n{lines}\n]{self.end}"

    def grammar(self, tools: list[dict], parallel: bool) -> str:
        calls = {"type": "array", "items": {"anyOf": [call_schema(t) for t in tools]},
                 "minItems": 1}
        if not parallel:
            calls["maxItems"] = 1
        return json.dumps({"type": "structural_tag", "format": {
            "type": "tag", "begin": self.begin, "end": self.end,
            "content": {"type": "json_schema", "json_schema": calls}}})


class HermesFormat(ToolFormat):
    name = "hermes"

    def system_prompt(self, tools: list[dict]) -> str:
        sigs = "\n".join(json.dumps({"type": "function", "function": f})
                         for f in _functions(tools))
        return (
            "# Tools\n\nYou may call one or more functions to assist with the user query.\n\n"
            f"You are provided with function signatures within <tools></tools> XML tags:\n"
            f"<tools>\n{sigs}\n</tools>\n\nFor each function call, return a json object with "
            "function name and arguments within <tool_call></tool_call> XML tags:\n"
            '<tool_call>\n{"name": <function-name>, "arguments": <args-json-object>}\n'
            "</tool_call>")

    def render_calls(self, calls: list[dict]) -> str:
        return "\n".join(f"{self.begin}\n{_call_lines([c], '')}\n{self.end}" for c in calls)

    def grammar(self, tools: list[dict], parallel: bool) -> str:
        tag = {"type": "tag", "begin": self.begin + "\n",
               "content": {"type": "json_schema",
                           "json_schema": {"anyOf": [call_schema(t) for t in tools]}},
               "end": "\n" + self.end}
        return json.dumps({"type": "structural_tag", "format": {
            "type": "tags_with_separator", "tags": [tag], "separator": "\n",
            "at_least_one": True, "stop_after_first": not parallel}})


def _call_lines(calls: list[dict], sep: str) -> str:
    return sep.join(json.dumps({"name": c["name"], "arguments": c["arguments"]},
                               ensure_ascii=False) for c in calls)


FORMATS: dict[str, type[ToolFormat]] = {"smollm2": SmolLM2Format, "hermes": HermesFormat}


def tool_format(parser: str, template_renders_tools: bool) -> ToolFormat:
    """The format `--tool-call-parser` names; "auto": hermes for a chat template that renders
    `tools` itself, else smollm2 (whose tool prompt we render)."""
    if parser == "auto":
        parser = "hermes" if template_renders_tools else "smollm2"
    return FORMATS[parser]()
