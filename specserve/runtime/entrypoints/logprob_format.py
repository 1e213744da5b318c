"""Logprobs in the shapes clients parse: SGLang's /generate meta_info, OpenAI's completions
(`logprobs: {tokens, token_logprobs, top_logprobs, text_offset}`) and chat
(`logprobs: {content: [{token, logprob, bytes, top_logprobs}]}`).

Input: the cumulative payload a `GenerateChunk` carries (specserve/runtime/sampling/logprobs.py):
per output token "lp" (and "top_ids" / "top_lp" when alternatives were asked for); per prompt token
from position "in_pos" on, the same under "in_".
"""

from __future__ import annotations

from typing import Any

from specserve.runtime.sampling.logprobs import LogprobOptions


class TokenTexts:
    """Each token id's text on its own (`decode([id])`), remembered: a response names every
    token and its alternatives, and the same few thousand ids come back again and again."""

    LIMIT = 1 << 16

    def __init__(self, tokenizer) -> None:
        self.tokenizer = tokenizer
        self._texts: dict[int, str] = {}

    def __call__(self, token_id: int) -> str:
        text = self._texts.get(token_id)
        if text is None:
            text = self.tokenizer.decode([token_id])
            if len(self._texts) < self.LIMIT:
                self._texts[token_id] = text
        return text


def _entries(payload: dict, prefix: str, start: int, stop: int | None) -> list[tuple]:
    """(logprob, top pairs or None) for entries [start, stop) of one part."""
    lps = payload.get(prefix + "lp", [])
    ids = payload.get(prefix + "top_ids")
    tls = payload.get(prefix + "top_lp")
    out = []
    for i in range(start, len(lps) if stop is None else min(stop, len(lps))):
        top = None if ids is None else list(zip(tls[i], ids[i]))
        out.append((lps[i], top))
    return out


# ---- SGLang /generate ------------------------------------------------------------------------
class SglangLogprobs:
    """One request's meta_info logprob fields: `output_token_logprobs` [[logprob, id, text]],
    `input_token_logprobs` from `logprob_start_len` on (the first prompt token has logprob
    None), and with `top_logprobs_num` the `*_top_logprobs` lists of [logprob, id, text]. Text
    is None unless `return_text_in_logprobs`. Like SGLang's, a streamed chunk carries them
    all so far; each call formats only the entries that are new since the last (a stream's
    chunks would otherwise cost O(n) Python each)."""

    def __init__(self, prompt_ids: list[int], input_from: int | None, top: int,
                 text_of: TokenTexts | None) -> None:
        self.prompt_ids, self.input_from, self.top, self.text_of = (prompt_ids, input_from,
                                                                    top, text_of)
        self.out: list[list] = []
        self.out_top: list[list] = []
        self.inp: list[list] | None = None
        self.inp_top: list | None = None

    @property
    def options(self) -> LogprobOptions:
        return LogprobOptions(self.top, self.input_from)

    def _tok(self, lp: float | None, tid: int) -> list:
        return [lp, tid, None if self.text_of is None else self.text_of(tid)]

    def meta(self, payload: dict, output_ids: list[int]) -> dict[str, Any]:
        for (lp, top), tid in zip(_entries(payload, "", len(self.out), len(output_ids)),
                                  output_ids[len(self.out):]):
            self.out.append(self._tok(lp, tid))
            if self.top:
                self.out_top.append([self._tok(v, i) for v, i in top])
        # new lists each call (pointer copies): a caller may keep an earlier chunk's meta
        meta: dict[str, Any] = {"output_token_logprobs": list(self.out)}
        if self.top:
            meta["output_top_logprobs"] = list(self.out_top)
        if self.input_from is not None:
            # (a prompt with no token to score from the start on sends no prompt entries)
            if self.inp is None and ("in_lp" in payload or
                                     len(self.prompt_ids) <= max(self.input_from, 1)):
                self._prompt(payload)
            meta["input_token_logprobs"] = list(self.inp or [])
            if self.top:
                meta["input_top_logprobs"] = list(self.inp_top or [])
        return meta

    def _prompt(self, payload: dict) -> None:
        pos = payload.get("in_pos", 1)
        entries = _entries(payload, "in_", 0, None)
        first = self.input_from == 0
        self.inp = ([self._tok(None, self.prompt_ids[0])] if first else []) + [
            self._tok(lp, self.prompt_ids[pos + k]) for k, (lp, _) in enumerate(entries)]
        if self.top:
            self.inp_top = ([None] if first else []) + [
                [self._tok(v, i) for v, i in top] for _, top in entries]


# ---- OpenAI completions ----------------------------------------------------------------------
class CompletionLogprobs:
    """One choice's `logprobs` object, built in pieces (a stream sends each event's tokens);
    `text_offset` counts characters of the returned text, echoed prompt included."""

    def __init__(self, text_of: TokenTexts, top: int) -> None:
        self.text_of = text_of
        self.top = top
        self.offset = 0

    def _piece(self, tokens: list[int], entries: list[tuple]) -> dict[str, list]:
        out: dict[str, list] = {"tokens": [], "token_logprobs": [], "top_logprobs": [],
                                "text_offset": []}
        for tid, (lp, top) in zip(tokens, entries):
            text = self.text_of(tid)
            out["tokens"].append(text)
            out["token_logprobs"].append(lp)
            if lp is None:
                out["top_logprobs"].append(None)
            else:  # the top alternatives and always the chosen token (OpenAI's rule)
                alts = {self.text_of(i): v for v, i in (top or [])[: self.top]}
                alts.setdefault(text, lp)
                out["top_logprobs"].append(alts)
            out["text_offset"].append(self.offset)
            self.offset += len(text)
        return out

    def prompt(self, payload: dict, prompt_ids: list[int]) -> dict[str, list]:
        """The echoed prompt's tokens: the first without a logprob."""
        entries = [(None, None)] + _entries(payload, "in_", 0, None)
        return self._piece(prompt_ids, entries[: len(prompt_ids)])

    def output(self, payload: dict, output_ids: list[int], start: int) -> dict[str, list]:
        """Output tokens [start, len(output_ids))."""
        return self._piece(output_ids[start:], _entries(payload, "", start, len(output_ids)))


def merge_pieces(a: dict[str, list] | None, b: dict[str, list]) -> dict[str, list]:
    if a is None:
        return b
    return {k: a[k] + b[k] for k in a}


# ---- OpenAI chat -----------------------------------------------------------------------------
def chat_content(payload: dict, output_ids: list[int], start: int, top: int,
                 text_of: TokenTexts) -> list[dict]:
    """`logprobs.content` entries for output tokens [start, len(output_ids))."""
    def one(tid: int, lp: float) -> dict:
        text = text_of(tid)
        return {"token": text, "logprob": lp, "bytes": list(text.encode("utf-8"))}

    out = []
    for tid, (lp, alts) in zip(output_ids[start:],
                               _entries(payload, "", start, len(output_ids))):
        item = one(tid, lp)
        item["top_logprobs"] = [one(i, v) for v, i in (alts or [])[:top]]
        out.append(item)
    return out
