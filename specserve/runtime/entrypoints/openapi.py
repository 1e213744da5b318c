"""The OpenAPI request-body schemas the server serves, generated from the body types.

Routes read their bodies themselves (our 400s, not FastAPI's 422s), so each route states its
body with `openapi_extra`: the type's JSON schema, self-contained (pydantic's `$defs` inlined),
with this server's own bounds filled in (the largest token id, token count and `n` it takes), so a
client or a schema fuzzer sees what the server really accepts.
"""

from __future__ import annotations

from typing import Any

from pydantic import BaseModel

from specserve.runtime.entrypoints.field_types import BOUND_KEY


def openapi_body(cls: type[BaseModel], limits: dict[str, int]) -> dict[str, Any]:
    """`openapi_extra` for a route whose body is a `cls`; `limits`: the server's
    `vocab_size`, `context_length` and `max_sequences_per_request`."""
    schema = cls.model_json_schema()
    defs = schema.pop("$defs", {})

    def inline(node: Any) -> Any:
        if isinstance(node, list):
            return [inline(v) for v in node]
        if not isinstance(node, dict):
            return node
        ref = node.get("$ref", "")
        if ref.startswith("#/$defs/"):
            return inline(defs[ref.removeprefix("#/$defs/")])
        # a discriminator's mapping points into $defs; the oneOf it annotates says it all
        out = {k: inline(v) for k, v in node.items() if k != "discriminator"}
        if BOUND_KEY in out:
            name, minus = out.pop(BOUND_KEY)
            out["maximum"] = min(out.get("maximum", limits[name]), limits[name] - minus)
        return out

    return {"requestBody": {"required": True,
                            "content": {"application/json": {"schema": inline(schema)}}}}
