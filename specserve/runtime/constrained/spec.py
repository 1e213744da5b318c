"""What a request asks its output to match: one grammar, named by the field it came from.

SGLang's sampling parameters carry it (`json_schema`: a JSON Schema as a string, `regex`,
`ebnf`, `structural_tag`: xgrammar's structural tag as JSON); OpenAI's `response_format` and
`tools` are mapped onto them by the HTTP layer. Exactly one may be set.
"""

from __future__ import annotations

import hashlib
import json
from dataclasses import dataclass
from typing import Any

from specserve.runtime.errors import InvalidRequestError

# the sampling parameters that hold a grammar, in SGLang's names
GRAMMAR_FIELDS = ("json_schema", "regex", "ebnf", "structural_tag")
# the largest grammar text a request may send (a schema, regex or EBNF): compile time and the
# compiled grammar's size grow with it
MAX_GRAMMAR_BYTES = 64 * 1024


@dataclass(frozen=True)
class GrammarSpec:
    """One grammar: `kind` is the sampling parameter it came from (GRAMMAR_FIELDS), `source`
    its text. Errors about it name `kind` (the HTTP layer renames it to the request's field)."""

    kind: str
    source: str

    def key(self, options: str = "") -> str:
        """The cache key of its compiled form (with the backend's compile options)."""
        h = hashlib.sha256()
        for part in (self.kind, options, self.source):
            h.update(part.encode("utf-8"))
            h.update(b"\0")
        return h.hexdigest()[:32]


def grammar_of(values: dict[str, Any]) -> GrammarSpec | None:
    """The grammar a sampling-parameter dict sets (None: unconstrained), checked: each field a
    string within MAX_GRAMMAR_BYTES, a `json_schema` and a `structural_tag` valid JSON objects
    (a schema may also be `true`), and at most one of them set."""
    given = [name for name in GRAMMAR_FIELDS if values.get(name) is not None]
    if len(given) > 1:
        raise InvalidRequestError(given[1], f"only one of {', '.join(given)} may be set; "
                                  "a request follows one grammar")
    if not given:
        return None
    kind = given[0]
    source = values[kind]
    if not isinstance(source, str):
        raise InvalidRequestError(kind, f"must be a string, got {type(source).__name__}")
    size = len(source.encode("utf-8"))
    if size > MAX_GRAMMAR_BYTES:
        raise InvalidRequestError(kind, f"is {size} bytes; at most {MAX_GRAMMAR_BYTES} are "
                                  "accepted")
    if not source.strip() and kind != "regex":
        raise InvalidRequestError(kind, "must not be empty")
    if kind in ("json_schema", "structural_tag"):
        _check_json_object(kind, source)
    return GrammarSpec(kind, source)


def _check_json_object(kind: str, source: str) -> None:
    try:
        value = json.loads(source)
    except (ValueError, RecursionError) as exc:
        raise InvalidRequestError(kind, f"is not valid JSON: {exc}") from None
    if not isinstance(value, dict) and not (kind == "json_schema" and value is True):
        raise InvalidRequestError(kind, f"must be a JSON object, got {type(value).__name__}")
