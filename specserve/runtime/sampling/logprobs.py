"""Log-probabilities of tokens under the target model, for clients that ask for them.

What a logprob is here: log_softmax of the target's raw logits at that position, before
temperature, penalties, top-k / top-p / min-p (vLLM's default `raw_logprobs`; SGLang's default
too). So a token's logprob does not depend on how it was chosen: greedy, sampled, or accepted
from a speculative draft. Under speculation the verify forward already holds the target's logits
at every accepted node, and the CPU engine computes a row bit for bit alike whatever else is in
the batch, so a request's logprobs are the same numbers with and without speculation
(tests/integration/test_spec_lossless*.py, which ask for them on every third prompt).

Wire shape (msgpack, no pickle): one payload per request per step, a plain dict
`{"lp": [...], "top_ids": [[...]], "top_lp": [[...]]}`; `top_*` only when top > 0. Prompt
logprobs travel the same way under "in_"-prefixed keys with "in_pos" (the prompt position of
their first entry).
"""

from __future__ import annotations

from collections.abc import Iterable, Sequence
from dataclasses import dataclass
from typing import NamedTuple

import torch

from specserve.runtime.errors import InvalidRequestError

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

    @classmethod
    def from_sglang(cls, top_logprobs_num: int | None, logprob_start_len: int | None,
                    prompt_len: int) -> LogprobOptions:
        """SGLang's fields, validated: `logprob_start_len` None or -1 (its default) means
        output tokens only, a prompt position the prompt's tokens from there on."""
        start = logprob_start_len
        if type(start) is int and start < -1:
            raise InvalidRequestError("logprob_start_len", "must be -1 or a prompt position "
                                      ">= 0")
        return cls(0 if top_logprobs_num is None else top_logprobs_num,
                   None if start in (None, -1) else start).validate(prompt_len)

    def to_dict(self) -> dict:
        return {"top": self.top, "input_from": self.input_from}

    @classmethod
    def from_dict(cls, d: dict | None) -> LogprobOptions | None:
        return None if d is None else cls(int(d["top"]), d.get("input_from"))


class LogitStats(NamedTuple):
    """What the CPU engine finds in each logits row while it is in its cache, for logprobs
    (ForwardBatch.logit_top): the row's log-sum-exp, and its `k` largest logits with their ids
    in (value descending, id ascending) order. lse is NaN for a row holding a NaN or an
    infinite maximum (such rows take the torch way)."""

    lse: torch.Tensor  # [R] float32
    top_vals: torch.Tensor  # [R, k] float32 (raw logits)
    top_ids: torch.Tensor  # [R, k] int64

    @property
    def k(self) -> int:
        return int(self.top_vals.shape[1])


def logit_top(options: Iterable[LogprobOptions | None]) -> int:
    """ForwardBatch.logit_top for a step over requests with these options: the most
    alternatives any of them wants logprobs with, -1 when none wants logprobs."""
    return max((o.top for o in options if o is not None), default=-1)


