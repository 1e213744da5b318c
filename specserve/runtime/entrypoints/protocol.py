"""Request bodies of the HTTP API: reading JSON, typed models, and the checks they need.

Everything here turns bad input into `InvalidRequestError(field, message)`, which the server
answers with a 400 naming the field. Bodies are pydantic models in strict mode (no "10" for 10,
no `true` for 1; 10.0, the JSON number, is 10) with `extra="forbid"`, so a misspelt parameter is
an error, not silently ignored.
"""

from __future__ import annotations

import asyncio
import json
from typing import Annotated, Any, TypeVar

from pydantic import BaseModel, BeforeValidator, ConfigDict, ValidationError, WithJsonSchema
from starlette.requests import Request

from specserve.runtime.errors import InvalidRequestError, ModelNotFoundError, QueueFullError
from specserve.runtime.sampling.logprobs import MAX_TOP_LOGPROBS
from specserve.runtime.sampling.sampling_params import integral
from specserve.runtime.tokenizer.tokenizer_manager import BackendDeadError

ModelT = TypeVar("ModelT", bound=BaseModel)
MAX_N = 128  # OpenAI's own limit on `n`


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
        data = json.loads(body)
    except (ValueError, RecursionError) as exc:  # UnicodeDecodeError is a ValueError
        raise InvalidRequestError("body", f"invalid JSON: {exc}") from None
    if not isinstance(data, dict):
        raise InvalidRequestError("body", f"expected a JSON object, got {type(data).__name__}")
    _check_unicode(data)
    return data


def _check_unicode(data: dict[str, Any]) -> None:
    """400 for a string holding a lone surrogate (JSON's "\\udcff" escape parses to one): it is
    no Unicode text, so the tokenizer, the chat template and the IPC encoder all refuse it."""
    try:
        json.dumps(data, ensure_ascii=False).encode("utf-8")
        return
    except UnicodeEncodeError:
        pass
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
    try:
        return cls.model_validate(data)
    except ValidationError as exc:
        err = exc.errors()[0]
        field = ".".join(str(part) for part in err["loc"]) or "body"
        if err["type"] == "extra_forbidden":
            raise InvalidRequestError(field, "unknown parameter") from None
        raise InvalidRequestError(field, err["msg"]) from None


class _Body(BaseModel):
    model_config = ConfigDict(extra="forbid", strict=True)


def openapi_body(cls: type[BaseModel]) -> dict[str, Any]:
    """`openapi_extra` for a route that reads `cls` from its raw body itself (our own 400s, not
    FastAPI's 422s): the request body schema, with pydantic's `$defs` inlined."""
    schema = cls.model_json_schema()
    defs = schema.pop("$defs", {})

    def inline(node: Any) -> Any:
        if isinstance(node, dict):
            ref = node.get("$ref", "")
            if ref.startswith("#/$defs/"):
                return inline(defs[ref.removeprefix("#/$defs/")])
            return {k: inline(v) for k, v in node.items()}
        if isinstance(node, list):
            return [inline(v) for v in node]
        return node

    return {"requestBody": {"required": True,
                            "content": {"application/json": {"schema": inline(schema)}}}}


# Fields typed `Any` here are checked by hand (several JSON shapes each); these schemas tell
# clients and schema fuzzers which shapes are meant.
_STR = {"type": "string"}
_IDS = {"type": "array", "items": {"type": "integer", "minimum": 0}}
_STR_OR_LIST = {"anyOf": [_STR, {"type": "array", "items": _STR}, {"type": "null"}]}
# an integer field: strict (no "10", no true), but a JSON number without a fractional part
# (10.0) is the integer it spells, as JSON Schema and SGLang's parser have it
Int = Annotated[int, BeforeValidator(integral)]
Text = Annotated[Any, WithJsonSchema(_STR_OR_LIST)]
# /generate's prompt: one of `text` and `input_ids` (the model's `oneOf`), never null
PromptText = Annotated[Any, WithJsonSchema(
    {"anyOf": [{**_STR, "minLength": 1}, {"type": "array", "items": _STR, "minItems": 1}]})]
TokenIds = Annotated[Any, WithJsonSchema(
    {"anyOf": [{**_IDS, "minItems": 1}, {"type": "array", "items": _IDS, "minItems": 1}]})]
