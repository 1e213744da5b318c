"""Batched logits processing and token sampling, one set of sampling params per row.

Pipeline for one decode step: `apply_penalties` (needs token history; specserve/runtime/sampling/
penalties.py) -> greedy rows take the argmax -> `process_logits` (temperature, top-k, top-p,
min-p, renormalise) -> `sample_from_probs`. Speculative verification runs the same pipeline on
an `expand`-ed info, one row per draft-tree node (penalties with each node's path).

Randomness: a row whose request has a seed draws by Gumbel-max with noise computed from (seed,
absolute position of the token) (specserve/runtime/sampling/seeded.py): its token depends on nothing
else — not the other rows, not the step that produced it, not speculation. Every other row
draws an inverse-CDF uniform from `info.generator` (or torch's global RNG when that is None),
one per row of the batch, in one vectorised call.

Rows are processed independently and bit-for-bit alike whatever else is in the batch (no
reduction whose order depends on the batch shape: the renormalising sum is a float64 cumsum,
sequential per row), which seeded sampling needs: a verify pass and a decode step must agree.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass, replace

import torch

from specserve.runtime.sampling.argmax import argmax_rows
from specserve.runtime.sampling.penalties import RowHistory, apply_penalties
from specserve.runtime.sampling.sampling_params import SamplingParams
from specserve.runtime.sampling.seeded import seed_to_int64, seeded_sample

# Top-p keeps the smallest prefix (by descending probability) whose mass reaches top_p; the slack
# absorbs float32 rounding of the softmax so mass 0.8 "reaches" top_p 0.8.
TOP_P_EPS = 1e-6
# Top-k / top-p look at each row's K most likely tokens first, K growing through these sizes
# until the kept set is settled inside them, and sort the whole vocabulary only when it is not
# (a flat distribution). A stable sort of 49k probabilities costs ~3 ms per row on one CPU
# thread, more than a decode step of the default model; topk(128) ~0.15 ms.
TOP_CANDIDATES = (128, 1024)


@dataclass(slots=True)
class SamplingBatchInfo:
    """Sampling params of a batch as per-row tensors, plus host flags that skip unused stages."""

    temperatures: torch.Tensor  # [B] float32, raw; greedy rows are handled without dividing
    top_ps: torch.Tensor  # [B] float32
    top_ks: torch.Tensor  # [B] int64, disabled -> vocab_size
    min_ps: torch.Tensor  # [B] float32
    repetition_penalties: torch.Tensor  # [B] float32
    frequency_penalties: torch.Tensor  # [B] float32
    presence_penalties: torch.Tensor  # [B] float32
    is_greedy: torch.Tensor  # [B] bool
    seeded: torch.Tensor  # [B] bool: the request has a seed (Gumbel-max draws)
    seeds: torch.Tensor  # [B] int64, the seed's 64 bits (`seed_to_int64`), 0 when unseeded
    generator: torch.Generator | None  # for unseeded rows; None -> torch's global RNG
    vocab_size: int
    all_greedy: bool
    any_seeded: bool  # some sampled (non-greedy) row has a seed
    need_top_k: bool
    need_top_p: bool
    need_min_p: bool
    need_repetition_penalty: bool
    need_output_penalties: bool  # frequency or presence
    any_greedy: bool = True  # some row is greedy (False skips the one-hot override)

    @property
    def batch_size(self) -> int:
        return self.temperatures.shape[0]

    @property
    def device(self) -> torch.device:
        return self.temperatures.device

    @property
    def need_penalties(self) -> bool:
        return self.need_repetition_penalty or self.need_output_penalties

    @classmethod
    def from_params(
        cls,
        params: Sequence[SamplingParams],
        vocab_size: int,
        device: torch.device | str = "cpu",
        generator: torch.Generator | None = None,
    ) -> SamplingBatchInfo:
        """Build the batch info; `generator` serves the unseeded rows (None: torch's global
        RNG). Seeded rows need no state: their noise is a function of (seed, position)."""
        greedy = [p.is_greedy for p in params]
        sampled = [p for p, g in zip(params, greedy) if not g]
        top_ks = [vocab_size if p.top_k == -1 else min(p.top_k, vocab_size) for p in params]

        def col(values: list, dtype: torch.dtype) -> torch.Tensor:
            return torch.tensor(values, dtype=dtype, device=device)

        return cls(
            temperatures=col([p.temperature for p in params], torch.float32),
            top_ps=col([p.top_p for p in params], torch.float32),
            top_ks=col(top_ks, torch.int64),
            min_ps=col([p.min_p for p in params], torch.float32),
            repetition_penalties=col([p.repetition_penalty for p in params], torch.float32),
            frequency_penalties=col([p.frequency_penalty for p in params], torch.float32),
            presence_penalties=col([p.presence_penalty for p in params], torch.float32),
            is_greedy=col(greedy, torch.bool),
            seeded=col([p.seed is not None for p in params], torch.bool),
            seeds=col([seed_to_int64(p.seed or 0) for p in params], torch.int64),
            generator=generator,
            vocab_size=vocab_size,
            all_greedy=all(greedy),
            any_seeded=any(p.seed is not None for p in sampled),
            need_top_k=any(1 <= p.top_k < vocab_size for p in sampled),
            need_top_p=any(p.top_p < 1.0 for p in sampled),
            need_min_p=any(p.min_p > 0.0 for p in sampled),
            need_repetition_penalty=any(p.repetition_penalty != 1.0 for p in params),
            need_output_penalties=any(
                p.frequency_penalty != 0.0 or p.presence_penalty != 0.0 for p in params
            ),
            any_greedy=any(greedy),
        )


def expand(info: SamplingBatchInfo, repeats: Sequence[int] | torch.Tensor) -> SamplingBatchInfo:
    """Repeat row i's params `repeats[i]` times (e.g. once per draft-tree node of request i)."""
    counts = torch.as_tensor(repeats, dtype=torch.int64)
    assert counts.numel() == info.batch_size, "one repeat count per row"
    index = counts.to(info.device)

    def rep(t: torch.Tensor) -> torch.Tensor:
        return torch.repeat_interleave(t, index, dim=0)

    return replace(
        info,
        temperatures=rep(info.temperatures),
        top_ps=rep(info.top_ps),
        top_ks=rep(info.top_ks),
        min_ps=rep(info.min_ps),
        repetition_penalties=rep(info.repetition_penalties),
        frequency_penalties=rep(info.frequency_penalties),
        presence_penalties=rep(info.presence_penalties),
        is_greedy=rep(info.is_greedy),
        seeded=rep(info.seeded),
        seeds=rep(info.seeds),
    )