def logprob_rows(logits: torch.Tensor, tokens: Sequence[int], top: int,
                 rows: Sequence[int] | None = None, stats: LogitStats | None = None) -> dict:
    """logits[rows] (raw, [R, V]; all rows when `rows` is None), tokens [R]: each row's
    logprob of its token, and its `top` most likely tokens with theirs (descending; ties:
    lower id first), as lists for the wire.

    With the engine's `stats` for these logits (k >= top): logprob = logit - lse, read off
    without touching the rows again (~0.02 ms a row, in the forward, against ~0.24 ms a row
    read cold after it: docs/benchmarks.md, "Logprobs, the speculation trace and streaming").
    Else log_softmax and topk over the rows. Either way a row's numbers do not depend on the
    other rows of the call (tests/unit/test_logprobs.py), so a verify pass and a decode step
    agree bit for bit; the two ways differ in the last bits, and an engine takes one of them
    for every row it can (a row whose lse is NaN, holding a NaN or an infinite logit, takes
    the torch way alone)."""
    if stats is not None and stats.k >= top:
        rows = list(range(logits.shape[0])) if rows is None else list(rows)
        assert len(rows) == len(tokens), f"{len(rows)} rows for {len(tokens)} tokens"
        idx = torch.tensor(rows, dtype=torch.int64)
        lse = stats.lse[idx]
        chosen = logits[idx, torch.tensor(list(tokens), dtype=torch.int64)] - lse
        out: dict = {"lp": chosen.tolist()}
        if top:
            out["top_ids"] = stats.top_ids[idx, :top].tolist()
            out["top_lp"] = (stats.top_vals[idx, :top] - lse[:, None]).tolist()
        bad = (~torch.isfinite(lse)).nonzero().flatten().tolist()
        if bad:
            redo = logprob_rows(logits, [tokens[i] for i in bad], top, [rows[i] for i in bad])
            for j, i in enumerate(bad):
                for key, v in redo.items():
                    out[key][i] = v[j]
        return out
    if rows is not None:
        logits = select_rows(logits, rows)
    R = logits.shape[0]
    assert R == len(tokens), f"{R} rows for {len(tokens)} tokens"
    if R == 0:
        return {"lp": [], "top_ids": [], "top_lp": []} if top else {"lp": []}
    lp = torch.log_softmax(logits.float(), dim=-1)  # [R, V]
    chosen = lp.gather(1, torch.tensor(tokens, dtype=torch.int64)[:, None])
    out: dict = {"lp": chosen.flatten().tolist()}
    if top:
        k = min(top + 1, lp.shape[1])  # one more: a tie across the cut shows
        vals, idx = lp.topk(k, dim=-1)  # [R, k] descending
        top_lp, top_ids = vals.tolist(), idx.tolist()
        for r in range(R):
            v = top_lp[r]
            if any(v[j] == v[j + 1] for j in range(k - 1)):  # ties: order them by id
                top_lp[r], top_ids[r] = _top(lp[r], top)
            else:
                top_lp[r], top_ids[r] = v[:top], top_ids[r][:top]
        out["top_ids"], out["top_lp"] = top_ids, top_lp
    return out


def _top(lp: torch.Tensor, k: int) -> tuple[list[float], list[int]]:
    """The k largest entries of lp [V], descending, ties by lower id."""
    vals, idx = lp.topk(min(k + 8, lp.numel()))  # a margin for the ties across the cut
    pairs = sorted(zip(vals.tolist(), idx.tolist()), key=lambda p: (-p[0], p[1]))[:k]
    return [v for v, _ in pairs], [i for _, i in pairs]


def select_rows(logits: torch.Tensor, rows: Sequence[int]) -> torch.Tensor:
    """logits[rows] [len(rows), V], without the copy when rows are all of them in order (a
    decode step's: 6 MB for 32 rows of a 49k vocabulary, ~2.5 ms after a forward)."""
    if len(rows) == logits.shape[0] and all(r == i for i, r in enumerate(rows)):
        return logits
    return logits[torch.tensor(rows, dtype=torch.int64)]


def split_rows(payload: dict, counts: Sequence[int], tops: Sequence[int]) -> list[dict]:
    """One `logprob_rows` payload over several requests' rows (consecutive, `counts[i]` of
    request i) as one payload per request, each with its own `tops[i]` alternatives."""
    out, off = [], 0
    for n, top in zip(counts, tops):
        part = {"lp": payload["lp"][off : off + n]}
        if top:
            part["top_ids"] = [t[:top] for t in payload["top_ids"][off : off + n]]
            part["top_lp"] = [t[:top] for t in payload["top_lp"][off : off + n]]
        out.append(part)
        off += n
    return out


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


__all__ = ["MAX_TOP_LOGPROBS", "LogitStats", "LogprobOptions", "concat", "extend", "head",
           "logit_top", "logprob_rows", "select_rows", "split_rows"]
