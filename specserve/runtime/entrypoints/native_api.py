"""SGLang's native /generate: text or token ids in, cumulative text + ids + meta_info out."""

from __future__ import annotations

from collections.abc import AsyncIterator
from typing import Any

from starlette.requests import Request
from starlette.responses import JSONResponse, Response

from specserve.runtime.entrypoints.logprob_format import SglangLogprobs, TokenTexts
from specserve.runtime.entrypoints.protocol import parse_model, read_json
from specserve.runtime.entrypoints.request_bodies import MAX_N, GenerateRequest, SamplingBody
from specserve.runtime.entrypoints.streaming import (
    SSEResponse,
    StreamCursor,
    first_chunks,
    gather_all,
    last_chunk,
    merge,
    sse_events,
    until_disconnect,
)
from specserve.runtime.errors import InvalidRequestError
from specserve.runtime.messages import GrammarPayload
from specserve.runtime.sampling.logprobs import LogprobOptions
from specserve.runtime.sampling.sampling_params import SamplingParams, integral


class _Item:
    __slots__ = ("cursor", "formatter", "grammar", "input_ids", "logprobs", "params", "rid",
                 "spec")

    def __init__(self, input_ids: list[int], params: SamplingParams, rid: str | None,
                 logprobs: LogprobOptions | None = None) -> None:
        self.input_ids, self.params, self.rid = input_ids, params, rid
        self.logprobs = logprobs
        self.formatter: SglangLogprobs | None = None  # the response's, once it has one
        self.cursor = StreamCursor()  # (--incremental-streaming-output)
        self.grammar: GrammarPayload | None = None  # its compiled grammar, if it has one
        self.spec: dict = {}  # tm.generate's speculation arguments (trace, opt-out)


def chunk_json(chunk: Any, index: int | None, item: _Item | None = None,
               text_of: TokenTexts | None = None, incremental: bool = False) -> dict:
    """One /generate response or streamed chunk; `incremental` (streams under
    --incremental-streaming-output): only what is new since the item's previous chunk."""
    meta = {"finish_reason": None, **chunk.meta_info}
    if item is not None and item.logprobs is not None and chunk.logprobs is not None:
        if item.formatter is None:
            item.formatter = SglangLogprobs(item.input_ids, item.logprobs.input_from,
                                            item.logprobs.top, text_of)
        meta.update(item.formatter.meta(chunk.logprobs, chunk.output_ids))
    out = {"text": chunk.text, "output_ids": chunk.output_ids, "meta_info": meta}
    if incremental and item is not None:
        out = item.cursor.cut(out)
    if index is not None:  # batched streams interleave; SGLang tags each chunk
        out["index"] = index
    return out


def parse_generate(body: GenerateRequest, tm: Any) -> tuple[bool, list[_Item]]:
    """(is_batch, items) with every prompt and sampling dict validated."""
    if (body.text is None) == (body.input_ids is None):
        raise InvalidRequestError("text", "give exactly one of 'text' and 'input_ids'")
    if body.text is not None:
        field, batch = "text", isinstance(body.text, list)
        prompts = [tm.tokenize(t) for t in body.text] if batch else [tm.tokenize(body.text)]
    else:
        field, batch = "input_ids", isinstance(body.input_ids[0], list)
        prompts = [list(p) for p in body.input_ids] if batch else [list(body.input_ids)]
    params = _per_item(body.sampling_params, "sampling_params", batch, len(prompts),
                       SamplingBody())
    rids = _per_item(body.rid, "rid", batch, len(prompts), None)
    n, params = parallel_samples(params)
    items = []
    for k, (ids, sp, rid) in enumerate(zip(prompts, params, rids)):
        where = f"item {k}: " if batch else ""
        try:
            p = SamplingParams.from_dict(sp, tm.vocab_size)
        except InvalidRequestError as exc:
            raise InvalidRequestError(f"sampling_params.{exc.field}", where + exc.message) \
                from None
        try:
            tm.check_prompt(ids, p, max_new_tokens_given="max_new_tokens" in sp)
        except InvalidRequestError as exc:
            name = field if exc.field in ("prompt", "input_ids") else \
                f"sampling_params.{exc.field}" if exc.field == "max_new_tokens" else exc.field
            raise InvalidRequestError(name, where + exc.message) from None
        logprobs = _logprob_options(body, len(ids), where)
        for j in range(n):
            if n == 1:
                items.append(_Item(ids, p, rid, logprobs))
            else:
                items.append(_Item(ids, p.for_sample(j),
                                   None if rid is None else f"{rid}-{j}", logprobs))
    spec = {"spec_trace": body.return_spec_trace,
            "disable_speculation": body.disable_speculation}
    for it in items:
        it.spec = spec
    return batch or n > 1, items


