"""Batched logits processing and token sampling, one set of sampling params per row.

Pipeline for one decode step: `apply_penalties` (needs token history) -> greedy rows take the
argmax -> `process_logits` (temperature, top-k, top-p, min-p, renormalise) -> `sample_from_probs`.
Speculative verification calls `process_logits` on an `expand`-ed info to get the target
distribution at every tree node, and `sample_from_probs` / `uniform_per_row` for its draws.

Randomness: a row whose request has a seed draws from its own `torch.Generator`, so its tokens do
not depend on the other rows or on its position in the batch. Every other row draws from
`info.generator` (or torch's global RNG when that is None) in one vectorised call. A sampler call
draws exactly one uniform per row, in row order.
"""

from __future__ import annotations

import itertools
from collections.abc import Sequence
from dataclasses import dataclass, replace

import torch

from runtime.sampling.sampling_params import SamplingParams

# Top-p keeps the smallest prefix (by descending probability) whose mass reaches top_p; the slack
# absorbs float32 rounding of the softmax so mass 0.8 "reaches" top_p 0.8.
TOP_P_EPS = 1e-6


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
    # One entry per row: the request's generator for seeded rows, None otherwise. Rows repeated by
    # `expand` share the same generator object.
    generators: list[torch.Generator | None]
    generator: torch.Generator | None  # for unseeded rows; None -> torch's global RNG
    vocab_size: int
    all_greedy: bool
    need_top_k: bool
    need_top_p: bool
    need_min_p: bool
    need_repetition_penalty: bool
    need_output_penalties: bool  # frequency or presence

    @property
    def batch_size(self) -> int:
        return len(self.generators)

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
        generators: Sequence[torch.Generator | None] | None = None,
        generator: torch.Generator | None = None,
    ) -> SamplingBatchInfo:
        """Build the batch info. `generators[i]`, when given, is request i's persistent generator
        (the owner of request state keeps it across steps so each step continues its stream);
        otherwise a seeded row gets a fresh generator seeded with `params[i].seed`, which
        restarts the stream, so rebuilding every step would repeat the same draw."""
        if generators is None:
            generators = [make_generator(p.seed, device) if p.seed is not None else None
                          for p in params]
        assert len(generators) == len(params), "one generator slot per row"
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
            generators=list(generators),
            generator=generator,
            vocab_size=vocab_size,
            all_greedy=all(greedy),
            need_top_k=any(1 <= p.top_k < vocab_size for p in sampled),
            need_top_p=any(p.top_p < 1.0 for p in sampled),
            need_min_p=any(p.min_p > 0.0 for p in sampled),
            need_repetition_penalty=any(p.repetition_penalty != 1.0 for p in params),
            need_output_penalties=any(
                p.frequency_penalty != 0.0 or p.presence_penalty != 0.0 for p in params
            ),
        )


def make_generator(seed: int, device: torch.device | str = "cpu") -> torch.Generator:
    g = torch.Generator(device=device)
    g.manual_seed(seed)
    return g


def expand(info: SamplingBatchInfo, repeats: Sequence[int] | torch.Tensor) -> SamplingBatchInfo:
    """Repeat row i's params `repeats[i]` times (e.g. once per draft-tree node of request i).

    A seeded row's copies share the request's generator object; since draws happen in row
    order, the copies consume consecutive values of that one stream, which is reproducible for a
    given tree shape and independent of the other requests.
    """
    # A tensor of counts is read on the host (one sync): generators are per-row Python objects.
    counts = [int(r) for r in (repeats.tolist() if isinstance(repeats, torch.Tensor) else repeats)]
    assert len(counts) == info.batch_size, "one repeat count per row"
    index = torch.tensor(counts, dtype=torch.int64, device=info.device)

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
        generators=[g for g, n in zip(info.generators, counts) for _ in range(n)],
    )


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
) -> torch.Tensor:
    """Return penalised logits [B, V] float32 (the input is not modified).

    Repetition penalty (HF): every token seen in prompt or output has a positive logit divided by
    the penalty and a negative one multiplied. Frequency / presence (OpenAI), output tokens only:
    subtract `frequency_penalty * count` and `presence_penalty * (count > 0)`.
    """
    B, V = logits.shape
    assert len(prompt_ids) == B and len(output_ids) == B, "one history per row"
    out = logits.float()
    if info.need_repetition_penalty:
        seen = torch.zeros(B * V, dtype=torch.bool, device=logits.device)  # [B * V]
        both = [list(p) + list(o) for p, o in zip(prompt_ids, output_ids)]
        seen[_token_index(both, V, logits.device)] = True
        rp = info.repetition_penalties[:, None]  # [B, 1]
        penalised = torch.where(out > 0, out / rp, out * rp)
        out = torch.where(seen.view(B, V), penalised, out)
    if info.need_output_penalties:
        index = _token_index(output_ids, V, logits.device)
        counts = torch.zeros(B * V, dtype=torch.float32, device=logits.device)  # [B * V]
        counts.scatter_add_(0, index, torch.ones_like(index, dtype=torch.float32))
        counts = counts.view(B, V)
        out = out - info.frequency_penalties[:, None] * counts
        out = out - info.presence_penalties[:, None] * (counts > 0).float()
    return out


