"""`ModelRunner`: owns the weights, the KV tensors and the attention backend; runs one forward.

It never decides which slot holds what: callers (the scheduler, or `LocalGenerator` in-process)
pass slots inside the `ForwardBatch`.
"""

from __future__ import annotations

import logging
import time
from dataclasses import dataclass

import torch

from runtime.layers.attention import create_attention_backend
from runtime.mem_cache.kv_pool import KVPool
from runtime.model_loader.config import ModelConfig
from runtime.model_loader.hf_dir import iter_safetensors_weights
from runtime.model_runner.forward_batch import ForwardBatch
from runtime.models.llama import LlamaForCausalLM, ModelOutput

logger = logging.getLogger(__name__)

DTYPES = {"float32": torch.float32, "bfloat16": torch.bfloat16, "float16": torch.float16}


@dataclass(frozen=True)
class RunnerConfig:
    model_dir: str
    device: str = "auto"  # auto | cpu | cuda
    dtype: str = "auto"  # auto | float32 | bfloat16 | float16
    attention_backend: str = "auto"
    max_total_tokens: int | None = None  # KV slots; None = derived from context length
    context_length: int | None = None
    # CPU fp32: prepack linear weights for oneDNN (faster small-M matmuls, see layers/linear.py)
    pack_weights: bool = True


def resolve_device(device: str) -> torch.device:
    if device == "auto":
        return torch.device("cuda" if torch.cuda.is_available() else "cpu")
    if device == "cuda" and not torch.cuda.is_available():
        raise ValueError("--device cuda requested but CUDA is not available")
    return torch.device(device)


def resolve_dtype(dtype: str, device: torch.device) -> torch.dtype:
    if dtype == "auto":
        # fp32 on CPU: no native bf16 math here and small-M bf16 matmuls are slow.
        return torch.bfloat16 if device.type == "cuda" else torch.float32
    if dtype not in DTYPES:
        raise ValueError(f"dtype {dtype!r} not supported; choose auto or one of {sorted(DTYPES)}")
    return DTYPES[dtype]


class ModelRunner:
    def __init__(self, cfg: RunnerConfig) -> None:
        t0 = time.perf_counter()
        self.device = resolve_device(cfg.device)
        self.dtype = resolve_dtype(cfg.dtype, self.device)
        self.model_config = ModelConfig.from_dir(cfg.model_dir, cfg.context_length)
        mc = self.model_config
        self.context_length = min(
            cfg.context_length or mc.max_position_embeddings, mc.max_position_embeddings
        )
        model = LlamaForCausalLM(mc, self.device, self.dtype)
        model.to(device=self.device, dtype=self.dtype)
        model.load_weights(iter_safetensors_weights(cfg.model_dir))
        model.eval()
        packed = model.pack_weights() if cfg.pack_weights else 0
        self.model = model
        capacity = cfg.max_total_tokens or max(4 * self.context_length, 8192)
        self.kv_pool = KVPool(
            capacity, mc.num_hidden_layers, mc.num_key_value_heads, mc.head_dim,
            self.dtype, self.device,
        )
        self.attn_backend = create_attention_backend(
            cfg.attention_backend, self.kv_pool, mc.num_attention_heads, mc.head_dim**-0.5
        )
        logger.info(
            "model %s (%s, %d layers) on %s/%s, %d KV slots, %d linears prepacked, %.1fs to load",
            mc.model_dir, mc.architecture, mc.num_hidden_layers, self.device,
            str(self.dtype).removeprefix("torch."), capacity, packed, time.perf_counter() - t0,
        )

    @property
    def kv_capacity(self) -> int:
        return self.kv_pool.capacity

    @property
    def vocab_size(self) -> int:
        return self.model_config.vocab_size

    def forward(self, batch: ForwardBatch, return_final_hidden: bool = False) -> ModelOutput:
        batch.check()
        batch = batch.to(self.device)
        batch.attn_metadata = None
        self.attn_backend.init_forward_metadata(batch)
        return self.model(batch, self.attn_backend, return_final_hidden)