def _one_hot_argmax(logits: torch.Tensor) -> torch.Tensor:
    probs = torch.zeros(logits.shape, dtype=torch.float32, device=logits.device)  # [B, V]
    return probs.scatter_(1, argmax_rows(logits).unsqueeze(-1).to(logits.device), 1.0)


def process_logits(logits: torch.Tensor, info: SamplingBatchInfo) -> torch.Tensor:
    """Logits [B, V] -> probs [B, V] float32 after temperature, top-k, top-p, min-p, renormalised.

    Greedy rows become one-hot on their argmax. Top-p keeps the smallest set of most likely
    tokens (after top-k) whose mass is >= top_p (up to TOP_P_EPS); min-p drops tokens whose
    probability is below min_p times the largest one. Rows are independent of each other.
    """
    B, V = logits.shape
    assert B == info.batch_size, f"logits have {B} rows, sampling info {info.batch_size}"
    if info.all_greedy:
        return _one_hot_argmax(logits)
    logits = logits.float()
    # Greedy rows divide by 1 here and are overwritten at the end.
    temps = torch.where(info.is_greedy, torch.ones_like(info.temperatures), info.temperatures)
    probs = torch.softmax(logits / temps[:, None], dim=-1)  # [B, V]

    if info.need_top_k or info.need_top_p:
        probs = _top_k_top_p(probs, info)

    if info.need_min_p:
        threshold = info.min_ps[:, None] * probs.amax(dim=-1, keepdim=True)  # [B, 1]
        probs = probs.masked_fill(probs < threshold, 0.0)

    # the row sum as the last entry of a float64 cumsum: sequential per row, so the same bits at
    # any batch size (`probs.sum` splits one long row across threads, several rows not)
    total = probs.cumsum(dim=-1, dtype=torch.float64)[:, -1:]  # [B, 1]
    probs = probs / total.float()
    if not info.any_greedy:
        return probs
    return torch.where(info.is_greedy[:, None], _one_hot_argmax(logits), probs)


