"""`ModelRunner`: owns the weights, the KV tensors and the attention backend; runs one forward.

It never decides which slot holds what: callers (the scheduler, or `LocalGenerator` in-process)
pass slots inside the `ForwardBatch`.
"""

from __future__ import annotations

import logging
import time
from dataclasses import dataclass

import torch

from specserve.kernels.cpu import DEFAULT_ACTIVATION_DIGITS
from specserve.kernels.cpu.packing import FORMAT_NAMES
from specserve.runtime.forward_batch import ForwardBatch, ForwardMode
from specserve.runtime.layers.attention import create_attention_backend
from specserve.runtime.mem_cache.kv_pool import KVPool
from specserve.runtime.model_loader.config import ModelConfig
from specserve.runtime.model_loader.hf_dir import iter_safetensors_weights
from specserve.runtime.models.gemma3 import Gemma3ForCausalLM
from specserve.runtime.models.llama import LlamaForCausalLM, ModelOutput

logger = logging.getLogger(__name__)

DTYPES = {"float32": torch.float32, "bfloat16": torch.bfloat16, "float16": torch.float16}
# auto | torch (the reference engine) | a CPU-engine format (specserve/kernels/cpu/packing.py)
WEIGHT_FORMATS = ("auto", "torch", *FORMAT_NAMES)


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
    weight_format: str = "auto"  # WEIGHT_FORMATS, see resolve_engine
    # CPU engine, block formats: int8 digits per activation (1: int8 like llama.cpp, 3: ~22 bits)
    activation_digits: int = DEFAULT_ACTIVATION_DIGITS
    num_threads: int | None = None  # CPU engine threads (default: torch's)
    kv_cache_dtype: str = "auto"  # auto | float32 | float16 (float16: the CPU engine only)
    # tensor parallelism: this process is rank `tp_rank` of `tp_size`, the group meeting at
    # `dist_init_addr` (host:port); rank 0 serves, the others follow
    tp_size: int = 1
    tp_rank: int = 0
    dist_init_addr: str | None = None
    tp_comm: str = "gloo"  # shm or gloo (resolved --tp-comm, specserve/runtime/distributed.py)


def resolve_kv_dtype(kv_cache_dtype: str, engine: str, dtype: torch.dtype) -> torch.dtype:
    """The KV pool's dtype for `--kv-cache-dtype`: auto (and float32) keep the activations'
    dtype; float16 is the CPU engine's half-precision cache."""
    want = {"float32": torch.float32, "float16": torch.float16}.get(kv_cache_dtype)
    if kv_cache_dtype == "auto" or want == dtype:
        return dtype
    if want is None:
        raise ValueError(f"--kv-cache-dtype must be auto, float32 or float16, got "
                         f"{kv_cache_dtype!r}")
    if engine == "cpu" and want == torch.float16:
        return want
    raise ValueError(f"--kv-cache-dtype {kv_cache_dtype} is for the CPU engine (the torch engine "
                     f"keeps KV in --dtype, here {str(dtype).removeprefix('torch.')})")


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


