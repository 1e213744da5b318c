"""History-dependent logits processing: repetition, frequency and presence penalties.

A row's penalties depend on the tokens before the one it predicts. In plain decoding that is
the request's prompt + output. At a node of a speculative draft tree it is the prompt + output
plus the draft tokens on the path from the root to that node (the root itself is the last
output token, already in the output). `RowHistory` describes rows of the second kind: the
request history each row extends, and the extra (row, token) pairs of the paths. The counts are
built once per request and step, then every row adds its path's few tokens: no per-node copy of
the history. Any future history-dependent processor belongs here, behind the same description.
"""

from __future__ import annotations

import itertools
from collections.abc import Sequence
from typing import TYPE_CHECKING, NamedTuple

import torch

if TYPE_CHECKING:
    from runtime.sampling.sampler import SamplingBatchInfo


class RowHistory(NamedTuple):
    """Row r's history = request `request[r]`'s prompt + output, then the extra tokens."""

    request: torch.Tensor  # [R] int64 index into the per-request histories
    extra_rows: torch.Tensor  # [K] int64 row of each extra token
    extra_tokens: torch.Tensor  # [K] int64


def _token_index(ids: Sequence[Sequence[int]], vocab_size: int, device: torch.device
                 ) -> torch.Tensor:
    """Flat indices row * V + token into a [B * V] view, built on the host then moved once."""
    lengths = torch.tensor([len(row) for row in ids], dtype=torch.int64)
    tokens = torch.tensor(list(itertools.chain.from_iterable(ids)), dtype=torch.int64)
    if tokens.numel() > 0:
        assert 0 <= int(tokens.min()) and int(tokens.max()) < vocab_size, "token id out of vocab"
    rows = torch.repeat_interleave(torch.arange(len(ids), dtype=torch.int64), lengths)
    return (rows * vocab_size + tokens).to(device)  # [total_tokens]


def apply_penalties(
    logits: torch.Tensor,
    info: SamplingBatchInfo,
    prompt_ids: Sequence[Sequence[int]],
    output_ids: Sequence[Sequence[int]],
    rows: RowHistory | None = None,
) -> torch.Tensor:
    """Return penalised logits [R, V] float32 (the input is not modified).

    Repetition penalty (HF): every token seen in prompt or output has a positive logit divided by
    the penalty and a negative one multiplied. Frequency / presence (OpenAI), output tokens only:
    subtract `frequency_penalty * count` and `presence_penalty * (count > 0)`.

    Without `rows`, row i's history is prompt_ids[i] + output_ids[i]. With `rows` (tree nodes),
    `info` has one entry per row and the histories one per request. Every operation is
    elementwise per row, so a row gets the same bits whatever else is in the batch.
    """
    R, V = logits.shape
    B = len(prompt_ids)
    assert len(output_ids) == B, "one prompt and one output history per request"
    assert info.batch_size == R, f"logits have {R} rows, sampling info {info.batch_size}"
    if rows is None:
        assert B == R, "one history per row"
    dev = logits.device
    extra = None
    if rows is not None and rows.extra_rows.numel() > 0:
        extra = rows.extra_rows.to(dev) * V + rows.extra_tokens.to(dev)  # [K] flat indices

    def per_row(base: torch.Tensor) -> torch.Tensor:  # [B, V] → [R, V]
        return base if rows is None else base[rows.request.to(dev)]

    out = logits.float()
    if info.need_repetition_penalty:
        seen = torch.zeros(B * V, dtype=torch.bool, device=dev)  # [B * V]
        both = [list(p) + list(o) for p, o in zip(prompt_ids, output_ids)]
        seen[_token_index(both, V, dev)] = True
        seen = per_row(seen.view(B, V))
        if extra is not None:
            seen = seen.clone().view(-1)
            seen[extra] = True
            seen = seen.view(R, V)
        rp = info.repetition_penalties[:, None]  # [R, 1]
        penalised = torch.where(out > 0, out / rp, out * rp)
        out = torch.where(seen, penalised, out)
    if info.need_output_penalties:
        index = _token_index(output_ids, V, dev)
        counts = torch.zeros(B * V, dtype=torch.float32, device=dev)  # [B * V]
        counts.scatter_add_(0, index, torch.ones_like(index, dtype=torch.float32))
        counts = per_row(counts.view(B, V))
        if extra is not None:
            counts = counts.clone().view(-1)
            counts.scatter_add_(0, extra, torch.ones_like(extra, dtype=torch.float32))
            counts = counts.view(R, V)
        out = out - info.frequency_penalties[:, None] * counts
        out = out - info.presence_penalties[:, None] * (counts > 0).float()
    return out
