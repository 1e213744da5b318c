"""A pydantic `ValidationError` as the one 400 a client reads: the path of the field in the
request's own JSON (`tool_choice.function.name`) and what is wrong there.

pydantic's error locations also name the union member each error came from
(`('tool_choice', 'NamedToolChoice', 'function', 'name')`), and a union reports one error per
member. The path keeps only the location parts that are keys or indices of the request's JSON;
among a union's members the one whose error lies deepest in the input wins (it matched the
most), and when members tie the error names the union's field itself.
"""

from __future__ import annotations

from typing import Any, NamedTuple

from pydantic import ValidationError

from specserve.runtime.errors import InvalidRequestError

# our words for pydantic's, where its name a Python type ("instance of NamedToolChoice")
_MESSAGES = {"extra_forbidden": "unknown parameter", "missing": "is required",
             "union_tag_not_found": "is required", "model_type": "must be an object",
             "model_attributes_type": "must be an object", "dict_type": "must be an object",
             "list_type": "must be a list", "string_type": "must be a string",
             "int_type": "must be an integer", "bool_type": "must be a boolean",
             "float_type": "must be a number"}
_TAG_ERRORS = ("union_tag_invalid", "union_tag_not_found")


class _Located(NamedTuple):
    path: tuple  # keys and indices into the request's JSON
    branches: tuple  # (len(path) where it branched, member tag) for each union passed
    message: str


def request_error(exc: ValidationError, data: Any) -> InvalidRequestError:
    """The error to answer `exc` with, for the request body `data` it was raised on."""
    located = [_locate(err, data) for err in exc.errors()]
    first = located[0]
    if first.branches:  # the errors of the union the first error is in
        pos, prefix = first.branches[0][0], first.path[:first.branches[0][0]]
        group = [e for e in located if e.branches and e.branches[0][0] == pos
                 and e.path[:pos] == prefix]
        first = _resolve(group, 0)
    return InvalidRequestError(".".join(str(p) for p in first.path) or "body", first.message)


def _resolve(errors: list[_Located], level: int) -> _Located:
    """One error for a union's errors: its deepest member's, or the union's own."""
    depth = max(len(e.path) for e in errors)
    deepest = [e for e in errors if len(e.path) == depth]
    here = [e for e in deepest if len(e.branches) > level]
    if not here:
        return deepest[0]
    tags = {e.branches[level] for e in here}
    if len(tags) == 1:
        return _resolve(here, level + 1)
    pos = here[0].branches[level][0]
    reasons = "; ".join(dict.fromkeys(e.message for e in here))
    return _Located(here[0].path[:pos], (), f"matches none of its accepted forms ({reasons})")


def _locate(err: dict, data: Any) -> _Located:
    path, branches, cur = [], [], data
    loc = err["loc"]
    for i, part in enumerate(loc):
        if isinstance(cur, dict) and isinstance(part, str) and part in cur:
            cur = cur[part]
        elif isinstance(cur, list) and type(part) is int and 0 <= part < len(cur):
            cur = cur[part]
        elif i == len(loc) - 1 and err["type"] == "missing":
            pass  # the key the input lacks
        else:
            branches.append((len(path), part))
            continue
        path.append(part)
    if err["type"] in _TAG_ERRORS:  # the field that picks the member is wrong or missing
        path.append(str(err.get("ctx", {}).get("discriminator", "type")).strip("'"))
    return _Located(tuple(path), tuple(branches), _message(err))


def _message(err: dict) -> str:
    if err["type"] == "union_tag_invalid":
        ctx = err["ctx"]
        return f"must be one of {ctx['expected_tags']}, got {ctx['tag']!r}"
    return _MESSAGES.get(err["type"], err["msg"])
