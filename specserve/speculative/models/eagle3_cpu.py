"""The EAGLE-3 head as one call into the CPU engine (specserve/kernels/cpu/csrc/engine.cpp).

Run as torch modules, a head forward is ~60 small ops; right after a target forward has
streamed the weights through the caches each costs tens of microseconds, so the head's forwards
cost a third of a decode step while their arithmetic is a tenth of one. Here the whole forward
(fc over the fused target features, the one decoder layer with its 2H-wide q/k/v input, the
final norm, the draft-vocabulary LM head and each row's top-k) is one call of a one-layer
`CpuModel` in block formats, reading the target's own quantized embedding.

Drafts only: verification is the target's, so the head's rounding (q8_0 / q4_0 weights, int8
activations) changes acceptance at most, never output.
"""

from __future__ import annotations

from typing import NamedTuple

import numpy as np
import torch

from specserve.kernels import cpu
from specserve.kernels.cpu.packing import (
    Fmt,
    Packed,
    finish,
    float_bits,
    interleave_tiles,
    pad_bias,
    quantize,
    tile_major,
)
from specserve.runtime.forward_batch import ForwardBatch
from specserve.runtime.layers.attention.cpu import plan
from specserve.runtime.layers.linear import DRAFT_ACTIVATION_DIGITS, Linear


class CoreOutput(NamedTuple):
    logits: torch.Tensor  # [R, V_draft] float32
    hidden: torch.Tensor  # [T, H]: the layer's output before `norm` (the next step's input)
    top_logq: torch.Tensor | None  # [R, k] log q of each row's k best draft ids
    top_ids: torch.Tensor | None  # [R, k] those draft ids


def _tiles(fmt: Fmt, w: torch.Tensor) -> np.ndarray:
    w = w.detach().float().numpy()
    return tile_major(fmt, quantize(fmt, w) if fmt.is_block else float_bits(fmt, w))


def pack_linear(fmt: Fmt, w: torch.Tensor, bias: torch.Tensor | None = None) -> Packed:
    """A dense [N, K] weight in a block format, tile-major and pair-interleaved."""
    b = None if bias is None else torch.from_numpy(pad_bias(bias.detach().float().numpy()))
    return Packed(fmt, w.shape[1], w.shape[0], torch.from_numpy(finish(fmt, _tiles(fmt, w))), b)


def pack_gate_up(fmt: Fmt, w: torch.Tensor, intermediate: int) -> Packed:
    """The fused [2I, H] gate/up weight as the engine's alternating gate and up tiles."""
    gate, up = w[:intermediate], w[intermediate:]
    data = finish(fmt, interleave_tiles(_tiles(fmt, gate), _tiles(fmt, up)))
    return Packed(fmt, w.shape[1], w.shape[0], torch.from_numpy(data))


def _dense(linear: Linear) -> torch.Tensor:
    assert not linear.is_packed, "build the CPU core from the head's dense weights"
    return linear.weight.data


class Eagle3CpuCore:
    """A one-layer `CpuModel` holding an `Eagle3Head`'s weights in `fmt` ("q8_0" / "q4_0";
    "f32" multiplies in float32, for tests against the torch head)."""

    def __init__(self, head, fmt: str, threads: int) -> None:
        ext = cpu.load()
        f = Fmt.parse(fmt)
        lc = head.config.layer
        hidden = head.config.hidden_size
        self.vocab = head.config.draft_vocab_size
        core = ext.CpuModel(hidden, lc.num_attention_heads, lc.num_key_value_heads, lc.head_dim,
                            lc.intermediate_size, self.vocab, lc.rms_norm_eps,
                            DRAFT_ACTIVATION_DIGITS, threads, "")
        layer = head.midlayer
        core.set_eagle3(layer.hidden_norm.weight.data)
        core.set_fc(pack_linear(f, _dense(head.fc), head.fc.bias).to_ext(ext))
        attn, mlp = layer.self_attn, layer.mlp
        core.add_layer([pack_linear(f, _dense(attn.qkv_proj), attn.qkv_proj.bias).to_ext(ext)],
                       pack_linear(f, _dense(attn.o_proj), attn.o_proj.bias).to_ext(ext),
                       pack_gate_up(f, _dense(mlp.gate_up_proj), lc.intermediate_size)
                       .to_ext(ext),
                       pack_linear(f, _dense(mlp.down_proj)).to_ext(ext),
                       layer.input_layernorm.weight.data,
                       layer.post_attention_layernorm.weight.data, None, None)
        # the token embedding: the target's own packed table, unless the head carries its own
        target_embed = head.target.packed_embed
        if head.embed_weight is not None or target_embed is None:
            dense = (head.target.dense_embed() if head.embed_weight is None
                     else head.embed_weight.data)
            target_embed = pack_linear(Fmt.Q8_0, dense).to_ext(ext)
        self._lm_head = pack_linear(f, _dense(head.lm_head)).to_ext(ext)
        core.set_head(target_embed, self._lm_head, head.norm.weight.data)
        core.set_rope(head.rotary.cos, head.rotary.sin)
        self.core = core
        self.set_kv(head.kv_pool)

    def set_kv(self, pool) -> None:
        """The head's one-layer KV pool (again after it grows)."""
        self.core.set_kv([pool.k[0]], [pool.v[0]])

    def forward(self, batch: ForwardBatch, hidden: torch.Tensor, topk: int = 0) -> CoreOutput:
        """hidden: [T, 3H] fused target features or [T, H] the head's own previous output;
        `topk` > 0 also returns each logits row's k best draft ids and their log q."""
        if batch.attn_metadata is None:
            batch.attn_metadata = plan(batch)
        m = batch.attn_metadata
        out = self.core.forward(
            input_ids=batch.input_ids, positions=batch.positions, out_loc=batch.out_cache_loc,
            tok_req=m.tok_req, tok_local=m.tok_local, kv_indptr=m.kv_indptr,
            kv_indices=batch.kv_indices, prefix_len=m.prefix_len, extend_len=m.extend_len,
            masks=m.masks, mask_indptr=m.mask_indptr, logits_rows=batch.logits_indices,
            capture=[1], final_hidden=False, layer_begin=0, layer_end=-1,
            hidden_in=hidden, logit_top=topk if topk > 0 else -1)
        if topk > 0:  # log q = logit - log-sum-exp, from the engine's row statistics
            return CoreOutput(out[0], out[6], out[4] - out[3][:, None], out[5])
        return CoreOutput(out[0], out[6], None, None)
