"""OpenAI-compatible endpoints: /v1/completions, /v1/chat/completions, /v1/models.

Response shapes follow OpenAI's. Each choice is one tm generation; `n` choices and batched
prompts run concurrently, choice `j` of a prompt with `seed + j` when a seed is given (choices
differ, yet a request is reproducible).
"""

from __future__ import annotations

import time
import uuid
from collections.abc import AsyncIterator, Iterator
from contextlib import contextmanager
from dataclasses import dataclass
from typing import Any

from starlette.requests import Request
from starlette.responses import JSONResponse, Response

from specserve.runtime.entrypoints.chat_messages import chat_messages
from specserve.runtime.entrypoints.logprob_format import (
    CompletionLogprobs,
    chat_content,
    merge_pieces,
)
from specserve.runtime.entrypoints.protocol import parse_model, read_json
from specserve.runtime.entrypoints.request_bodies import (
    ChatCompletionRequest,
    CompletionRequest,
    prompt_batch,
)
from specserve.runtime.entrypoints.streaming import (
    SSEResponse,
    first_chunks,
    gather_all,
    last_chunk,
    merge,
    sse_events,
    until_disconnect,
)
from specserve.runtime.entrypoints.tool_output import ToolDeltas, tool_message
from specserve.runtime.errors import InvalidRequestError, ModelLoadError, ModelNotFoundError
from specserve.runtime.messages import GrammarPayload
from specserve.runtime.sampling.logprobs import LogprobOptions
from specserve.runtime.sampling.sampling_params import SamplingParams
from specserve.runtime.tool_calls.request import ToolRequest, parse_tool_request, render_messages

FINISH_REASONS = {"stop": "stop", "length": "length", "abort": "abort"}


@dataclass
class _Choice:
    index: int
    prompt_index: int
    input_ids: list[int]
    params: SamplingParams
    rid: str
    logprobs: LogprobOptions | None = None
    grammar: GrammarPayload | None = None


@dataclass(frozen=True)
class _Shape:
    """What a response's choices carry besides text: `top` alternatives per token when
    logprobs were asked for (None: no logprobs), the prompt in front (completions' echo),
    tool calls read out of the text when the request offered tools, and the speculation
    trace (`spec_trace`: each choice's steps, new ones with each stream event)."""

    top: int | None = None
    echo: bool = False
    tools: ToolRequest | None = None
    spec_trace: bool = False
    disable_speculation: bool = False

    def spec_args(self) -> dict:
        return {"spec_trace": self.spec_trace, "disable_speculation": self.disable_speculation}


# the sampling parameters OpenAI's fields set, and the errors about them
_GRAMMAR_FIELDS = {"json_schema": "response_format", "structural_tag": "tools"}


@contextmanager
def _renamed(fields: dict[str, str]) -> Iterator[None]:
    """Report errors under the OpenAI name of a field (max_tokens, not max_new_tokens)."""
    try:
        yield
    except InvalidRequestError as exc:
        if exc.field not in fields:
            raise
        raise InvalidRequestError(fields[exc.field], exc.message) from None


def finish_reason(reason: dict | None) -> str | None:
    if reason is None:
        return None
    kind = reason.get("type")
    return FINISH_REASONS.get(kind, kind)


