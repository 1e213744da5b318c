"""Log-probabilities of tokens under the target model, for clients that ask for them.

What a logprob is here: log_softmax of the target's raw logits at that position, before
temperature, penalties, top-k / top-p / min-p (vLLM's default `raw_logprobs`; SGLang's default
too). So a token's logprob does not depend on how it was chosen: greedy, sampled, or accepted
from a speculative draft. Under speculation the verify forward already holds the target's logits
at every accepted node, and the CPU engine computes a row bit for bit alike whatever else is in
the batch, so a request's logprobs are the same numbers with and without speculation
(tests/integration/test_logprobs.py).

Wire shape (msgpack, no pickle): one `LogprobRows` per request per step, as a plain dict
`{"lp": [...], "top_ids": [[...]], "top_lp": [[...]]}`; `top_*` only when top > 0. Prompt
logprobs travel the same way under "in_"-prefixed keys with "in_pos" (the prompt position of
their first entry).
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

import torch

from runtime.errors import InvalidRequestError

# OpenAI allows 20 alternatives per position (chat `top_logprobs`), 5 for completions.
MAX_TOP_LOGPROBS = 20


@dataclass(frozen=True)
class LogprobOptions:
    """What a request wants back besides its tokens.

    top: how many most likely alternatives to return at each position (0: only the chosen
    token's logprob). input_from: return the logprobs of the prompt's tokens from this
    position on (None: none; 0 and 1 are the same, the first token has no logprob)."""

    top: int = 0
    input_from: int | None = None

    def validate(self, prompt_len: int | None = None) -> LogprobOptions:
        if type(self.top) is not int or not 0 <= self.top <= MAX_TOP_LOGPROBS:
            raise InvalidRequestError("top_logprobs_num",
                                      f"must be an integer in [0, {MAX_TOP_LOGPROBS}]")
        if self.input_from is not None:
            if type(self.input_from) is not int or self.input_from < 0:
                raise InvalidRequestError("logprob_start_len", "must be -1 or a prompt position "
                                          ">= 0")
            if prompt_len is not None and self.input_from >= prompt_len:
                raise InvalidRequestError(
                    "logprob_start_len", f"is {self.input_from}; the prompt has {prompt_len} "
                    "tokens")
        return self

    def to_dict(self) -> dict:
        return {"top": self.top, "input_from": self.input_from}

    @classmethod
    def from_dict(cls, d: dict | None) -> LogprobOptions | None:
        return None if d is None else cls(int(d["top"]), d.get("input_from"))


def logprob_rows(logits: torch.Tensor, tokens: Sequence[int], top: int) -> dict:
    """logits [R, V] (raw), tokens [R]: each row's logprob of its token, and its `top` most
    likely tokens with theirs (ties: lower id first), as lists for the wire."""
    assert logits.shape[0] == len(tokens), f"{logits.shape[0]} rows for {len(tokens)} tokens"
    # one row at a time: a row's numbers must not depend on which rows share the call
    # (a verify pass and a decode step must agree bit for bit)
    lps, top_ids, top_lps = [], [], []
    for r, tok in enumerate(tokens):
        lp = torch.log_softmax(logits[r].float(), dim=-1)  # [V]
        lps.append(float(lp[tok]))
        if top:
            vals, idx = _top(lp, top)
            top_ids.append(idx)
            top_lps.append(vals)
    out = {"lp": lps}
    if top:
        out["top_ids"], out["top_lp"] = top_ids, top_lps
    return out


def _top(lp: torch.Tensor, k: int) -> tuple[list[float], list[int]]:
    """The k largest entries of lp [V], descending, ties by lower id."""
    vals, idx = lp.topk(min(k + 8, lp.numel()))  # a margin: stable order among ties below
    order = sorted(range(len(idx)), key=lambda i: (-float(vals[i]), int(idx[i])))[:k]
    return [float(vals[i]) for i in order], [int(idx[i]) for i in order]


def extend(into: dict, part: dict) -> dict:
    """Append payload `part` to `into` in place (and return it)."""
    for k, v in part.items():
        if k == "in_pos":
            into.setdefault(k, v)
        else:
            into.setdefault(k, []).extend(v)
    return into


def concat(parts: Sequence[dict]) -> dict:
    """One new payload of several, in order."""
    out: dict = {}
    for p in parts:
        extend(out, p)
    return out


def head(payload: dict, n: int) -> dict:
    """The output part of a payload cut to its first n tokens (a stop cut the step short);
    prompt entries are kept whole."""
    return {k: (v if k.startswith("in_") else v[:n]) for k, v in payload.items()}


__all__ = ["MAX_TOP_LOGPROBS", "LogprobOptions", "concat", "extend", "head", "logprob_rows"]
