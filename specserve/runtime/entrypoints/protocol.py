"""Reading a request body into its type, and the HTTP answer to every error.

Bad input becomes `InvalidRequestError(field, message)`, which the server answers with a 400
naming the field. Bodies are the pydantic types of specserve/runtime/entrypoints/request_bodies.py;
a body of the wrong shape is refused before any handler code runs.
"""

from __future__ import annotations

import asyncio
import json
from typing import Any, TypeVar

from pydantic import BaseModel, ValidationError
from starlette.requests import Request

from specserve.runtime.entrypoints.validation_errors import request_error
from specserve.runtime.errors import InvalidRequestError, ModelNotFoundError, QueueFullError
from specserve.runtime.tokenizer.tokenizer_manager import BackendDeadError

ModelT = TypeVar("ModelT", bound=BaseModel)


class BodyTooLarge(Exception):
    """The request body grew past `max_request_bytes` while it was being read."""


def error_body(message: str, param: str | None, code: int,
               kind: str = "invalid_request_error") -> dict:
    """OpenAI's error shape; /generate and the native endpoints use it too. Text echoed from
    the request is made encodable (a lone surrogate becomes `\\udcff`)."""
    return {"error": {"message": _printable(message), "type": kind,
                      "param": None if param is None else _printable(param), "code": code}}


def _printable(s: str) -> str:
    return s.encode("utf-8", "backslashreplace").decode("utf-8")


async def read_json(request: Request) -> dict[str, Any]:
    """The body as a JSON object (size-limited by the guard middleware around the app)."""
    body = await request.body()
    if not body.strip():
        raise InvalidRequestError("body", "the request body is empty; expected a JSON object")
    try:
        data = json.loads(body, parse_constant=_not_json)
    except (ValueError, RecursionError) as exc:  # UnicodeDecodeError is a ValueError
        raise InvalidRequestError("body", f"invalid JSON: {exc}") from None
    if not isinstance(data, dict):
        raise InvalidRequestError("body", f"expected a JSON object, got {type(data).__name__}")
    _check_unicode(data)
    return data


def _not_json(name: str) -> None:
    # Python's parser takes NaN and Infinity; JSON has no such numbers
    raise ValueError(f"{name} is not a JSON value")


def _check_unicode(data: dict[str, Any]) -> None:
    """400 for a string holding a lone surrogate (JSON's "\\udcff" escape parses to one): it is
    no Unicode text, so the tokenizer, the chat template and the IPC encoder all refuse it."""
    try:
        json.dumps(data, ensure_ascii=False).encode("utf-8")
        return
    except UnicodeEncodeError:
        pass
    except RecursionError:
        raise InvalidRequestError("body", "is nested too deeply") from None
    stack: list[tuple[str, Any]] = [("", data)]
    while stack:  # find the first offending field, to name it
        path, value = stack.pop()
        items = value.items() if isinstance(value, dict) else enumerate(value) \
            if isinstance(value, list) else ()
        for key, item in items:
            where = f"{path}.{key}" if path else str(key)
            if isinstance(key, str) and not _is_text(key):
                raise InvalidRequestError(where, "the key is not valid Unicode text "
                                          "(it holds a lone surrogate)")
            if isinstance(item, str):
                if not _is_text(item):
                    raise InvalidRequestError(where, "is not valid Unicode text (it holds a "
                                              "lone UTF-16 surrogate such as \\udcff)")
            elif isinstance(item, (dict, list)):
                stack.append((where, item))
    raise InvalidRequestError("body", "is not valid Unicode text")


def _is_text(s: str) -> bool:
    try:
        s.encode("utf-8")
    except UnicodeEncodeError:
        return False
    return True


def parse_model(cls: type[ModelT], data: dict[str, Any]) -> ModelT:
    """`data` as a `cls`; a wrong type or shape anywhere is a 400 naming its path."""
    try:
        return cls.model_validate(data)
    except ValidationError as exc:
        raise request_error(exc, data) from None


def error_for(exc: Exception) -> tuple[int, dict]:
    """HTTP status and JSON body for an exception raised while serving a request."""
    if isinstance(exc, ModelNotFoundError):  # OpenAI: 404, code "model_not_found"
        body = error_body(exc.message, "model", 404)
        body["error"]["code"] = "model_not_found"
        return 404, body
    if isinstance(exc, InvalidRequestError):
        return 400, error_body(str(exc), exc.field, 400)
    if isinstance(exc, QueueFullError):  # SGLang's words and status for a full queue
        return 503, error_body(str(exc), None, 503, "service_unavailable_error")
    if isinstance(exc, (BackendDeadError, TimeoutError, asyncio.TimeoutError)):
        msg = f"the server cannot serve requests: {str(exc) or 'timed out'}"
        return 503, error_body(msg, None, 503, "service_unavailable_error")
    if isinstance(exc, BodyTooLarge):
        return 413, error_body(str(exc), None, 413)
    return 500, error_body("internal server error", None, 500, "server_error")