class OpenAIServing:
    def __init__(self, tm: Any, model_path: str) -> None:
        self.tm = tm
        self.model_path = model_path
        self.created = int(time.time())

    def models(self) -> dict:
        card = {"id": self.tm.model_name, "object": "model", "created": self.created,
                "owned_by": "specserve", "root": self.model_path,
                "max_model_len": self.tm.context_length}
        return {"object": "list", "data": [card]}

    async def completions(self, request: Request) -> Response:
        body = parse_model(CompletionRequest, await read_json(request))
        self.check_model(body.model)
        body.check_supported()
        priority = self.tm.check_priority(body.priority)
        prompts = prompt_batch(body.prompt, self.tm.tokenize)
        sampling = body.base_sampling()
        sampling["max_new_tokens"] = 16 if body.max_tokens is None else body.max_tokens
        if body.response_format is not None:
            sampling.update(body.response_format.grammar())
        shape = _Shape(body.top_logprobs(), bool(body.echo),
                       spec_trace=bool(body.return_spec_trace),
                       disable_speculation=bool(body.disable_speculation))
        job = self._choices("cmpl", prompts, sampling, body.num_choices(),
                            {"max_new_tokens": "max_tokens", "input_ids": "prompt",
                             **_GRAMMAR_FIELDS},
                            max_tokens_given=body.max_tokens is not None, shape=shape)
        await self._compile(job[1])
        return await self._serve(request, "text_completion", prompts, job, body.stream,
                                 body.include_usage(), shape, priority)

    async def chat(self, request: Request) -> Response:
        body = parse_model(ChatCompletionRequest, await read_json(request))
        self.check_model(body.model)
        top = body.logprob_top()
        priority = self.tm.check_priority(body.priority)
        tools = parse_tool_request(body.tools_json(), body.tool_choice_json(),
                                   body.parallel_tool_calls)
        ids = self._chat_ids(chat_messages(body.messages), tools)
        limit = body.max_completion_tokens if body.max_completion_tokens is not None \
            else body.max_tokens
        sampling = body.base_sampling()
        # OpenAI's default is "until the context is full"; the scheduler caps it there anyway.
        sampling["max_new_tokens"] = limit if limit is not None \
            else max(1, self.tm.context_length - len(ids))
        sampling.update(self._chat_grammar(body.response_format, tools))
        shape = _Shape(top, tools=tools if tools.offered else None,
                       spec_trace=bool(body.return_spec_trace),
                       disable_speculation=bool(body.disable_speculation))
        job = self._choices("chatcmpl", [ids], sampling, body.num_choices(),
                            {"max_new_tokens": body.max_tokens_field(), "prompt": "messages",
                             "input_ids": "messages", **_GRAMMAR_FIELDS},
                            max_tokens_given=limit is not None, shape=shape)
        await self._compile(job[1])
        return await self._serve(request, "chat.completion", [ids], job, body.stream,
                                 body.include_usage(), shape, priority)

    def _chat_ids(self, messages: list[dict], tools: ToolRequest) -> list[int]:
        """The prompt: the messages (and the tools the request offers) through the chat
        template, or the tool-call format's own rendering where the template ignores tools."""
        msgs, template_tools = render_messages(messages, tools, self.tm.tool_format,
                                               self.tm.template_renders_tools)
        try:
            return self.tm.chat_ids(msgs, add_generation_prompt=True, tools=template_tools)
        except ModelLoadError as exc:  # no chat template: the client should use /v1/completions
            raise InvalidRequestError("messages", str(exc)) from None

    def _chat_grammar(self, response_format: Any, tools: ToolRequest) -> dict[str, str]:
        """The grammar sampling parameter of a chat request: its response_format's, or the
        forced tool call's (tool_choice "required" or a named function)."""
        grammar = {} if response_format is None else response_format.grammar()
        if not tools.forced:
            return grammar
        if grammar:
            raise InvalidRequestError("tool_choice", "a forced tool call and a JSON "
                                      "response_format cannot both shape the output")
        return {"structural_tag": tools.forcing_grammar(self.tm.tool_format)}

    async def _compile(self, choices: list[_Choice]) -> None:
        """Compile the choices' grammar before any starts (all choices share one), errors
        under the OpenAI field that set it."""
        if not choices or choices[0].params.grammar is None:
            return
        with _renamed(_GRAMMAR_FIELDS):
            payloads = await self.tm.compile_grammars([c.params for c in choices])
        for c, payload in zip(choices, payloads):
            c.grammar = payload

    def check_model(self, model: str | None) -> None:
        """404 for a model this server does not serve (OpenAI and vLLM do the same), rather
        than answering from another model under the name the client asked for."""
        if model is not None and model not in (self.tm.model_name, self.model_path):
            raise ModelNotFoundError(model, self.tm.model_name)

    def _choices(self, prefix: str, prompts: list[list[int]], sampling: dict, n: int,
                 renames: dict[str, str],
                 max_tokens_given: bool = False,
                 shape: _Shape = _Shape()) -> tuple[str, list[_Choice]]:
        """Validate every choice before any starts, so a bad request never half-runs."""
        req_id = f"{prefix}-{uuid.uuid4().hex}"
        choices = []
        logprobs = None if shape.top is None else LogprobOptions(
            shape.top, 0 if shape.echo else None)  # echo scores the prompt's tokens too
        for p, ids in enumerate(prompts):
            with _renamed(renames):  # validated once per prompt, with the seed as given
                first = SamplingParams.from_dict(dict(sampling), self.tm.vocab_size)
                self.tm.check_prompt(ids, first, max_tokens_given)
            for j in range(n):
                params = first if j == 0 else first.for_sample(j)
                index = len(choices)
                choices.append(_Choice(index, p, ids, params, f"{req_id}-{index}", logprobs))
        return req_id, choices

    async def _serve(self, request: Request, kind: str, prompts: list[list[int]],
                     job: tuple[str, list[_Choice]], stream: bool | None,
                     include_usage: bool, shape: _Shape = _Shape(),
                     priority: int | None = None) -> Response:
        req_id, choices = job
        self.tm.admit(len(choices))
        created = int(time.time())
        head = {"id": req_id, "object": kind, "created": created, "model": self.tm.model_name}
        prompt_tokens = sum(len(ids) for ids in prompts)
        if stream:
            gens = await first_chunks(request, [
                self.tm.generate(c.input_ids, c.params, True, c.rid, c.logprobs, priority,
                                 c.grammar, **shape.spec_args())
                for c in choices])
            events = self._stream(head, merge(gens), choices, prompt_tokens, include_usage,
                                  shape)
            return SSEResponse(sse_events(events))
        finals = await until_disconnect(request, gather_all([
            last_chunk(self.tm.generate(c.input_ids, c.params, False, c.rid, c.logprobs,
                                        priority, c.grammar, **shape.spec_args()))
            for c in choices]))
        chat = kind == "chat.completion"
        out = []
        for c, chunk in zip(choices, finals):
            item: dict[str, Any] = {"index": c.index}
            view = _ChoiceView(self.tm, c, chat, shape)
            text, logprobs = view.piece(chunk)
            reason = finish_reason(chunk.finish_reason)
            if chat and shape.tools is not None:
                item["message"], called = tool_message(text, shape.tools, self.tm.tool_format)
                reason = "tool_calls" if called else reason  # (vLLM's rule)
            elif chat:
                item["message"] = {"role": "assistant", "content": text}
            else:
                item["text"] = text
            item.update(logprobs=logprobs, finish_reason=reason)
            if shape.spec_trace:
                item["spec_trace"] = view.new_steps(chunk)
            out.append(item)
        completion_tokens = sum(_completion_tokens(chunk) for chunk in finals)
        return JSONResponse({**head, "choices": out,
                             "usage": _usage(prompt_tokens, completion_tokens)})

    async def _stream(self, head: dict, chunks: AsyncIterator, choices: list[_Choice],
                      prompt_tokens: int, include_usage: bool,
                      shape: _Shape = _Shape()) -> AsyncIterator[dict]:
        """OpenAI stream events: per choice, deltas of its cumulative text (and the logprobs
        of the tokens that arrived since its last event)."""
        chat = head["object"] == "chat.completion"
        head = {**head, "object": "chat.completion.chunk" if chat else "text_completion"}
        extra = {"usage": None} if include_usage else {}
        views = [_ChoiceView(self.tm, c, chat, shape) for c in choices]
        completion_tokens = 0
        try:
            if chat:  # the first delta of each choice carries the role
                for i in range(len(choices)):
                    delta = {"role": "assistant", "content": ""}
                    yield {**head, "choices": [_delta(i, delta, None)], **extra}
            async for i, chunk in chunks:
                choice = views[i].event(i, chunk)
                if choice is None:
                    continue
                if chunk.finished:
                    completion_tokens += _completion_tokens(chunk)
                yield {**head, "choices": [choice], **extra}
            if include_usage:
                yield {**head, "choices": [], "usage": _usage(prompt_tokens, completion_tokens)}
        finally:
            await chunks.aclose()