def _one_hot_argmax(logits: torch.Tensor) -> torch.Tensor:
    probs = torch.zeros(logits.shape, dtype=torch.float32, device=logits.device)  # [B, V]
    return probs.scatter_(1, logits.argmax(dim=-1, keepdim=True), 1.0)


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
        sorted_probs, order = probs.sort(dim=-1, descending=True, stable=True)  # [B, V] each
        if info.need_top_k:
            ranks = torch.arange(V, device=logits.device)  # [V]
            sorted_probs = sorted_probs.masked_fill(ranks >= info.top_ks[:, None], 0.0)
        if info.need_top_p:
            cum = sorted_probs.cumsum(dim=-1, dtype=torch.float64)  # [B, V]
            mass_before = cum - sorted_probs  # exclusive prefix sum
            target = info.top_ps[:, None].double() * cum[:, -1:] - TOP_P_EPS  # [B, 1]
            drop = (mass_before >= target) & (info.top_ps[:, None] < 1.0)
            sorted_probs = sorted_probs.masked_fill(drop, 0.0)
        probs = torch.zeros_like(probs).scatter_(1, order, sorted_probs)

    if info.need_min_p:
        threshold = info.min_ps[:, None] * probs.amax(dim=-1, keepdim=True)  # [B, 1]
        probs = probs.masked_fill(probs < threshold, 0.0)

    probs = probs / probs.sum(dim=-1, keepdim=True)
    return torch.where(info.is_greedy[:, None], _one_hot_argmax(logits), probs)


def uniform_per_row(info: SamplingBatchInfo) -> torch.Tensor:
    """One U[0, 1) float64 draw per row [B]: seeded rows from their own generator (consecutive
    rows sharing one generator draw in one call), the rest from `info.generator` at once."""
    u = torch.rand(info.batch_size, dtype=torch.float64, device=info.device,
                   generator=info.generator)  # [B]
    row = 0
    for _, group in itertools.groupby(info.generators, key=id):
        n = len(list(group))
        g = info.generators[row]
        if g is not None:
            u[row:row + n] = torch.rand(n, dtype=torch.float64, device=info.device, generator=g)
        row += n
    return u


def sample_from_probs(
    probs: torch.Tensor, info: SamplingBatchInfo, uniforms: torch.Tensor | None = None
) -> torch.Tensor:
    """Draw one token id per row [B] int64 from probs [B, V] (rows need not be normalised).

    Inverse-CDF sampling with a float64 CDF, so tiny probabilities are not rounded away; a
    token with zero probability is never returned. `uniforms` [B] in [0, 1), when given, replaces
    the draw from `uniform_per_row(info)` (a caller that already drew them, or a test).
    """
    B, V = probs.shape
    assert B == info.batch_size, f"probs have {B} rows, sampling info {info.batch_size}"
    u = uniform_per_row(info) if uniforms is None else uniforms.double()  # [B]
    cdf = probs.cumsum(dim=-1, dtype=torch.float64)  # [B, V]
    target = (u * cdf[:, -1]).unsqueeze(-1)  # [B, 1]
    # right=True: first index whose cdf is strictly above the target, never a zero-mass token.
    tokens = torch.searchsorted(cdf, target, right=True).squeeze(-1)  # [B]
    # u * total can round up to total; fall back to the last token with mass.
    last_nonzero = (V - 1) - (probs > 0).flip(-1).to(torch.uint8).argmax(dim=-1)  # [B]
    return torch.minimum(tokens, last_nonzero)


def sample(
    logits: torch.Tensor,
    info: SamplingBatchInfo,
    prompt_ids: Sequence[Sequence[int]] | None = None,
    output_ids: Sequence[Sequence[int]] | None = None,
) -> torch.Tensor:
    """Next token per row [B] int64: penalties (history required when any row has one), then the
    argmax for greedy rows and a draw from `process_logits` for the others."""
    if info.need_penalties:
        assert prompt_ids is not None and output_ids is not None, "penalties need token history"
        logits = apply_penalties(logits, info, prompt_ids, output_ids)
    if info.all_greedy:
        return logits.argmax(dim=-1)
    probs = process_logits(logits, info)  # greedy rows are one-hot on the argmax
    return sample_from_probs(probs, info)