# /generate's sampling parameters (specserve/runtime/sampling/sampling_params.py checks them); the
# grammar ones are spelled out here, at most one per request (docs/structured_output.md)
_SAMPLING = {"type": "object", "properties": {
    "json_schema": {**_STR, "description": "a JSON Schema (as a JSON string) the output must "
                    "match"},
    "regex": {**_STR, "description": "a regular expression the whole output must match"},
    "ebnf": {**_STR, "description": "an EBNF grammar (GBNF, root rule `root`) the output must "
             "match"},
    "structural_tag": {**_STR, "description": "an xgrammar structural tag (as a JSON string) "
                       "the output must match"},
}, "additionalProperties": True}
SamplingDict = Annotated[Any, WithJsonSchema(
    {"anyOf": [_SAMPLING, {"type": "array", "items": _SAMPLING}, {"type": "null"}]})]
Prompt = Annotated[Any, WithJsonSchema(
    {"anyOf": [_STR, {"type": "array", "items": _STR}, _IDS, {"type": "array", "items": _IDS}]})]
TopLogprobs = Annotated[Any, WithJsonSchema(
    {"anyOf": [{"type": "integer", "minimum": 0, "maximum": MAX_TOP_LOGPROBS},
               {"type": "null"}]})]
_TOOL_CALL = {"type": "object", "required": ["type", "function"], "properties": {
    "id": _STR, "type": {"const": "function"},
    "function": {"type": "object", "required": ["name", "arguments"],
                 "properties": {"name": _STR, "arguments": _STR}}}}
Messages = Annotated[Any, WithJsonSchema({"type": "array", "minItems": 1, "items": {
    "type": "object", "required": ["role"],
    "properties": {"role": {"enum": ["system", "developer", "user", "assistant", "tool"]},
                   "content": {"anyOf": [_STR, {"type": "array"}, {"type": "null"}]},
                   "name": _STR, "tool_calls": {"type": "array", "items": _TOOL_CALL},
                   "tool_call_id": _STR}}})]
_JSON_SCHEMA_FORMAT = {"type": "object", "required": ["type", "json_schema"], "properties": {
    "type": {"const": "json_schema"},
    "json_schema": {"type": "object", "required": ["name", "schema"], "properties": {
        "name": _STR, "description": _STR, "schema": {"type": "object"},
        "strict": {"type": ["boolean", "null"]}}}}}
ResponseFormat = Annotated[Any, WithJsonSchema({"anyOf": [
    {"type": "object", "required": ["type"], "properties": {"type": {"const": "text"}}},
    {"type": "object", "required": ["type"], "properties": {"type": {"const": "json_object"}}},
    _JSON_SCHEMA_FORMAT, {"type": "null"}]})]
Tools = Annotated[Any, WithJsonSchema({"anyOf": [{"type": "array", "items": {
    "type": "object", "required": ["type", "function"], "properties": {
        "type": {"const": "function"},
        "function": {"type": "object", "required": ["name"], "properties": {
            "name": _STR, "description": _STR, "parameters": {"type": "object"},
            "strict": {"type": ["boolean", "null"]}}}}}}, {"type": "null"}]})]
ToolChoice = Annotated[Any, WithJsonSchema({"anyOf": [
    {"enum": ["none", "auto", "required"]},
    {"type": "object", "required": ["type", "function"], "properties": {
        "type": {"const": "function"},
        "function": {"type": "object", "required": ["name"], "properties": {"name": _STR}}}},
    {"type": "null"}]})]


def _schema_requires(extra: dict[str, Any]) -> ConfigDict:
    """The body's model config, with JSON-schema-only constraints (the checks themselves are
    ours, with our messages): what the spec tells clients and schema fuzzers."""
    return ConfigDict(extra="forbid", strict=True, json_schema_extra=extra)


