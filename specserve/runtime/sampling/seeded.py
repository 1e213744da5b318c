"""Counter-based randomness for seeded requests: a token depends on (seed, position) alone.

A request with a `seed` draws the token at absolute position `pos` (prompt tokens count, so
the first output token of a 10-token prompt is at position 10) by Gumbel-max:

    token = argmax_v  log p(v) + G(seed, pos, v),    G = -log(-log U),  U ~ Uniform(0, 1)

over the tokens with p(v) > 0, where p is the fully processed distribution (penalties,
temperature, top-k, top-p, min-p). With independent standard Gumbel noise per token this is an
exact sample from p (the Gumbel-max trick). U is not drawn from a stream but computed: a
splitmix64 hash of (seed, pos, v), in int64 torch ops (wrapping multiplication, logical shifts)
so every device and every batch computes the same bits. Consequences:

- the token at a position does not depend on how many draws came before it, on the other rows
  of the batch, on retraction, or on whether it was sampled in a decode step or found at a node
  of a speculative verify tree: plain and speculative decoding give the same tokens as long as
  they see the same p (specserve/speculative/verify.py: `verify_seeded`);
- different positions use different noise, so a sequence is an exact sample of the target's
  autoregressive distribution (each position's noise is independent of the prefix it follows);
- a drafter may draw its candidates with the same noise (Gumbel-top-m over its own q): that
  couples draft and target without changing what the target outputs.
"""

from __future__ import annotations

from collections.abc import Sequence

import torch

from specserve.runtime.sampling.argmax import argmax_rows

_MASK64 = (1 << 64) - 1


def _signed(x: int) -> int:
    """An unsigned 64-bit value as the int64 with the same bits."""
    x &= _MASK64
    return x - (1 << 64) if x >= 1 << 63 else x


_GOLDEN = _signed(0x9E3779B97F4A7C15)
_M1 = _signed(0xBF58476D1CE4E5B9)
_M2 = _signed(0x94D049BB133111EB)
_INV_2_53 = 2.0**-53


def seed_to_int64(seed: int) -> int:
    """A seed in [0, 2**64) (SamplingParams' range) as int64 bits."""
    return _signed(seed)


def _srl(x: torch.Tensor, k: int) -> torch.Tensor:
    # logical right shift of int64 bits: `>>` is arithmetic (sign-filling) on signed ints
    return (x >> k) & ((1 << (64 - k)) - 1)


def _mix(z: torch.Tensor) -> torch.Tensor:
    """splitmix64: the state step (add the golden gamma) then the output mix; int64 in, out."""
    z = z + _GOLDEN
    z = (z ^ _srl(z, 30)) * _M1
    z = (z ^ _srl(z, 27)) * _M2
    return z ^ _srl(z, 31)


def row_keys(seeds: torch.Tensor, positions: torch.Tensor) -> torch.Tensor:
    """[R] int64 key of each (seed, position) row; seeds as `seed_to_int64` bits."""
    return _mix(_mix(seeds.to(torch.int64)) ^ positions.to(torch.int64))


def gumbel(keys: torch.Tensor, token_ids: torch.Tensor) -> torch.Tensor:
    """Standard Gumbel noise, float64, one value per (key, token) pair (shapes broadcast)."""
    h = _mix(keys ^ token_ids.to(torch.int64))
    u = (_srl(h, 11).to(torch.float64) + 0.5) * _INV_2_53  # in (0, 1): 53 random bits
    return -torch.log(-torch.log(u))


def gumbel_noise(seed: int, position: int, token_ids: torch.Tensor) -> torch.Tensor:
    """G(seed, position, v) for every v of `token_ids` [K] → [K] float64."""
    dev = token_ids.device
    key = row_keys(torch.tensor([seed_to_int64(seed)], device=dev),
                   torch.tensor([position], device=dev))
    return gumbel(key, token_ids)


def seeded_sample(
    probs: torch.Tensor, seeds: torch.Tensor | Sequence[int], positions: torch.Tensor
    | Sequence[int],
) -> torch.Tensor:
    """Gumbel-max draw per row [R] int64 from probs [R, V] (unnormalised is fine).

    seeds [R] (int64 bits, `seed_to_int64`), positions [R]: the absolute position of the token
    each row draws. Only tokens with p > 0 compete; when few do (top-p / top-k leave a few
    hundred of 49k) only their noise is computed, else the whole row's (the same values).
    """
    R, V = probs.shape
    dev = probs.device
    seeds = torch.as_tensor(seeds, dtype=torch.int64, device=dev)
    positions = torch.as_tensor(positions, dtype=torch.int64, device=dev)
    assert seeds.shape == (R,) and positions.shape == (R,), "one seed and position per row"
    keys = row_keys(seeds, positions)  # [R]
    support = probs > 0  # [R, V]
    nnz = int(support.sum())
    if nnz * 4 >= R * V:  # most tokens compete (no top-k / top-p): dense, no index lists
        noise = gumbel(keys[:, None], torch.arange(V, device=dev)[None, :])  # [R, V]
        scores = torch.where(support, probs.double().log() + noise, -torch.inf)
        return argmax_rows(scores)
    rows, toks = torch.nonzero(support, as_tuple=True)  # [nnz] each
    score = probs[rows, toks].double().log() + gumbel(keys[rows], toks)  # [nnz]
    scores = torch.full((R, V), -torch.inf, dtype=torch.float64, device=dev)
    scores[rows, toks] = score
    return argmax_rows(scores)
