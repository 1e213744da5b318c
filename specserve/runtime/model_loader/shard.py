"""Which part of a model one tensor-parallel rank holds (Megatron's split, as SGLang's).

Attention is split by KV heads, each rank keeping its KV heads' query heads (column-parallel
q/k/v, row-parallel o_proj over those heads' columns); the MLP by intermediate columns
(column-parallel gate/up, row-parallel down); the embedding and LM head by vocabulary rows.
Splits need not be even (the default model's 3 KV heads over 2 ranks are 2 + 1) but fall on
whole tiles of 16 rows and on whole quantization blocks of a row-parallel matrix's K.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Iterable, Iterator
from dataclasses import dataclass

import torch

from specserve.runtime.model_loader.config import ModelConfig

ROWS_PER_TILE = 16  # specserve/kernels/cpu/packing.py NR


def _split(units: int, rank: int, world: int) -> tuple[int, int]:
    """[begin, end) of `units` for `rank`: contiguous, the first `units % world` one larger."""
    base, extra = divmod(units, world)
    begin = rank * base + min(rank, extra)
    return begin, begin + base + (rank < extra)


@dataclass(frozen=True)
class TpShard:
    rank: int
    world: int
    kv_heads: tuple[int, int]  # [begin, end) of the model's KV heads
    q_heads: tuple[int, int]  # their query heads
    intermediate: tuple[int, int]  # [begin, end) of the MLP's intermediate columns
    vocab: tuple[int, int]  # [begin, end) of the vocabulary rows

    @staticmethod
    def plan(cfg: ModelConfig, rank: int, world: int, block_weights: int = 32) -> TpShard:
        """Rank `rank` of `world`. `block_weights`: the K granularity of the row-parallel
        matrices' format (32; 256 for K-quant super-blocks)."""
        if not 0 <= rank < world:
            raise ValueError(f"tensor-parallel rank {rank} outside 0..{world - 1}")
        if world > cfg.num_key_value_heads:
            raise ValueError(f"--tp-size {world} exceeds the model's {cfg.num_key_value_heads} "
                             "KV heads (each rank holds at least one)")
        group = cfg.num_attention_heads // cfg.num_key_value_heads
        kv = _split(cfg.num_key_value_heads, rank, world)
        q = (kv[0] * group, kv[1] * group)
        for h in (q[0], q[1]):
            if (h * cfg.head_dim) % block_weights:
                raise ValueError(f"--tp-size {world}: a split at query head {h} is not on a "
                                 f"{block_weights}-weight block of o_proj")
        unit = max(block_weights, ROWS_PER_TILE)
        if cfg.intermediate_size % unit:
            raise ValueError(f"--tp-size {world}: intermediate size {cfg.intermediate_size} is "
                             f"not a multiple of {unit}")
        i0, i1 = _split(cfg.intermediate_size // unit, rank, world)
        v0, v1 = _split(-(-cfg.vocab_size // ROWS_PER_TILE), rank, world)
        vocab = (v0 * ROWS_PER_TILE, min(v1 * ROWS_PER_TILE, cfg.vocab_size))
        return TpShard(rank, world, kv, q, (i0 * unit, i1 * unit), vocab)

    @property
    def num_kv_heads(self) -> int:
        return self.kv_heads[1] - self.kv_heads[0]

    @property
    def num_heads(self) -> int:
        return self.q_heads[1] - self.q_heads[0]

    @property
    def intermediate_size(self) -> int:
        return self.intermediate[1] - self.intermediate[0]

    @property
    def vocab_size(self) -> int:
        return self.vocab[1] - self.vocab[0]


def shard_config(cfg: ModelConfig, shard: TpShard) -> ModelConfig:
    """The architecture of one rank's shard, as the torch engine's modules are built from it."""
    return dataclasses.replace(cfg, num_attention_heads=shard.num_heads,
                               num_key_value_heads=shard.num_kv_heads,
                               intermediate_size=shard.intermediate_size,
                               vocab_size=shard.vocab_size)


HEAD_WEIGHTS = ("embed_tokens.weight", "lm_head.weight")


def shard_weights(weights: Iterable[tuple[str, torch.Tensor]], cfg: ModelConfig, shard: TpShard,
                  whole: dict[str, torch.Tensor] | None = None,
                  ) -> Iterator[tuple[str, torch.Tensor]]:
    """HF-named checkpoint tensors cut to `shard` (for the torch engine's `load_weights`);
    the whole embedding and LM head also go into `whole`, when given."""
    d = cfg.head_dim
    rows = {"q_proj": shard.q_heads, "k_proj": shard.kv_heads, "v_proj": shard.kv_heads}
    for name, t in weights:
        base = name.removeprefix("model.")
        parts = base.split(".")
        if base in HEAD_WEIGHTS:
            if whole is not None:
                whole[base] = t
            t = t[shard.vocab[0]:shard.vocab[1]]
        elif len(parts) == 5 and parts[0] == "layers" and int(parts[1]) < cfg.num_hidden_layers:
            kind, leaf = parts[3], parts[4]
            if kind in rows:
                t = t[rows[kind][0] * d:rows[kind][1] * d]
            elif kind in ("gate_proj", "up_proj"):
                t = t[shard.intermediate[0]:shard.intermediate[1]]
            elif kind in ("o_proj", "down_proj") and leaf == "bias":
                t = t if shard.rank == 0 else torch.zeros_like(t)  # added once, by rank 0
            elif kind == "o_proj":
                t = t[:, shard.q_heads[0] * d:shard.q_heads[1] * d]
            elif kind == "down_proj":
                t = t[:, shard.intermediate[0]:shard.intermediate[1]]
        yield name, t.contiguous()