class GenerateRequest(_Body):
    """SGLang's /generate body."""

    model_config = _schema_requires({"oneOf": [{"required": ["text"]},
                                               {"required": ["input_ids"]}]})

    text: PromptText = None  # str | list[str]
    input_ids: TokenIds = None  # list[int] | list[list[int]]
    sampling_params: SamplingDict = None  # dict | list[dict]
    stream: bool = False
    rid: Text = None  # str | list[str]
    return_logprob: bool = False
    logprob_start_len: Int | None = None
    top_logprobs_num: Int | None = None
    return_text_in_logprobs: bool | None = None
    priority: Int | None = None  # --enable-priority-scheduling; every prompt of a batch
    # meta_info.spec_trace: every step's draft tree and outcome (docs/playground.md)
    return_spec_trace: bool = False
    disable_speculation: bool = False  # decode plainly: the same output, without drafts
    # what sglang-router adds to every body it forwards: the model name (one per server),
    # SGLang's logging switches (no-ops here), and outputs we do not produce, at their off value
    model: str | None = None
    log_metrics: bool | None = None
    no_logs: bool | None = None
    return_hidden_states: bool | None = None
    background: bool | None = None
    return_bytes: bool | None = None
    return_entropy: bool | None = None

    def check_supported(self) -> None:
        only_default(self, {"return_hidden_states": False, "background": False,
                            "return_bytes": False, "return_entropy": False})


class AbortRequest(_Body):
    rid: str


class StreamOptions(_Body):
    include_usage: bool | None = None
    include_obfuscation: bool | None = None


class _OpenAISampling(_Body):
    """Sampling fields shared by /v1/completions and /v1/chat/completions (OpenAI names), plus
    the extensions SGLang and vLLM accept."""

    model: str | None = None
    n: Int | None = None
    stop: Text = None  # str | list[str]; checked by SamplingParams
    seed: Int | None = None
    stream: bool | None = None
    stream_options: StreamOptions | None = None
    temperature: float | None = None
    top_p: float | None = None
    frequency_penalty: float | None = None
    presence_penalty: float | None = None
    logit_bias: dict[str, float] | None = None
    user: str | None = None
    top_k: Int | None = None
    min_p: float | None = None
    repetition_penalty: float | None = None
    ignore_eos: bool | None = None
    stop_token_ids: list[Int] | None = None
    priority: Int | None = None  # vLLM's and SGLang's extension (--enable-priority-scheduling)
    # ours: each choice's `spec_trace` (docs/playground.md), and plain decoding on request
    return_spec_trace: bool | None = None
    disable_speculation: bool | None = None
    # SGLang's extensions that sglang-router sends at their default values (served as those)
    no_stop_trim: bool | None = None
    skip_special_tokens: bool | None = None
    return_hidden_states: bool | None = None

    def base_sampling(self) -> dict[str, Any]:
        """The SamplingParams fields this body sets (OpenAI names mapped to ours)."""
        names = ("stop", "seed", "temperature", "top_p", "frequency_penalty", "presence_penalty",
                 "top_k", "min_p", "repetition_penalty", "ignore_eos", "stop_token_ids")
        return {k: getattr(self, k) for k in names if getattr(self, k) is not None}

    def num_choices(self) -> int:
        n = 1 if self.n is None else self.n
        if not 1 <= n <= MAX_N:
            raise InvalidRequestError("n", f"must be in [1, {MAX_N}], got {n}")
        return n

    def include_usage(self) -> bool:
        return bool(self.stream_options and self.stream_options.include_usage)

    def check_common(self) -> None:
        if self.logit_bias:
            unsupported("logit_bias")
        only_default(self, {"no_stop_trim": False, "skip_special_tokens": True,
                            "return_hidden_states": False})


class CompletionRequest(_OpenAISampling):
    model_config = _schema_requires({"required": ["prompt"]})

    prompt: Prompt = None  # str | list[str] | list[int] | list[list[int]]
    max_tokens: Int | None = 16  # OpenAI's default for completions
    logprobs: TopLogprobs = None  # int in [0, MAX_TOP_LOGPROBS]; checked by top_logprobs()
    echo: bool | None = None
    best_of: Int | None = None
    suffix: str | None = None
    response_format: ResponseFormat = None

    def check_supported(self) -> None:
        self.check_common()
        self.top_logprobs()
        if self.best_of is not None and self.best_of != self.num_choices():
            unsupported("best_of", "only best_of == n is supported")
        if self.suffix:
            unsupported("suffix")


    def top_logprobs(self) -> int | None:
        """Alternatives per position when logprobs are wanted (0: only the chosen token's),
        None when not: OpenAI's integer `logprobs`."""
        lp = integral(self.logprobs)
        if lp is None or lp is False:
            return None
        if type(lp) is not int or not 0 <= lp <= MAX_TOP_LOGPROBS:
            raise InvalidRequestError("logprobs", f"must be an integer in [0, "
                                      f"{MAX_TOP_LOGPROBS}]")
        return lp


