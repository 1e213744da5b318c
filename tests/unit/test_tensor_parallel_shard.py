"""Tensor parallelism's pieces below the engine: each rank's share of a model
(specserve/runtime/model_loader/shard.py), the packed weights it loads (a shard's matrices are the
whole model's rows and columns, bit for bit), and the collectives' fixed order
(specserve/runtime/distributed.py: every rank gets the same sum, added in rank order)."""

from __future__ import annotations

import dataclasses

import numpy as np
import pytest
import torch
import torch.multiprocessing as mp

from specserve.kernels import cpu
from specserve.kernels.cpu.packing import Fmt, gguf_rows, quantize
from specserve.runtime.model_loader.config import ModelConfig
from specserve.runtime.model_loader.default_model import resolve_model_path
from specserve.runtime.model_loader.shard import TpShard
from tests.helpers.tiny_models import gguf_blocks


@pytest.fixture(scope="module")
def default_cfg() -> ModelConfig:
    return ModelConfig.from_dir(str(resolve_model_path(None)))


@pytest.mark.parametrize("world", [1, 2, 3])
def test_the_shards_cover_the_model_once(default_cfg, world):
    cfg = default_cfg
    shards = [TpShard.plan(cfg, r, world) for r in range(world)]
    for field, total in (("kv_heads", cfg.num_key_value_heads),
                         ("q_heads", cfg.num_attention_heads),
                         ("intermediate", cfg.intermediate_size), ("vocab", cfg.vocab_size)):
        spans = [getattr(s, field) for s in shards]
        assert spans[0][0] == 0 and spans[-1][1] == total, (field, spans)
        assert all(a[1] == b[0] and a[0] < a[1] for a, b in zip(spans, spans[1:])), spans
    group = cfg.num_attention_heads // cfg.num_key_value_heads
    for s in shards:
        assert s.num_heads == group * s.num_kv_heads
        assert s.intermediate_size % 32 == 0 and s.vocab[0] % 16 == 0
    if world == 2:  # the default model's 3 KV heads: 2 + 1
        assert [s.kv_heads for s in shards] == [(0, 2), (2, 3)]


def test_more_ranks_than_kv_heads_is_a_clear_error(default_cfg):
    with pytest.raises(ValueError, match="exceeds the model's 3 KV heads"):
        TpShard.plan(default_cfg, 0, 4)
    with pytest.raises(ValueError, match="outside"):
        TpShard.plan(default_cfg, 2, 2)
    odd = dataclasses.replace(default_cfg, head_dim=40)  # a split inside a 32-weight block
    with pytest.raises(ValueError, match="block of o_proj"):
        TpShard.plan(odd, 0, 2)


