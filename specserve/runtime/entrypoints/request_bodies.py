"""The request bodies of the HTTP API, typed: SGLang's /generate and /abort_request, OpenAI's
/v1/completions and /v1/chat/completions (with the extensions SGLang and vLLM accept).

A body of the wrong type or shape anywhere is a 400 naming the field's path before any handler
code runs (specserve/runtime/entrypoints/protocol.py: `parse_model`), and the OpenAPI spec the
server serves is generated from these types (specserve/runtime/entrypoints/openapi.py). The
handlers check by hand only what a type cannot say: a prompt that fits the context, token ids
within the vocabulary, a grammar that compiles, a named tool among the request's tools, fields
that depend on each other.
"""

from __future__ import annotations

from typing import Annotated, Any, Literal

from annotated_types import MaxLen, MinLen
from pydantic import BeforeValidator, ConfigDict, Field

from specserve.runtime.constrained.spec import MAX_GRAMMAR_BYTES
from specserve.runtime.entrypoints.chat_messages import Messages
from specserve.runtime.entrypoints.field_types import (
    Body,
    NewTokens,
    NonEmptyText,
    ServerBound,
    TokenId,
    TokenIds,
    empty_only,
    int_in,
    number_in,
    served_only,
    strings,
    unsupported,
    with_message,
)
from specserve.runtime.entrypoints.openai_types import (
    Prediction,
    ResponseFormat,
    StreamOptions,
    ToolChoice,
    Tools,
)
from specserve.runtime.errors import InvalidRequestError
from specserve.runtime.sampling.logprobs import MAX_TOP_LOGPROBS
from specserve.runtime.sampling.sampling_params import (
    MAX_SCALE,
    MAX_SEED,
    MAX_STOP_STRINGS,
    MIN_SCALE,
    integral,
)
from specserve.runtime.tokenizer.tokenizer_manager import PRIORITY_MAX, PRIORITY_MIN

MAX_N = 128  # OpenAI's own limit on `n`

# the sampling fields both APIs share (SamplingParams checks them again for Engine users)
Temperature = number_in(ge=0, le=MAX_SCALE)
TopP = number_in(gt=0, le=1)
MinP = number_in(ge=0, le=1)
Penalty = number_in(ge=-2, le=2)  # frequency and presence
RepetitionPenalty = number_in(ge=MIN_SCALE, le=MAX_SCALE)
TopK = with_message(Annotated[Literal[-1] | int_in(ge=1, bound=ServerBound("vocab_size")),
                              BeforeValidator(integral)], "must be -1 (off) or an integer >= 1")
Seed = int_in(ge=0, le=MAX_SEED - 1)
Stop = strings(max_items=MAX_STOP_STRINGS, non_empty=True)
Priority = int_in(ge=PRIORITY_MIN, le=PRIORITY_MAX)
# (a request holds at most --max-sequences-per-request sequences: prompts x n)
N = int_in(ge=1, le=MAX_N, bound=ServerBound("max_sequences_per_request"))
# a grammar's text (its size in UTF-8 bytes is checked too: constrained/spec.py)
Grammar = Annotated[str, MaxLen(MAX_GRAMMAR_BYTES)]
LogitBias = empty_only(dict[Annotated[str, Field(pattern=r"^[0-9]+$")],
                            number_in(ge=-100, le=100)])