def parallel_samples(params: list[SamplingBody | dict]) -> tuple[int, list[dict]]:
    """SGLang's parallel sampling: `sampling_params.n` samples of every prompt, the same `n`
    for every prompt of a batch; the response is then a list, prompt by prompt, its n samples
    in a row (SGLang's order). Takes typed bodies (HTTP) or plain dicts (Engine users, checked
    here as the type would); returns n and the sampling dicts (the fields given, without "n")."""
    fields = [sp.given() if isinstance(sp, SamplingBody) else dict(sp) for sp in params]
    ns = [1 if f.get("n") is None else integral(f["n"]) for f in fields]
    for n in ns:
        if type(n) is not int or not 1 <= n <= MAX_N:
            raise InvalidRequestError("sampling_params.n", f"must be an integer in [1, {MAX_N}]")
    if len(set(ns)) > 1:
        raise InvalidRequestError("sampling_params.n", "must be the same for every prompt")
    return ns[0], [{k: v for k, v in f.items() if k != "n"} for f in fields]


def _logprob_options(body: GenerateRequest, prompt_len: int,
                     where: str) -> LogprobOptions | None:
    """SGLang's logprob fields (`LogprobOptions.from_sglang`), errors naming the item."""
    if not body.return_logprob:
        return None
    try:
        return LogprobOptions.from_sglang(body.top_logprobs_num, body.logprob_start_len,
                                          prompt_len)
    except InvalidRequestError as exc:
        raise InvalidRequestError(exc.field, where + exc.message) from None


def _per_item(value: Any, field: str, batch: bool, count: int, default: Any) -> list[Any]:
    """One value for every item: given once (shared) or, for a batch, as a list of `count`."""
    if value is None:
        return [default] * count
    if not isinstance(value, list):
        if isinstance(value, str) and batch and count > 1:  # request ids are unique
            raise InvalidRequestError(field, f"a batch needs a list of {count} request ids")
        return [value] * count
    if not batch:
        raise InvalidRequestError(field, "a list is for a batch of prompts; this request has "
                                  "one")
    if len(value) != count:
        raise InvalidRequestError(field, f"has {len(value)} entries for {count} prompts")
    return list(value)


async def compile_grammars(tm: Any, items: list[_Item], batch: bool) -> None:
    """Compile the items' grammars before any starts; an error names the item's field."""
    for k, it in enumerate(items):
        try:
            it.grammar = await tm.compile_grammar(it.params)
        except InvalidRequestError as exc:
            where = f"item {k}: " if batch else ""
            raise InvalidRequestError(f"sampling_params.{exc.field}", where + exc.message) \
                from None


async def generate(request: Request, tm: Any, incremental: bool = False) -> Response:
    body = parse_model(GenerateRequest, await read_json(request))
    priority = tm.check_priority(body.priority)
    batch, items = parse_generate(body, tm)
    tm.admit(len(items))
    await compile_grammars(tm, items, batch)
    text_of = tm.token_texts if body.return_text_in_logprobs else None
    if body.stream:
        gens = await first_chunks(request, [
            tm.generate(it.input_ids, it.params, True, it.rid, it.logprobs, priority, it.grammar,
                        **it.spec)
            for it in items])
        return SSEResponse(sse_events(_events(merge(gens), batch, items, text_of,
                                              incremental)))
    finals = await until_disconnect(request, gather_all([
        last_chunk(tm.generate(it.input_ids, it.params, False, it.rid, it.logprobs, priority,
                               it.grammar, **it.spec))
        for it in items]))
    out = [chunk_json(chunk, None, it, text_of) for chunk, it in zip(finals, items)]
    return JSONResponse(out if batch else out[0])


async def _events(chunks: AsyncIterator, batch: bool, items: list[_Item],
                  text_of: TokenTexts | None, incremental: bool = False) -> AsyncIterator[dict]:
    try:
        async for i, chunk in chunks:
            yield chunk_json(chunk, i if batch else None, items[i], text_of, incremental)
    finally:
        await chunks.aclose()
