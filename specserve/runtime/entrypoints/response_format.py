"""OpenAI's `response_format` as the grammar sampling parameter it sets (SGLang's mapping).

- `{"type": "text"}` (or none): unconstrained;
- `{"type": "json_object"}`: `json_schema` = `{"type": "object"}`, any JSON object;
- `{"type": "json_schema", "json_schema": {"name", "schema", "strict"?, "description"?}}`:
  `json_schema` = the schema. The output is constrained to the schema whether `strict` is true
  or not (as SGLang and vLLM do): `strict: false` allows OpenAI not to follow the schema
  exactly, and following it is allowed.
"""

from __future__ import annotations

import json
import re
from typing import Any

from specserve.runtime.errors import InvalidRequestError

FIELD = "response_format"
_NAME = re.compile(r"^[A-Za-z0-9_-]{1,64}$")
_SCHEMA_KEYS = ("name", "description", "schema", "strict")


def response_format_grammar(fmt: Any) -> dict[str, str]:
    """The sampling parameters `fmt` sets: {} or {"json_schema": schema as JSON text}."""
    if fmt is None:
        return {}
    if not isinstance(fmt, dict) or not isinstance(fmt.get("type"), str):
        raise InvalidRequestError(FIELD, 'must be an object with a "type"')
    kind = fmt["type"]
    extra = set(fmt) - {"type", "json_schema"}
    if extra:
        raise InvalidRequestError(f"{FIELD}.{sorted(extra)[0]}", "unknown parameter")
    if kind == "text":
        return {}
    if kind == "json_object":
        return {"json_schema": '{"type": "object"}'}
    if kind != "json_schema":
        raise InvalidRequestError(f"{FIELD}.type", 'must be "text", "json_object" or '
                                  f'"json_schema", got {kind!r}')
    spec = fmt.get("json_schema")
    where = f"{FIELD}.json_schema"
    if not isinstance(spec, dict):
        raise InvalidRequestError(where, "must be an object with a name and a schema")
    for key in spec:
        if key not in _SCHEMA_KEYS:
            raise InvalidRequestError(f"{where}.{key}", "unknown parameter")
    if not isinstance(spec.get("name"), str) or not _NAME.match(spec["name"]):
        raise InvalidRequestError(f"{where}.name", "must be 1-64 characters of a-z, A-Z, 0-9, "
                                  "'_' and '-'")
    if spec.get("strict") is not None and not isinstance(spec["strict"], bool):
        raise InvalidRequestError(f"{where}.strict", "must be a boolean")
    if spec.get("description") is not None and not isinstance(spec["description"], str):
        raise InvalidRequestError(f"{where}.description", "must be a string")
    schema = spec.get("schema")
    if not isinstance(schema, dict):
        raise InvalidRequestError(f"{where}.schema", "must be a JSON Schema object")
    return {"json_schema": json.dumps(schema, ensure_ascii=False)}