def _top_k_top_p(probs: torch.Tensor, info: SamplingBatchInfo) -> torch.Tensor:
    """probs [B, V] with top-k and top-p applied (zeros elsewhere, not renormalised).

    Per row, in descending probability (ties: lower token id first): top-k keeps the first k;
    top-p then keeps the tokens before the first one whose preceding mass (float64, in that
    order) reaches top_p times the row's total after top-k (a float64 sum in token-id order)
    minus TOP_P_EPS. Computed on each row's TOP_CANDIDATES most likely tokens while that
    settles it (the candidates strictly above the K-th value are exactly the full sort's
    prefix: top-k is settled when k is within that prefix, top-p when its cut is), else on the
    whole sorted row: the same bits either way, for any batch."""
    B, V = probs.shape
    dev = probs.device
    top_ks = info.top_ks.clamp(max=V)  # [B] V where top-k is off
    top_ps = info.top_ps  # [B]
    p_on = top_ps < 1.0  # [B]
    if info.need_top_p:
        full_totals = probs.cumsum(dim=-1, dtype=torch.float64)[:, -1]  # [B] token-id order
    out = probs.clone()  # rows with neither filter stay as they are
    todo = torch.nonzero((top_ks < V) | p_on).flatten()  # [R]
    for K in TOP_CANDIDATES + (V,):
        if todo.numel() == 0:
            break
        rows = probs[todo]  # [R, V]
        if K >= V:
            K = V
            vals, idx = rows.sort(dim=-1, descending=True, stable=True)  # [R, V] each
            safe = torch.full((len(todo),), V, dtype=torch.int64, device=dev)
        else:
            v, i = rows.topk(K, dim=-1, sorted=False)  # [R, K]
            i, o = i.sort(dim=-1)  # by token id, then stably by probability: ties by id
            vals, o2 = v.gather(1, o).sort(dim=-1, descending=True, stable=True)
            idx = i.gather(1, o2)
            safe = (vals > vals[:, -1:]).sum(dim=-1)  # [R] the full sort's prefix
        pos = torch.arange(K, device=dev)  # [K]
        ks = top_ks[todo]  # [R]
        masked = vals.masked_fill(pos >= ks[:, None], 0.0)  # [R, K] after top-k
        keep = torch.minimum(ks, torch.full_like(ks, K))  # [R] kept count so far
        settled = ks <= safe
        if info.need_top_p:
            # the total after top-k in token-id order: the candidates hold it when top-k applies
            # (the zeros between them add nothing, exactly)
            by_id = masked.gather(1, idx.argsort(dim=-1))
            totals = torch.where(ks < V, by_id.cumsum(dim=-1, dtype=torch.float64)[:, -1],
                                 full_totals[todo])  # [R]
            cum = masked.cumsum(dim=-1, dtype=torch.float64)  # [R, K]
            target = top_ps[todo].double() * totals - TOP_P_EPS  # [R]
            # (never the first token: a top_p below TOP_P_EPS would otherwise keep none)
            drop = (cum - masked >= target[:, None]) & (pos > 0) & p_on[todo][:, None]
            first = torch.where(drop.any(dim=-1), drop.to(torch.uint8).argmax(dim=-1),
                                torch.full_like(ks, K))  # [R]
            keep = torch.minimum(keep, first)
            # top-p alone is settled when its cut falls inside the prefix; with top-k, the
            # total needs all k kept tokens among the candidates
            settled = settled | ((ks >= V) & (first < safe))
        if K == V:
            settled = torch.ones_like(settled)
        sel = torch.nonzero(settled).flatten()
        if sel.numel():
            kept = torch.where(pos < keep[sel, None], vals[sel], 0.0)  # [S, K]
            out[todo[sel]] = torch.zeros(len(sel), V, dtype=probs.dtype,
                                         device=dev).scatter_(1, idx[sel], kept)
        todo = todo[~settled]
    return out


