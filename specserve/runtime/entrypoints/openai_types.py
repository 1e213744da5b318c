"""OpenAI's structured request fields, typed: `tools`, `tool_choice`, `response_format`,
`stream_options`, `prediction`.

What a type cannot say is checked where the request is served: a named tool must be one of the
request's tools (specserve/runtime/tool_calls/request.py), a schema must compile.

`response_format` sets the grammar sampling parameter as SGLang maps it:
- `{"type": "text"}` (or none): unconstrained;
- `{"type": "json_object"}`: `json_schema` = `{"type": "object"}`, any JSON object;
- `{"type": "json_schema", "json_schema": {"name", "schema", "strict"?, "description"?}}`:
  `json_schema` = the schema. The output is constrained to the schema whether `strict` is true
  or not (as SGLang and vLLM do): `strict: false` allows OpenAI not to follow the schema
  exactly, and following it is allowed.
"""

from __future__ import annotations

import json
from typing import Annotated, Any, Literal

from annotated_types import MaxLen
from pydantic import Field, StringConstraints

from specserve.runtime.entrypoints.field_types import Body, with_message
from specserve.runtime.tool_calls.request import MAX_TOOLS

# OpenAI's function names (plus dots, which some clients send)
FunctionName = Annotated[str, StringConstraints(pattern=r"^[A-Za-z0-9_.-]{1,64}$")]
SchemaName = Annotated[str, StringConstraints(pattern=r"^[A-Za-z0-9_-]{1,64}$")]
JsonObject = dict[str, Any]


class FunctionDef(Body):
    name: FunctionName
    description: str | None = None
    parameters: JsonObject | None = None  # a JSON Schema of the arguments
    strict: bool | None = None


class Tool(Body):
    type: Literal["function"]
    function: FunctionDef


class CalledFunction(Body):
    name: str


class NamedToolChoice(Body):
    """`tool_choice` naming the one function the model must call."""

    type: Literal["function"]
    function: CalledFunction


Tools = Annotated[list[Tool], MaxLen(MAX_TOOLS)]
ToolChoice = Literal["none", "auto", "required"] | NamedToolChoice


class TextFormat(Body):
    type: Literal["text"]

    def grammar(self) -> dict[str, str]:
        return {}


class JsonObjectFormat(Body):
    type: Literal["json_object"]

    def grammar(self) -> dict[str, str]:
        return {"json_schema": '{"type": "object"}'}


class JsonSchemaSpec(Body):
    name: SchemaName
    description: str | None = None
    schema_: JsonObject = Field(alias="schema")
    strict: bool | None = None


class JsonSchemaFormat(Body):
    type: Literal["json_schema"]
    json_schema: JsonSchemaSpec

    def grammar(self) -> dict[str, str]:
        return {"json_schema": json.dumps(self.json_schema.schema_, ensure_ascii=False)}


# `grammar()`: the sampling parameters the format sets ({} or {"json_schema": JSON text})
ResponseFormat = Annotated[TextFormat | JsonObjectFormat | JsonSchemaFormat,
                           Field(discriminator="type")]


class StreamOptions(Body):
    include_usage: bool | None = None
    include_obfuscation: bool | None = None


TextType = with_message(Literal["text"], "content parts of type {input} are not supported "
                        "(text only)")


class TextPart(Body):
    type: TextType
    text: str


class Prediction(Body):
    """A latency hint in OpenAI's API (text the output will likely repeat); never changes the
    output, so it is accepted and not used."""

    type: Literal["content"]
    content: str | list[TextPart]
