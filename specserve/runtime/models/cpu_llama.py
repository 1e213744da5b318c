"""The Llama-family and Gemma 3 decoders on the CPU engine: the whole stack in one extension
call.

Same interface as `LlamaForCausalLM` (`forward(batch, backend, return_final_hidden)`, `embed`,
`compute_logits`, `norm`, `embed_tokens`, `lm_head.weight`), so the model runner, the drafters
and the trainer use either. Weights stay in their packed format (Q4_1 / Q8_0 blocks for the
default model); `embed_tokens` and `lm_head.weight` are dequantized on first access only, for the
few callers that need dense matrices (token maps, the head trainer).

Every step inside is batch-invariant (specserve/kernels/cpu/csrc/kernels.h), so a token's logits do
not depend on which other tokens share its forward: verify rows equal decode rows bit for bit.
"""

from __future__ import annotations

import functools

import torch

from specserve.kernels import cpu
from specserve.kernels.cpu.packing import PackedModel
from specserve.runtime.distributed import TpGroup
from specserve.runtime.forward_batch import ForwardBatch
from specserve.runtime.layers.attention.cpu import CpuAttnMetadata
from specserve.runtime.layers.rotary import RotaryEmbedding
from specserve.runtime.mem_cache.kv_pool import KVPool
from specserve.runtime.model_loader.config import ModelConfig
from specserve.runtime.model_loader.shard import TpShard
from specserve.runtime.models.llama import ModelOutput
from specserve.runtime.sampling.logprobs import LogitStats


def _parts(packed) -> list:
    return packed if isinstance(packed, list) else [packed]


class _FinalNorm:
    """The final RMSNorm as a callable with a `.weight`, like
    `specserve.runtime.layers.norm.RMSNorm`."""

    def __init__(self, core, weight: torch.Tensor) -> None:
        self._core = core
        self.weight = weight

    def __call__(self, x: torch.Tensor) -> torch.Tensor:
        return self._core.final_norm(x)


class _DenseLMHead:
    """The LM head as a dense `specserve.runtime.layers.linear.Linear` looks to its readers
    (`weight` dequantized on first access, no bias, not prepacked), e.g. a token map's hot rows."""

    packed = None
    bias = None

    def __init__(self, model: CpuLlamaForCausalLM) -> None:
        self._model = model
        self.in_features = model.config.hidden_size
        self.out_features = model.config.vocab_size

    @functools.cached_property
    def weight(self) -> torch.Tensor:
        return self._model._dense(self._model._lm_head)