class SamplingBody(Body):
    """/generate's `sampling_params` (SGLang's names; SamplingParams holds the defaults). At
    most one grammar field may be set (docs/structured_output.md)."""

    max_new_tokens: NewTokens | None = None
    temperature: Temperature | None = None
    top_p: TopP | None = None
    top_k: TopK | None = None
    min_p: MinP | None = None
    repetition_penalty: RepetitionPenalty | None = None
    frequency_penalty: Penalty | None = None
    presence_penalty: Penalty | None = None
    stop: Stop | None = None
    stop_token_ids: list[TokenId] | None = None
    ignore_eos: bool | None = None
    seed: Seed | None = None
    n: N | None = None  # SGLang's parallel sampling: n samples of every prompt
    json_schema: Grammar | None = Field(None, description="a JSON Schema (as a JSON string) "
                                        "the output must match")
    regex: Grammar | None = Field(None, description="a regular expression the whole output "
                                  "must match")
    ebnf: Grammar | None = Field(None, description="an EBNF grammar (GBNF, root rule `root`) "
                                 "the output must match")
    structural_tag: Grammar | None = Field(None, description="an xgrammar structural tag (as "
                                           "a JSON string) the output must match")

    def given(self) -> dict[str, Any]:
        """The fields the request set (null: not set), for `SamplingParams.from_dict`."""
        return self.model_dump(exclude_none=True)


class GenerateRequest(Body):
    """SGLang's /generate body: exactly one of `text` and `input_ids`."""

    model_config = ConfigDict(json_schema_extra={"oneOf": [{"required": ["text"]},
                                                           {"required": ["input_ids"]}]})

    text: NonEmptyText | Annotated[list[NonEmptyText], MinLen(1)] | None = None
    input_ids: TokenIds | Annotated[list[TokenIds], MinLen(1)] | None = None
    sampling_params: SamplingBody | list[SamplingBody] | None = None  # a list: one per prompt
    stream: bool = False
    rid: str | list[str] | None = None
    return_logprob: bool = False
    logprob_start_len: int_in(ge=-1) | None = None
    top_logprobs_num: int_in(ge=0, le=MAX_TOP_LOGPROBS) | None = None
    return_text_in_logprobs: bool | None = None
    priority: Priority | None = None  # --enable-priority-scheduling; every prompt of a batch
    # meta_info.spec_trace: every step's draft tree and outcome (docs/playground.md)
    return_spec_trace: bool = False
    disable_speculation: bool = False  # decode plainly: the same output, without drafts
    # what sglang-router adds to every body it forwards: the model name (one per server),
    # SGLang's logging switches (no-ops here), and outputs we do not produce, at their off value
    model: str | None = None
    log_metrics: bool | None = None
    no_logs: bool | None = None
    return_hidden_states: served_only(False) = None
    background: served_only(False) = None
    return_bytes: served_only(False) = None
    return_entropy: served_only(False) = None


class AbortRequest(Body):
    rid: str


class _OpenAISampling(Body):
    """Sampling fields shared by /v1/completions and /v1/chat/completions (OpenAI names), plus
    the extensions SGLang and vLLM accept."""

    model: str | None = None
    n: N | None = None
    stop: Stop | None = None
    seed: Seed | None = None
    stream: bool | None = None
    stream_options: StreamOptions | None = None
    temperature: Temperature | None = None
    top_p: TopP | None = None
    frequency_penalty: Penalty | None = None
    presence_penalty: Penalty | None = None
    logit_bias: LogitBias | None = None
    user: str | None = None
    top_k: TopK | None = None
    min_p: MinP | None = None
    repetition_penalty: RepetitionPenalty | None = None
    ignore_eos: bool | None = None
    stop_token_ids: list[TokenId] | None = None
    priority: Priority | None = None  # vLLM's and SGLang's extension
    # ours: each choice's `spec_trace` (docs/playground.md), and plain decoding on request
    return_spec_trace: bool | None = None
    disable_speculation: bool | None = None
    # SGLang's extensions that sglang-router sends at their default values (served as those)
    no_stop_trim: served_only(False) = None
    skip_special_tokens: served_only(True) = None
    return_hidden_states: served_only(False) = None

    def base_sampling(self) -> dict[str, Any]:
        """The SamplingParams fields this body sets (OpenAI names mapped to ours)."""
        names = ("stop", "seed", "temperature", "top_p", "frequency_penalty", "presence_penalty",
                 "top_k", "min_p", "repetition_penalty", "ignore_eos", "stop_token_ids")
        return {k: getattr(self, k) for k in names if getattr(self, k) is not None}

    def num_choices(self) -> int:
        return 1 if self.n is None else self.n

    def include_usage(self) -> bool:
        return bool(self.stream_options and self.stream_options.include_usage)