def uniform_per_row(info: SamplingBatchInfo) -> torch.Tensor:
    """One U[0, 1) float64 draw per row [B] from `info.generator` (global RNG when None)."""
    return torch.rand(info.batch_size, dtype=torch.float64, device=info.device,
                      generator=info.generator)


def sample_from_probs(
    probs: torch.Tensor,
    info: SamplingBatchInfo,
    uniforms: torch.Tensor | None = None,
    positions: Sequence[int] | torch.Tensor | None = None,
) -> torch.Tensor:
    """Draw one token id per row [B] int64 from probs [B, V] (rows need not be normalised).

    Unseeded rows: inverse-CDF sampling with a float64 CDF, so tiny probabilities are not
    rounded away; `uniforms` [B] in [0, 1), when given, replaces the draw from
    `uniform_per_row(info)`. Seeded rows: Gumbel-max with the noise of (seed, positions[row]),
    `positions` [B] being the absolute position of the token drawn (required then). A token with
    zero probability is never returned.
    """
    B, V = probs.shape
    assert B == info.batch_size, f"probs have {B} rows, sampling info {info.batch_size}"
    u = uniform_per_row(info) if uniforms is None else uniforms.double()  # [B]
    # (drawn for every row, so the generator advances by the batch size whatever the rows are)
    inverse = ~(info.seeded & ~info.is_greedy) if info.any_seeded else None  # [B] or all rows
    if inverse is not None and not bool(inverse.any()):
        tokens = torch.zeros(B, dtype=torch.int64, device=probs.device)  # all drawn below
    else:
        sub = probs if inverse is None else probs[inverse]  # [B', V]
        cdf = sub.cumsum(dim=-1, dtype=torch.float64)  # [B', V]
        uu = u if inverse is None else u[inverse]
        target = (uu * cdf[:, -1]).unsqueeze(-1)  # [B', 1]
        # right=True: first index whose cdf is strictly above the target, never a zero-mass
        # token; u * total can round up to total: then the last token with mass
        drawn = torch.searchsorted(cdf, target, right=True).squeeze(-1)  # [B']
        last_nonzero = (V - 1) - (sub > 0).flip(-1).to(torch.uint8).argmax(dim=-1)  # [B']
        drawn = torch.minimum(drawn, last_nonzero)
        if inverse is None:
            tokens = drawn
        else:
            tokens = torch.zeros(B, dtype=torch.int64, device=probs.device)
            tokens[inverse] = drawn
    if info.any_seeded:
        assert positions is not None, "seeded rows need the positions of the tokens they draw"
        rows = torch.nonzero(info.seeded & ~info.is_greedy).flatten()  # [S]
        pos = torch.as_tensor(positions, dtype=torch.int64, device=probs.device)
        tokens[rows] = seeded_sample(probs[rows], info.seeds[rows], pos[rows])
    return tokens


def sample(
    logits: torch.Tensor,
    info: SamplingBatchInfo,
    prompt_ids: Sequence[Sequence[int]] | None = None,
    output_ids: Sequence[Sequence[int]] | None = None,
    positions: Sequence[int] | torch.Tensor | None = None,
) -> torch.Tensor:
    """Next token per row [B] int64: penalties (history required when any row has one), then the
    argmax for greedy rows and a draw from `process_logits` for the others. `positions` [B]:
    the absolute position of each row's new token (len(prompt) + len(output)); seeded rows
    need it."""
    if info.need_penalties:
        assert prompt_ids is not None and output_ids is not None, "penalties need token history"
        logits = apply_penalties(logits, info, prompt_ids, output_ids)
    if info.all_greedy:
        return argmax_rows(logits)
    probs = process_logits(logits, info)  # greedy rows are one-hot on the argmax
    return sample_from_probs(probs, info, positions=positions)


__all__ = ["RowHistory", "SamplingBatchInfo", "apply_penalties", "expand", "process_logits",
           "sample", "sample_from_probs", "uniform_per_row"]
