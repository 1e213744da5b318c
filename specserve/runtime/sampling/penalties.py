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

from collections.abc import Sequence
from typing import TYPE_CHECKING, NamedTuple

import numpy as np
import torch

if TYPE_CHECKING:
    from specserve.runtime.sampling.sampler import SamplingBatchInfo


class RowHistory(NamedTuple):
    """Row r's history = request `request[r]`'s prompt + output, then the extra tokens."""

    request: torch.Tensor  # [R] int64 index into the per-request histories
    extra_rows: torch.Tensor  # [K] int64 row of each extra token
    extra_tokens: torch.Tensor  # [K] int64


def _flat_index(request_tokens: Sequence[np.ndarray], rows: RowHistory | None, vocab_size: int
                ) -> np.ndarray:
    """row * V + token for every token of every row's history (row r's request tokens, then its
    extra tokens), duplicates kept: [total] int64."""
    V = vocab_size
    if rows is None:
        parts = [r * V + t for r, t in enumerate(request_tokens)]
    else:
        req = rows.request.tolist()
        parts = [r * V + request_tokens[b] for r, b in enumerate(req)]
        if rows.extra_rows.numel() > 0:
            parts.append(rows.extra_rows.numpy() * V + rows.extra_tokens.numpy())
    return np.concatenate(parts) if parts else np.zeros(0, dtype=np.int64)


def _tokens(ids: Sequence[int], vocab_size: int) -> np.ndarray:
    t = np.fromiter(ids, dtype=np.int64, count=len(ids))
    if t.size:
        assert 0 <= t.min() and t.max() < vocab_size, "token id out of vocab"
    return t


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
    `info` has one entry per row and the histories one per request. Only the logits of tokens in
    a row's history change, so only those are computed (a history is hundreds of tokens, a row
    tens of thousands); each is the same elementwise float operation whatever the batch, so a
    row gets the same bits in any batch.
    """
    R, V = logits.shape
    B = len(prompt_ids)
    assert len(output_ids) == B, "one prompt and one output history per request"
    assert info.batch_size == R, f"logits have {R} rows, sampling info {info.batch_size}"
    if rows is None:
        assert B == R, "one history per row"
    dev = logits.device
    out = logits.float().clone()
    flat = out.view(-1)
    if info.need_repetition_penalty:
        seen = [_tokens(list(p) + list(o), V) for p, o in zip(prompt_ids, output_ids)]
        idx = np.unique(_flat_index(seen, rows, V))  # [seen (row, token) pairs]
        index = torch.from_numpy(idx).to(dev)
        vals = flat[index]
        rp = info.repetition_penalties[torch.from_numpy(idx // V).to(dev)]
        flat[index] = torch.where(vals > 0, vals / rp, vals * rp)
    if info.need_output_penalties:
        outs = [_tokens(o, V) for o in output_ids]
        idx, counts = np.unique(_flat_index(outs, rows, V), return_counts=True)
        index = torch.from_numpy(idx).to(dev)
        row = torch.from_numpy(idx // V).to(dev)
        c = torch.from_numpy(counts.astype(np.float32)).to(dev)
        vals = flat[index] - info.frequency_penalties[row] * c
        flat[index] = vals - info.presence_penalties[row] * (c > 0).float()
    return out