class ChatCompletionRequest(_OpenAISampling):
    model_config = _schema_requires({"required": ["messages"]})

    messages: Messages = None
    max_tokens: Int | None = None
    max_completion_tokens: Int | None = None
    logprobs: bool | None = None
    top_logprobs: Int | None = None
    tools: Tools = None
    tool_choice: ToolChoice = None
    parallel_tool_calls: bool | None = None
    functions: Any = None
    function_call: Any = None
    response_format: ResponseFormat = None
    modalities: Any = None
    audio: Any = None
    prediction: Any = None  # a latency hint in OpenAI's API; never changes the output
    reasoning_effort: Any = None
    verbosity: Any = None
    web_search_options: Any = None
    metadata: dict[str, str] | None = None
    store: bool | None = None
    service_tier: str | None = None
    prompt_cache_key: str | None = None
    # SGLang's: no reasoning parser runs here, so there is no reasoning to separate or stream
    separate_reasoning: bool | None = None
    stream_reasoning: bool | None = None
    continue_final_message: bool | None = None
    safety_identifier: str | None = None

    def check_supported(self) -> None:
        """400 for every parameter that would change the output and that we cannot honour."""
        self.check_common()
        self.logprob_top()
        for name in ("functions", "function_call", "audio", "reasoning_effort",
                     "verbosity", "web_search_options"):
            if getattr(self, name) not in (None, [], {}):
                unsupported(name, "use `tools`" if name.startswith("function") else "")
        if self.modalities not in (None, ["text"]):
            unsupported("modalities", 'only ["text"] is supported')
        only_default(self, {"continue_final_message": False})

    def logprob_top(self) -> int | None:
        """Alternatives per token when `logprobs` is true (`top_logprobs`, default 0), else
        None; `top_logprobs` without `logprobs` is an error, as OpenAI has it."""
        top = self.top_logprobs
        if top is not None and not 0 <= top <= MAX_TOP_LOGPROBS:
            raise InvalidRequestError("top_logprobs", f"must be in [0, {MAX_TOP_LOGPROBS}]")
        if not self.logprobs:
            if top:
                raise InvalidRequestError("top_logprobs", "needs 'logprobs': true")
            return None
        return top or 0

    def max_tokens_field(self) -> str:
        return "max_completion_tokens" if self.max_completion_tokens is not None else "max_tokens"


def only_default(body: BaseModel, defaults: dict[str, Any]) -> None:
    """400 for a field set to anything but the value this server serves (None: not sent)."""
    for name, value in defaults.items():
        got = getattr(body, name)
        if got is not None and got != value:
            unsupported(name, f"only {json.dumps(value)} is served")


def unsupported(field: str, detail: str = "") -> None:
    raise InvalidRequestError(field, "is not supported by this server" + (f": {detail}" if
                                                                           detail else ""))


def is_int_list(x: Any) -> bool:
    """A list of JSON integers (2 or 2.0; not true, not "2"): `int_ids` makes them ints."""
    return isinstance(x, list) and all(type(integral(t)) is int for t in x)


def int_ids(x: list) -> list[int]:
    """The ints of a list that `is_int_list` accepted (a new list)."""
    return [integral(t) for t in x]


def is_str_list(x: Any) -> bool:
    return isinstance(x, list) and all(isinstance(s, str) for s in x)


def prompt_batch(prompt: Any, tokenize, field: str = "prompt") -> list[list[int]]:
    """Token ids of a completion prompt: str, list[str], list[int] or list[list[int]]."""
    if isinstance(prompt, str):
        return [tokenize(prompt)]
    if isinstance(prompt, list) and prompt:
        if is_str_list(prompt):
            return [tokenize(p) for p in prompt]
        if is_int_list(prompt):
            return [int_ids(prompt)]
        if all(is_int_list(p) for p in prompt):
            return [int_ids(p) for p in prompt]
    if isinstance(prompt, list) and not prompt:
        raise InvalidRequestError(field, "must not be empty")
    raise InvalidRequestError(field, "must be a string, a list of strings, a list of token ids "
                              "or a list of lists of token ids")


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

