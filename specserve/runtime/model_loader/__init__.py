"""Model loading: HF directories, GGUF conversion, the embedded default model, tokenizers."""

from __future__ import annotations

from typing import Any

from specserve.runtime.model_loader.config import (
    SUPPORTED_ARCHITECTURES,
    ModelConfig,
    check_architecture,
)
from specserve.runtime.model_loader.gguf_convert import convert_gguf, unpermute_qk
from specserve.runtime.model_loader.hf_dir import iter_safetensors_weights, weight_files
from specserve.runtime.model_loader.tokenizer import apply_chat_template, load_tokenizer

# default_model is imported on first use, so `python -m
# specserve.runtime.model_loader.default_model` does not find its own module already imported by
# this package (runpy warns about that).
_FROM_DEFAULT_MODEL = ("cache_dir", "embedded_gguf_path", "resolve_model_path")

__all__ = [
    "SUPPORTED_ARCHITECTURES",
    "ModelConfig",
    "apply_chat_template",
    "cache_dir",
    "check_architecture",
    "convert_gguf",
    "embedded_gguf_path",
    "iter_safetensors_weights",
    "load_tokenizer",
    "resolve_model_path",
    "unpermute_qk",
    "weight_files",
]


def __getattr__(name: str) -> Any:
    if name in _FROM_DEFAULT_MODEL:
        from specserve.runtime.model_loader import default_model

        return getattr(default_model, name)
    raise AttributeError(f"module {__name__!r} has no attribute {name!r}")