class CpuLlamaForCausalLM:
    """With `tp` (specserve/runtime/distributed.py), `packed` is this rank's shard (`shards[rank]`)
    and every forward is a collective (every rank runs it: rank 0 sent the batch): the ranks sum
    their partial projections and rank 0 gathers the logits (the others get None). Rank 0's drafters
    read the whole embedding and LM head (`head`), a local copy."""

    device = torch.device("cpu")
    dtype = torch.float32  # of activations, hidden states and logits

    def __init__(self, cfg: ModelConfig, packed: PackedModel, kv_pool: KVPool,
                 rotary: RotaryEmbedding, activation_digits: int, num_threads: int,
                 tp: TpGroup | None = None, shards: list[TpShard] | None = None,
                 head: tuple | None = None) -> None:
        assert kv_pool.dtype in (torch.float32, torch.float16) and kv_pool.device.type == "cpu", (
            "the CPU engine's KV is float32 or float16 on the CPU")
        ext = cpu.load()
        self.config = cfg
        self.packed = packed
        self.activation_digits = activation_digits
        self.num_threads = num_threads
        self.tp = tp
        shard = shards[tp.rank] if tp is not None else None
        self._vocab_shards = [s.vocab for s in shards] if shards else None
        self.core = ext.CpuModel(
            cfg.hidden_size, shard.num_heads if shard else cfg.num_attention_heads,
            shard.num_kv_heads if shard else cfg.num_key_value_heads, cfg.head_dim,
            shard.intermediate_size if shard else cfg.intermediate_size,
            shard.vocab_size if shard else cfg.vocab_size, cfg.rms_norm_eps, activation_digits,
            num_threads, "",
        )
        for layer, norm in zip(packed.layers, packed.norms):
            self.core.add_layer(
                [q.to_ext(ext) for q in _parts(layer["qkv"])], layer["o"].to_ext(ext),
                layer["gate_up"].to_ext(ext),
                layer["down"].to_ext(ext), norm["in_norm"], norm["post_norm"],
                norm.get("q_norm"), norm.get("k_norm"),
            )
        self._embed = packed.embed.to_ext(ext)
        tied = packed.lm_head is packed.embed
        self._lm_head = self._embed if tied else packed.lm_head.to_ext(ext)
        self.core.set_head(self._embed, self._lm_head, packed.final_norm)
        self.core.set_rope(rotary.cos, rotary.sin)
        if cfg.is_gemma3:
            self._configure_gemma3(cfg, packed, rotary)
        self.core.set_kv(kv_pool.k, kv_pool.v)
        if tp is not None:
            if tp.shm is not None:
                self.core.set_tensor_parallel_shm(shard.vocab[0], cfg.vocab_size, tp.shm)
            else:
                self.core.set_tensor_parallel(shard.vocab[0], cfg.vocab_size, tp.reduce)
            if head is not None:  # the whole head, for rank 0's own (non-collective) calls
                self._embed = head[0].to_ext(ext)
                self._lm_head = self._embed if head[1] is head[0] else head[1].to_ext(ext)
        self.norm = _FinalNorm(self.core, packed.final_norm)
        self.lm_head = _DenseLMHead(self)

    def _configure_gemma3(self, cfg: ModelConfig, packed: PackedModel,
                          rotary: RotaryEmbedding) -> None:
        """Gemma 3's differences (ModelConfig): sandwich norms and sliding windows per layer,
        the embedding and attention scales, GELU-tanh, the local layers' RoPE base."""
        for i, norm in enumerate(packed.norms):
            self.core.set_layer_gemma(i, norm["attn_out_norm"], norm["mlp_out_norm"],
                                      cfg.layer_window(i) or 0)
        self.core.configure(cfg.embed_scale, cfg.attention_scale, True)
        local = RotaryEmbedding(cfg.head_dim, rotary.cos.shape[0], cfg.rope_local_theta, None,
                                torch.device("cpu"), torch.float32)
        self.core.set_rope_local(local.cos, local.sin)

    @property
    def isa(self) -> str:
        return self.core.isa

    def __call__(self, batch: ForwardBatch, backend=None, return_final_hidden: bool = False,
                 layers: tuple[int, int] | None = None, hidden_in: torch.Tensor | None = None,
                 ) -> ModelOutput:
        return self.forward(batch, backend, return_final_hidden, layers, hidden_in)

    @torch.inference_mode()
    def forward(self, batch: ForwardBatch, backend=None, return_final_hidden: bool = False,
                layers: tuple[int, int] | None = None, hidden_in: torch.Tensor | None = None,
                ) -> ModelOutput:
        """`layers` = (begin, end): run only those layers (see LlamaForCausalLM.forward)."""
        meta: CpuAttnMetadata = batch.attn_metadata
        capture = sorted(set(batch.capture_layers))
        begin, end = layers if layers is not None else (0, -1)
        args = dict(
            input_ids=batch.input_ids, positions=batch.positions, out_loc=batch.out_cache_loc,
            tok_req=meta.tok_req, tok_local=meta.tok_local, kv_indptr=meta.kv_indptr,
            kv_indices=batch.kv_indices, prefix_len=meta.prefix_len, extend_len=meta.extend_len,
            masks=meta.masks, mask_indptr=meta.mask_indptr, logits_rows=batch.logits_indices,
            capture=capture, final_hidden=return_final_hidden, layer_begin=begin,
            layer_end=end, hidden_in=hidden_in, logit_top=batch.logit_top,
        )
        out = self.core.forward(**args)
        if self.tp is None:
            logits, amax = out[0], out[2]
            stats = LogitStats(out[3], out[4], out[5]) if batch.logit_top >= 0 else None
        else:
            logits, amax, stats = self.gather_logits(out[0], batch.logit_top)
        return ModelOutput(logits, dict(zip(capture, out[6:])),
                           out[1] if return_final_hidden else None, amax, stats)

    def gather_logits(self, shard: torch.Tensor, logit_top: int):
        """Tensor parallel: (logits [R, V], argmax, LogitStats or None) on rank 0 from every
        rank's vocabulary shard; (None, None, None) on the others."""
        if shard.shape[0] == 0:
            empty = torch.empty(0, self.config.vocab_size)
            return (empty, torch.empty(0, dtype=torch.int64), None) if self.tp.leader else (
                None, None, None)
        logits = self.tp.gather_vocab(shard, self._vocab_shards)
        if logits is None:
            return None, None, None
        ext = cpu.load()
        if logit_top >= 0:
            amax, lse, vals, ids = ext.logit_stats(logits, logit_top, self.num_threads)
            return logits, amax, LogitStats(lse, vals, ids)
        return logits, ext.argmax(logits, self.num_threads), None

    def embed(self, input_ids: torch.Tensor) -> torch.Tensor:
        if self.tp is not None:  # rank 0's whole table, not the forward's shard
            ids = input_ids.reshape(-1).tolist()
            rows = [self._embed.row(i) for i in ids]
            out = torch.stack(rows) if rows else torch.empty(0, self.config.hidden_size)
            if self.config.embed_scale != 1.0:
                out = out * self.config.embed_scale
            return out.view(*input_ids.shape, -1)
        return self.core.embed(input_ids.reshape(-1)).view(*input_ids.shape, -1)

    @property
    def packed_embed(self):
        """The whole packed embedding table, for a draft head run in the engine; None where
        the model scales its embeddings (Gemma), which such a head would not."""
        return self._embed if self.config.embed_scale == 1.0 else None

    def compute_logits(self, hidden: torch.Tensor) -> torch.Tensor:
        """hidden [n, H] (already normed) -> logits [n, vocab] float32."""
        if self.tp is not None:
            return cpu.load().linear(self._lm_head, hidden.float(), self.activation_digits,
                                     self.num_threads)
        return self.core.lm_head(hidden)

    def _dense(self, packed) -> torch.Tensor:
        return packed.dense()  # [N, K] float32, dequantized
    @functools.cached_property
    def embed_tokens(self) -> torch.Tensor:
        """[vocab, H] float32, dequantized on first access (not kept otherwise)."""
        return self._dense(self._embed)