class _ChoiceView:
    """What one choice has sent so far: `piece(chunk)` gives the text and logprobs that are
    new since the last piece (the whole of them for a final, non-streamed chunk)."""

    def __init__(self, tm: Any, choice: _Choice, chat: bool, shape: _Shape) -> None:
        self.tm, self.choice, self.chat, self.shape = tm, choice, chat, shape
        self.sent_text = ""
        self.sent_tokens = 0
        self.sent_steps = 0
        self.started = False
        self.completion = None if shape.top is None or chat else CompletionLogprobs(
            tm.token_texts, shape.top)
        self.tools = ToolDeltas(shape.tools, tm.tool_format) \
            if chat and shape.tools is not None else None

    def event(self, index: int, chunk: Any) -> dict | None:
        """The stream event's choice for a new chunk (None: nothing to send yet). With tools
        offered, text inside call blocks goes out as `tool_calls` deltas, once a call is
        whole, and a choice that called a tool finishes with "tool_calls"."""
        new, logprobs = self.piece(chunk)
        steps = self.new_steps(chunk) if self.shape.spec_trace else None
        reason = finish_reason(chunk.finish_reason) if chunk.finished else None
        if not self.chat:
            if not new and not chunk.finished and not _names_tokens(logprobs) and not steps:
                return None
            out = {"index": index, "text": new, "logprobs": logprobs, "finish_reason": reason}
        else:
            fields = {"content": new} if new else {}
            if self.tools is not None:
                fields = self.tools.delta(chunk.text, chunk.finished)
                if chunk.finished and self.tools.called:
                    reason = "tool_calls"
            if not fields and not chunk.finished and not _names_tokens(logprobs) and not steps:
                return None
            out = _delta(index, fields, reason, logprobs)
        if steps is not None:
            out["spec_trace"] = steps
        return out

    def new_steps(self, chunk: Any) -> list[dict]:
        """The trace's steps since the last event (all of them in a non-streamed response)."""
        trace = chunk.meta_info.get("spec_trace", [])
        new, self.sent_steps = trace[self.sent_steps:], len(trace)
        return new

    def piece(self, chunk: Any) -> tuple[str, dict | None]:
        text = chunk.text
        # cumulative texts only grow (the tm holds back partial characters/stops)
        new = ""
        if text.startswith(self.sent_text):
            new, self.sent_text = text[len(self.sent_text):], text
        lp = None
        echo = self.shape.echo and not self.started
        if echo:
            new = self.tm.tokenizer.decode(self.choice.input_ids) + new
        self.started = True
        if self.shape.top is not None and chunk.logprobs is not None:
            ids, start = chunk.output_ids, self.sent_tokens
            if self.chat:
                lp = {"content": chat_content(chunk.logprobs, ids, start, self.shape.top,
                                              self.tm.token_texts), "refusal": None}
            else:
                lp = self.completion.prompt(chunk.logprobs, self.choice.input_ids) \
                    if echo else None
                lp = merge_pieces(lp, self.completion.output(chunk.logprobs, ids, start))
            self.sent_tokens = len(ids)
        return new, lp


def _names_tokens(logprobs: dict | None) -> bool:
    """Whether a piece's logprobs cover any token (so its event must go out, text or not)."""
    return bool(logprobs and (logprobs.get("content") or logprobs.get("tokens")))


def _delta(index: int, delta: dict, reason: str | None, logprobs: dict | None = None) -> dict:
    return {"index": index, "delta": delta, "logprobs": logprobs, "finish_reason": reason}


def _completion_tokens(chunk: Any) -> int:
    return int(chunk.meta_info.get("completion_tokens", len(chunk.output_ids)))


def _usage(prompt_tokens: int, completion_tokens: int) -> dict:
    return {"prompt_tokens": prompt_tokens, "completion_tokens": completion_tokens,
            "total_tokens": prompt_tokens + completion_tokens}