Prompt = NonEmptyText | Annotated[list[str], MinLen(1)] | TokenIds | \
    Annotated[list[TokenIds], MinLen(1)]


class CompletionRequest(_OpenAISampling):
    prompt: Prompt
    max_tokens: NewTokens | None = 16  # OpenAI's default for completions
    # alternatives per position (0: the chosen token's logprob only); false or null: none
    logprobs: int_in(ge=0, le=MAX_TOP_LOGPROBS) | Literal[False] | None = None
    echo: bool | None = None
    best_of: N | None = None
    suffix: empty_only(str) | None = None
    response_format: ResponseFormat | None = None

    def check_supported(self) -> None:
        if self.best_of is not None and self.best_of != self.num_choices():
            raise InvalidRequestError("best_of", "is not supported by this server: only "
                                      "best_of == n is supported")

    def top_logprobs(self) -> int | None:
        """Alternatives per position when logprobs are wanted, None when not."""
        return None if self.logprobs is None or self.logprobs is False else self.logprobs


OnlyText = with_message(Annotated[list[Literal["text"]], MinLen(1), MaxLen(1)],
                        'is not supported by this server: only ["text"] is supported')


class ChatCompletionRequest(_OpenAISampling):
    messages: Messages
    max_tokens: NewTokens | None = None
    max_completion_tokens: NewTokens | None = None
    logprobs: bool | None = None
    top_logprobs: int_in(ge=0, le=MAX_TOP_LOGPROBS) | None = None
    tools: Tools | None = None
    tool_choice: ToolChoice | None = None
    parallel_tool_calls: bool | None = None
    functions: unsupported("use `tools`") = None
    function_call: unsupported("use `tool_choice`") = None
    response_format: ResponseFormat | None = None
    modalities: OnlyText | None = None
    audio: unsupported() = None
    prediction: Prediction | None = None
    reasoning_effort: unsupported() = None
    verbosity: unsupported() = None
    web_search_options: unsupported() = None
    metadata: dict[str, str] | None = None
    store: bool | None = None
    service_tier: str | None = None
    prompt_cache_key: str | None = None
    # SGLang's: no reasoning parser runs here, so there is no reasoning to separate or stream
    separate_reasoning: bool | None = None
    stream_reasoning: bool | None = None
    continue_final_message: served_only(False) = None
    safety_identifier: str | None = None

    def logprob_top(self) -> int | None:
        """Alternatives per token when `logprobs` is true (`top_logprobs`, default 0), else
        None; `top_logprobs` without `logprobs` is an error, as OpenAI has it."""
        if not self.logprobs:
            if self.top_logprobs:
                raise InvalidRequestError("top_logprobs", "needs 'logprobs': true")
            return None
        return self.top_logprobs or 0

    def max_tokens_field(self) -> str:
        return "max_completion_tokens" if self.max_completion_tokens is not None else "max_tokens"

    def tool_choice_json(self) -> str | dict | None:
        tc = self.tool_choice
        return tc if tc is None or isinstance(tc, str) else tc.model_dump()

    def tools_json(self) -> list[dict] | None:
        return None if self.tools is None else [t.model_dump() for t in self.tools]


def prompt_batch(prompt: Any, tokenize) -> list[list[int]]:
    """Token ids of a typed completion prompt: str, list[str], list[int] or list[list[int]]."""
    if isinstance(prompt, str):
        return [tokenize(prompt)]
    if all(isinstance(p, str) for p in prompt):
        return [tokenize(p) for p in prompt]
    if all(isinstance(p, int) for p in prompt):
        return [list(prompt)]
    return [list(p) for p in prompt]