@pytest.mark.parametrize("fmt", [Fmt.Q8_0, Fmt.Q4_1, Fmt.Q4_K, Fmt.Q6_K])
def test_block_columns_are_the_matrix_columns(fmt):
    rng = np.random.default_rng(3)
    k = 768
    w = (rng.standard_normal((20, k)) * 0.1).astype(np.float32)
    blocks = gguf_rows(fmt, gguf_blocks(w, fmt.name, 3)) if fmt.is_kquant else quantize(fmt, w)
    full = blocks.dequantize()
    step = fmt.block_weights
    for b, e in ((0, step), (step, k), (0, k), (2 * step, 3 * step)):
        np.testing.assert_array_equal(blocks.cols(b, e).dequantize(), full[:, b:e])
    with pytest.raises(AssertionError):
        blocks.cols(0, step // 2)


@pytest.mark.skipif(not cpu.available()[0], reason="CPU extension unavailable")
def test_a_ranks_packed_weights_are_the_models_rows_and_columns(default_cfg):
    from specserve.runtime.model_loader.cpu_weights import load_packed_model

    cfg = default_cfg
    whole = load_packed_model(cfg, progress=False)
    shard = TpShard.plan(cfg, 1, 2)
    part = load_packed_model(cfg, progress=False, shard=shard)
    ext = cpu.load()

    def dense(p):
        return p.to_ext(ext).dense()

    d, q_size, kv_size = cfg.head_dim, cfg.num_attention_heads * cfg.head_dim, \
        cfg.num_key_value_heads * cfg.head_dim
    (q0, q1), (k0, k1) = shard.q_heads, shard.kv_heads
    for layer in (0, cfg.num_hidden_layers - 1):
        w, s = whole.layers[layer], part.layers[layer]
        qkv = dense(w["qkv"])
        want = torch.cat([qkv[q0 * d:q1 * d], qkv[q_size + k0 * d:q_size + k1 * d],
                          qkv[q_size + kv_size + k0 * d:q_size + kv_size + k1 * d]])
        assert torch.equal(dense(s["qkv"]), want)
        assert torch.equal(dense(s["o"]), dense(w["o"])[:, q0 * d:q1 * d])
        i0, i1 = shard.intermediate
        assert torch.equal(dense(s["down"]), dense(w["down"])[:, i0:i1])
    v0, v1 = shard.vocab
    assert torch.equal(dense(part.embed), dense(whole.embed)[v0:v1])
    assert part.lm_head is part.embed  # tied, as the whole model's


def _rank(rank: int, world: int, addr: str, comm: str, out) -> None:
    from specserve.runtime.distributed import TpGroup

    group = TpGroup(rank, world, addr, comm)
    g = torch.Generator().manual_seed(rank)
    t = torch.randn(5, 7, generator=g) * 10 ** rank
    group.reduce(t)
    big = torch.randn(1100, 1000, generator=g)  # above a shared slot (4 MiB): in pieces
    group.reduce(big)
    widths = [(0, 16), (16, 32), (32, 40)][:world]
    b, e = widths[rank]
    logits = group.gather_vocab(torch.full((2, e - b), float(rank)), widths)
    cmd = torch.arange(1_500_000, dtype=torch.int64) if rank == 0 else \
        torch.zeros(1_500_000, dtype=torch.int64)
    group._broadcast(cmd)
    # numpy, copied by value: a torch tensor would travel as a handle to this process's
    # memory, gone once it exits
    out.put((rank, t.numpy(), big.numpy(), None if logits is None else logits.numpy(),
             bool(torch.equal(cmd, torch.arange(1_500_000)))))
    group.close()


@pytest.mark.parametrize("comm", ["gloo", "shm"])
def test_collectives_sum_in_rank_order_and_gather_uneven_vocab_shards(comm):
    if comm == "shm" and not cpu.available()[0]:
        pytest.skip("the shared-memory collectives are in the CPU extension")
    world = 3
    ctx = mp.get_context("spawn")
    out = ctx.Queue()
    import socket

    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        addr = f"127.0.0.1:{s.getsockname()[1]}"
    procs = [ctx.Process(target=_rank, args=(r, world, addr, comm, out)) for r in range(world)]
    for p in procs:
        p.start()
    got = {r: [None if a is None else torch.from_numpy(a) for a in rest[:3]] + rest[3:]
           for r, *rest in (out.get(timeout=120) for _ in range(world))}
    for p in procs:
        p.join(30)
    gens = [torch.Generator().manual_seed(r) for r in range(world)]
    parts = [torch.randn(5, 7, generator=gens[r]) * 10 ** r for r in range(world)]
    bigs = [torch.randn(1100, 1000, generator=gens[r]) for r in range(world)]
    for r in range(world):
        t, big, _, cmd_ok = got[r]
        assert torch.equal(t, (parts[0] + parts[1]) + parts[2]), r  # same bits, rank order
        assert torch.equal(big, (bigs[0] + bigs[1]) + bigs[2]), r
        assert cmd_ok, r
    logits = got[0][2]
    assert logits.shape == (2, 40)
    assert torch.equal(logits[0], torch.tensor([0.0] * 16 + [1.0] * 16 + [2.0] * 8))
    assert got[1][2] is None and got[2][2] is None
