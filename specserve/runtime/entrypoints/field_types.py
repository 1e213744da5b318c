"""The field types request bodies are built from.

Strict JSON types: no "10" for 10, no `true` for 1; 10.0, a JSON number without a fraction, is
the integer 10 (JSON has one number type; JSON Schema's "integer" and SGLang's parser take it).
Bounds are part of the type, so pydantic enforces them and the OpenAPI spec states them. An
upper bound that belongs to the server (its vocabulary, its context) is marked with `ServerBound`
and filled in when the spec is served (specserve/runtime/entrypoints/openapi.py); the server
checks it by hand.
"""

from __future__ import annotations

import json
from dataclasses import dataclass
from typing import Annotated, Any, Literal

from annotated_types import Interval, MaxLen, MinLen
from pydantic import (
    AfterValidator,
    AllowInfNan,
    BaseModel,
    BeforeValidator,
    ConfigDict,
    ValidationError,
    WithJsonSchema,
    WrapValidator,
)
from pydantic_core import PydanticCustomError

from specserve.runtime.sampling.sampling_params import integral

# the JSON-schema key a ServerBound leaves in the spec until the server fills it in
BOUND_KEY = "x-server-bound"


class Body(BaseModel):
    """A request body or one of its objects: strict types, and an unknown key is an error
    (a misspelt parameter is not silently ignored)."""

    model_config = ConfigDict(extra="forbid", strict=True)


def with_message(kind: Any, message: str) -> Any:
    """`kind`, whose refusal says `message` ("{input}" in it: the value sent) instead of
    pydantic's words for the check that failed."""

    def check(x: Any, handler: Any) -> Any:
        try:
            return handler(x)
        except ValidationError:
            raise PydanticCustomError("invalid", message, {"input": repr(x)}) from None

    return Annotated[kind, WrapValidator(check)]


@dataclass(frozen=True)
class ServerBound:
    """An integer's upper bound that is the server's: its `vocab_size`, `context_length` or
    `max_sequences_per_request`, less `minus`."""

    name: str
    minus: int = 0

    def __get_pydantic_json_schema__(self, core_schema: Any, handler: Any) -> dict:
        schema = handler(core_schema)
        schema[BOUND_KEY] = [self.name, self.minus]
        return schema


def int_in(ge: int | None = None, le: int | None = None,
           bound: ServerBound | None = None) -> Any:
    """A JSON integer in [ge, le] (either end open when None), `bound` the server's upper one.
    (The bounds come before the validator that makes 10.0 an int, or pydantic's JSON schema
    spells them "ge"/"le" instead of "minimum"/"maximum".)"""
    marks: tuple = (bound,) if bound else ()
    kind = Annotated[(int, Interval(ge=ge, le=le), *marks, BeforeValidator(integral))]
    return with_message(kind, "must be an integer" + _range(ge, le))


def number_in(ge: float | None = None, le: float | None = None,
              gt: float | None = None) -> Any:
    """A finite JSON number (an integer is a number too) within the bounds."""
    kind = Annotated[float, AllowInfNan(False), Interval(ge=ge, le=le, gt=gt)]
    return with_message(kind, "must be a finite number" + _range(ge, le, gt))


def _range(ge: float | None, le: float | None, gt: float | None = None) -> str:
    low = f"[{ge}" if ge is not None else f"({gt}" if gt is not None else None
    if low and le is not None:
        return f" in {low}, {le}]"
    if ge is not None:
        return f" >= {ge}"
    if gt is not None:
        return f" > {gt}"
    return f" <= {le}" if le is not None else ""


TokenId = int_in(ge=0, bound=ServerBound("vocab_size", 1))
TokenIds = Annotated[list[TokenId], MinLen(1)]
# tokens to generate: at most the context less a one-token prompt
NewTokens = int_in(ge=1, bound=ServerBound("context_length", 1))
NonEmptyText = Annotated[str, MinLen(1)]


def strings(max_items: int | None = None, non_empty: bool = False) -> Any:
    """A string or a list of strings (SGLang's and OpenAI's `stop`)."""
    item = NonEmptyText if non_empty else str
    many = Annotated[list[item], MaxLen(max_items)] if max_items else list[item]
    return item | many


def served_only(value: Any) -> Any:
    """A field this server serves at one value only (an extension other servers send at its
    default, e.g. sglang-router's): null or that value, anything else a 400 saying so."""
    return with_message(Literal[value] | None, "is not supported by this server: only "
                        f"{json.dumps(value)} is served")


def unsupported(detail: str = "") -> Any:
    """An OpenAI field this server cannot honour: absent, null or empty only."""
    message = "is not supported by this server" + (f": {detail}" if detail else "")

    def check(x: Any) -> Any:
        if x not in (None, [], {}):
            raise PydanticCustomError("unsupported", message)
        return None

    return Annotated[Any, AfterValidator(check),
                     WithJsonSchema({"type": "null", "description": message})]


def empty_only(kind: Any) -> Any:
    """A field of OpenAI's shape `kind` that this server serves only empty (`{}`, `[]`, "")."""

    def check(x: Any) -> Any:
        if x:
            raise PydanticCustomError("unsupported", "is not supported by this server")
        return x

    return Annotated[kind, AfterValidator(check), _StatedEmpty()]


class _StatedEmpty:
    """The spec says the field is empty (our validator, not a MaxLen, checks it, to say why)."""

    def __get_pydantic_json_schema__(self, core_schema: Any, handler: Any) -> dict:
        schema = handler(core_schema)
        key = {"object": "maxProperties", "array": "maxItems"}.get(schema.get("type"),
                                                                   "maxLength")
        schema[key] = 0
        return schema