def resolve_engine(weight_format: str, device: torch.device, dtype: str = "auto") -> str:
    """"cpu" (the C++ engine, specserve/kernels/cpu) or "torch" (the reference engine) for a weight
    format.

    auto picks the CPU engine on the CPU; without its extension that is an error unless
    SPECSERVE_ALLOW_NO_CPU_EXT=1 allows the torch engine instead (logged). A half-precision
    `--dtype` asks for the torch engine (the CPU engine computes in float32). An explicit packed
    format without the extension is an error, never a silent fallback."""
    if weight_format not in WEIGHT_FORMATS:
        raise ValueError(f"--weight-format must be one of {WEIGHT_FORMATS}, got {weight_format!r}")
    if weight_format == "torch":
        return "torch"
    if dtype not in ("auto", "float32"):
        if weight_format != "auto":
            raise ValueError(f"--dtype {dtype} is for the torch engine; the CPU engine "
                             f"(--weight-format {weight_format}) computes in float32")
        return "torch"
    if device.type != "cpu":
        if weight_format != "auto":
            raise ValueError(f"--weight-format {weight_format} is for the CPU engine; on "
                             f"{device.type} use auto or torch")
        return "torch"
    from specserve.kernels import cpu

    ok, why = cpu.available()
    if ok:
        return "cpu"
    if weight_format != "auto":
        raise ValueError(f"--weight-format {weight_format} needs the CPU extension: {why}")
    if not cpu.fallback_allowed():
        raise cpu.CpuExtensionUnavailable(
            f"the CPU engine needs its extension ({why}); run "
            "`python -m specserve.kernels.cpu.build` to "
            f"see why it fails, or set {cpu.ALLOW_NO_CPU_EXT}=1 (or --weight-format torch) to "
            "serve with the torch reference engine")
    logger.warning("CPU engine unavailable (%s); running the torch reference engine", why)
    return "torch"


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
        self.engine = resolve_engine(cfg.weight_format, self.device, cfg.dtype)
        # threads of the CPU engine's own pool (specserve/kernels/cpu), also for drafts on its
        # kernels
        self.kernel_threads = cfg.num_threads or torch.get_num_threads()
        capacity = cfg.max_total_tokens or max(4 * self.context_length, 8192)
        if self.engine == "cpu":
            self.dtype = torch.float32  # activations; weights keep their packed format
        self.kv_dtype = resolve_kv_dtype(cfg.kv_cache_dtype, self.engine, self.dtype)
        self.tp, self.tp_shards = None, None
        kv_heads, heads = mc.num_key_value_heads, mc.num_attention_heads
        if cfg.tp_size > 1:
            from specserve.runtime.distributed import TpGroup
            from specserve.runtime.model_loader.cpu_weights import tp_shards

            if self.device.type == "cuda":  # one GPU per rank of this host
                self.device = torch.device("cuda", cfg.tp_rank % torch.cuda.device_count())
                torch.cuda.set_device(self.device)
            self.tp_shards = tp_shards(mc, cfg.tp_size)
            self.tp = TpGroup(cfg.tp_rank, cfg.tp_size, cfg.dist_init_addr, cfg.tp_comm,
                              self.device)
            kv_heads = self.tp_shards[cfg.tp_rank].num_kv_heads
            heads = self.tp_shards[cfg.tp_rank].num_heads
        self.kv_pool = KVPool(
            capacity, mc.num_hidden_layers, kv_heads, mc.head_dim, self.kv_dtype, self.device,
        )
        if self.tp is not None and self.tp.leader:
            self.kv_pool.mirror = self.tp.send_move  # the other ranks move their heads' KV
        if self.engine == "cpu":
            if cfg.attention_backend not in ("auto", "cpu"):
                raise ValueError(f"the CPU engine has its own attention; --attention-backend "
                                 f"{cfg.attention_backend} needs --weight-format torch")
            self.model = self._cpu_model(cfg)
            self.weight_formats = dict(self.model.packed.formats)
            backend = "cpu"
            if self.tp is not None:
                shard = self.tp_shards[cfg.tp_rank]
                logger.info("tensor-parallel rank %d/%d: KV heads %s, query heads %s, MLP "
                            "columns %s, vocabulary rows %s", cfg.tp_rank, cfg.tp_size,
                            shard.kv_heads, shard.q_heads, shard.intermediate, shard.vocab)
            detail = (f"{self.model.isa} kernels, weights {self.model.packed.formats} "
                      f"({self.model.packed.nbytes / 2**20:.0f} MiB), activation digits "
                      f"{cfg.activation_digits}, KV {str(self.kv_dtype).removeprefix('torch.')}")
        else:
            model_class = Gemma3ForCausalLM if mc.is_gemma3 else LlamaForCausalLM
            weights = iter_safetensors_weights(cfg.model_dir)
            if self.tp is None:
                model = model_class(mc, self.device, self.dtype)
            else:
                from specserve.runtime.model_loader.shard import shard_config, shard_weights

                shard = self.tp_shards[cfg.tp_rank]
                model = model_class(shard_config(mc, shard), self.device, self.dtype)
                whole: dict[str, torch.Tensor] | None = {} if self.tp.leader else None
                weights = shard_weights(weights, mc, shard, whole)
            model.to(device=self.device, dtype=self.dtype)
            model.load_weights(weights)
            if self.tp is not None:
                self._shard_torch_model(model, whole)
            model.eval()
            packed = model.pack_weights() if cfg.pack_weights else 0
            self.model = model
            self.weight_formats = {str(self.dtype).removeprefix("torch."): packed}
            backend = cfg.attention_backend
            detail = f"torch reference engine, {packed} linears prepacked"
        self.attn_backend = create_attention_backend(
            backend, self.kv_pool, heads, mc.attention_scale
        )
        # full decode / verify forwards run so far, and the last one's (rows, seconds): the
        # speculation controller learns the verify-cost curve from the steps' own forwards
        self.timed_forwards = 0
        self.last_timed: tuple[int, float] = (0, 0.0)
        logger.info(
            "model %s (%s, %d layers) on %s/%s, %d KV slots, %s, %.1fs to load",
            mc.model_dir, mc.architecture, mc.num_hidden_layers, self.device,
            str(self.dtype).removeprefix("torch."), capacity, detail, time.perf_counter() - t0,
        )

    def _shard_torch_model(self, model, whole: dict[str, torch.Tensor] | None) -> None:
        """Wire the torch engine's shard into the group; rank 0 keeps the whole embedding
        and LM head for its drafters."""
        embed = head = None
        if whole is not None:
            mc = self.model_config
            embed = whole["embed_tokens.weight"].to(self.device, self.dtype)
            tied = mc.tie_word_embeddings or "lm_head.weight" not in whole
            head = embed if tied else whole["lm_head.weight"].to(self.device, self.dtype)
        model.enable_tensor_parallel(self.tp, [s.vocab for s in self.tp_shards], embed, head)

    def _cpu_model(self, cfg: RunnerConfig):
        from specserve.runtime.layers.rotary import RotaryEmbedding
        from specserve.runtime.model_loader.cpu_weights import load_packed_model
        from specserve.runtime.models.cpu_llama import CpuLlamaForCausalLM

        mc = self.model_config
        shard = self.tp_shards[cfg.tp_rank] if self.tp is not None else None
        packed = load_packed_model(mc, cfg.weight_format, shard=shard)
        head = None
        if self.tp is not None and self.tp.leader:
            from specserve.runtime.model_loader.cpu_weights import load_packed_head

            head = load_packed_head(mc, cfg.weight_format)
        rotary = RotaryEmbedding(mc.head_dim, max(mc.max_position_embeddings, 1), mc.rope_theta,
                                 mc.rope_scaling, self.device, torch.float32)
        threads = cfg.num_threads or torch.get_num_threads()
        return CpuLlamaForCausalLM(mc, packed, self.kv_pool, rotary, cfg.activation_digits,
                                   threads, self.tp, self.tp_shards, head)

    @property
    def kv_capacity(self) -> int:
        return self.kv_pool.capacity

    @property
    def vocab_size(self) -> int:
        return self.model_config.vocab_size

    def forward(self, batch: ForwardBatch, return_final_hidden: bool = False,
                layers: tuple[int, int] | None = None,
                hidden_in: torch.Tensor | None = None) -> ModelOutput:
        """One forward. `layers` = (begin, end): only those layers, then the final norm and LM
        head (early exit); begin > 0 starts from `hidden_in` [T, hidden] (the hidden state
        entering layer begin). On the CPU engine every layer's result is batch-invariant, so a
        token's hidden state after layer E is the same in an early-exit draft pass and in the
        full pass: a verify pass may resume at E from the draft's hidden states, exactly."""
        t0 = time.perf_counter()
        batch.check()
        if self.tp is not None and self.tp.leader:  # every rank runs it (tp_follower.py)
            self.tp.send_forward(batch, return_final_hidden, layers, hidden_in)
        batch = batch.to(self.device)
        batch.attn_metadata = None
        self.attn_backend.init_forward_metadata(batch)
        if layers is not None or hidden_in is not None:
            return self.model(batch, self.attn_backend, return_final_hidden, layers, hidden_in)
        out = self.model(batch, self.attn_backend, return_final_hidden)
        if batch.mode in (ForwardMode.DECODE, ForwardMode.TARGET_VERIFY):
            if self.device.type == "cuda":
                torch.cuda.synchronize(self.device)
            self.timed_forwards += 1
            self.last_timed = (batch.num_tokens, time.perf_counter() - t0)
        return out
