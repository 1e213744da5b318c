"""Tokenizers: loading a model directory's tokenizer, chat templates, and building a
`tokenizer.json` from GGUF tokenizer metadata.

Only local files are read (`local_files_only=True`), so this works with `HF_HUB_OFFLINE=1` and
on machines that cannot reach a model hub.
"""

from __future__ import annotations

import json
import logging
from pathlib import Path
from typing import TYPE_CHECKING, Any, NamedTuple

from tokenizers import AddedToken, Regex, Tokenizer, decoders, models, pre_tokenizers, processors

from specserve.runtime.errors import ModelLoadError

if TYPE_CHECKING:
    from transformers import PreTrainedTokenizerFast

logger = logging.getLogger(__name__)

# GGUF token types (llama.cpp's llama_token_type)
_TOKEN_UNKNOWN, _TOKEN_CONTROL, _TOKEN_USER_DEFINED = 2, 3, 4

# Split patterns of the pre-tokenizers llama.cpp names in `tokenizer.ggml.pre`.
_LLAMA3_SPLIT = (
    r"(?i:'s|'t|'re|'ve|'m|'ll|'d)|[^\r\n\p{L}\p{N}]?\p{L}+|\p{N}{1,3}"
    r"| ?[^\s\p{L}\p{N}]+[\r\n]*|\s*[\r\n]+|\s+(?!\S)|\s+"
)
_QWEN2_SPLIT = (
    r"(?i:'s|'t|'re|'ve|'m|'ll|'d)|[^\r\n\p{L}\p{N}]?\p{L}+|\p{N}"
    r"| ?[^\s\p{L}\p{N}]+[\r\n]*|\s*[\r\n]+|\s+(?!\S)|\s+"
)
_GPT2_PRE = ("default", "gpt2", "gpt-2", "mpt", "olmo")
# Each digit is its own pre-token, then the GPT-2 split (StarCoder-style vocabularies).
_DIGITS_THEN_GPT2_PRE = ("smollm", "starcoder", "refact", "codeshell")
_SPLIT_PRE = {
    "llama3": _LLAMA3_SPLIT, "llama-v3": _LLAMA3_SPLIT, "llama-bpe": _LLAMA3_SPLIT,
    "smaug-bpe": _LLAMA3_SPLIT, "dbrx": _LLAMA3_SPLIT,
    "qwen2": _QWEN2_SPLIT, "deepseek-r1-qwen": _QWEN2_SPLIT,
}


class GGUFTokenizer(NamedTuple):
    tokenizer: Tokenizer
    tokenizer_config: dict[str, Any]  # contents of tokenizer_config.json
    bos_token_id: int | None
    eos_token_ids: list[int]
    pad_token_id: int | None


# tokenizer_config.json classes that name the generic fast tokenizer itself (our converted
# models write the first; transformers 5 calls it TokenizersBackend)
GENERIC_FAST_CLASSES = ("PreTrainedTokenizerFast", "TokenizersBackend")


def _named_class(path: Path) -> str | None:
    """The `tokenizer_class` a model directory's tokenizer_config.json names, if any."""
    try:
        cfg = json.loads((path / "tokenizer_config.json").read_text(encoding="utf-8"))
    except (OSError, ValueError):
        return None
    name = cfg.get("tokenizer_class") if isinstance(cfg, dict) else None
    return name if isinstance(name, str) else None


def load_tokenizer(model_dir: str | Path) -> PreTrainedTokenizerFast:
    """The fast (Rust `tokenizers`) tokenizer of a local model directory."""
    from transformers import AutoTokenizer, PreTrainedTokenizerFast

    path = Path(model_dir)
    if not any((path / name).is_file() for name in ("tokenizer.json", "tokenizer_config.json")):
        raise ModelLoadError(f"{path}: no tokenizer.json or tokenizer_config.json")
    try:
        if (path / "tokenizer.json").is_file() and _named_class(path) in GENERIC_FAST_CLASSES:
            # the class AutoTokenizer would pick, without the model config it reads first
            # (importing the architecture's config module: ~1.2 s of every process's start)
            tokenizer = PreTrainedTokenizerFast.from_pretrained(str(path), local_files_only=True)
        else:
            tokenizer = AutoTokenizer.from_pretrained(str(path), local_files_only=True)
    except (OSError, ValueError) as exc:
        raise ModelLoadError(f"{path}: cannot load tokenizer: {exc}") from exc
    if not isinstance(tokenizer, PreTrainedTokenizerFast):
        raise ModelLoadError(f"{path}: {type(tokenizer).__name__} is not a fast tokenizer")
    return tokenizer


def apply_chat_template(
    tokenizer: PreTrainedTokenizerFast,
    messages: list[dict[str, Any]],
    add_generation_prompt: bool = True,
    chat_template: str | None = None,
    tools: list[dict[str, Any]] | None = None,
) -> list[int]:
    """Token ids of `messages` rendered with the model's chat template (or `chat_template`),
    which gets `tools` (OpenAI's function tools) when given.

    Special tokens written by the template (e.g. `<|im_start|>`) become their single ids; no
    BOS/EOS is added beyond what the template writes.
    """
    if chat_template is None and not tokenizer.chat_template:
        raise ModelLoadError("this model has no chat template; pass chat_template explicitly")
    ids = tokenizer.apply_chat_template(
        messages,
        chat_template=chat_template,
        add_generation_prompt=add_generation_prompt,
        tokenize=True,
        return_dict=False,
        tools=tools,
    )
    return [int(i) for i in ids]


def build_gguf_tokenizer(meta: dict[str, Any]) -> GGUFTokenizer:
    """A byte-level BPE `tokenizer.json` equivalent to the tokenizer a GGUF file describes.

    `meta` holds the file's metadata (`tokenizer.ggml.*`, `tokenizer.chat_template`). Only
    `tokenizer.ggml.model == "gpt2"` (byte-level BPE) is supported.
    """
    kind = meta.get("tokenizer.ggml.model")
    if kind != "gpt2":
        raise ModelLoadError(
            f"GGUF tokenizer model {kind!r} is not supported; only 'gpt2' (byte-level BPE) is"
        )
    tokens: list[str] = list(meta["tokenizer.ggml.tokens"])
    types: list[int] = list(meta.get("tokenizer.ggml.token_type") or [1] * len(tokens))
    merges = [tuple(m.split(" ", 1)) for m in meta.get("tokenizer.ggml.merges") or []]
    vocab = {token: index for index, token in enumerate(tokens)}
    if len(vocab) != len(tokens):
        raise ModelLoadError("GGUF vocabulary has duplicate tokens")

    tokenizer = Tokenizer(models.BPE(vocab=vocab, merges=merges, fuse_unk=False))
    tokenizer.pre_tokenizer = _pre_tokenizer(str(meta.get("tokenizer.ggml.pre", "default")))
    tokenizer.decoder = decoders.ByteLevel()
    # Control tokens are matched whole and skipped when decoding with skip_special_tokens;
    # user-defined ones are matched whole but are ordinary text.
    tokenizer.add_special_tokens([
        AddedToken(t, special=True, normalized=False)
        for t, kind_id in zip(tokens, types) if kind_id in (_TOKEN_CONTROL, _TOKEN_UNKNOWN)
    ])
    tokenizer.add_tokens([
        AddedToken(t, special=False, normalized=False)
        for t, kind_id in zip(tokens, types) if kind_id == _TOKEN_USER_DEFINED
    ])
    assert tokenizer.get_vocab_size() == len(tokens), "added tokens must reuse vocabulary ids"

    def token_at(key: str) -> tuple[int | None, str | None]:
        index = meta.get(f"tokenizer.ggml.{key}")
        return (int(index), tokens[int(index)]) if index is not None else (None, None)

    bos_id, bos = token_at("bos_token_id")
    eos_id, eos = token_at("eos_token_id")
    _, unk = token_at("unknown_token_id")
    pad_id, pad = token_at("padding_token_id")
    add_bos = bool(meta.get("tokenizer.ggml.add_bos_token", False)) and bos is not None
    add_eos = bool(meta.get("tokenizer.ggml.add_eos_token", False)) and eos is not None
    tokenizer.post_processor = _post_processor(bos if add_bos else None, bos_id,
                                               eos if add_eos else None, eos_id)
    eos_ids = [i for i in (eos_id, *(token_at(k)[0] for k in ("eot_token_id", "eom_token_id")))
               if i is not None]
    config: dict[str, Any] = {
        "tokenizer_class": "PreTrainedTokenizerFast",
        "bos_token": bos, "eos_token": eos, "unk_token": unk, "pad_token": pad,
        "add_bos_token": add_bos, "add_eos_token": add_eos,
        "clean_up_tokenization_spaces": False,
    }
    if meta.get("tokenizer.chat_template"):
        config["chat_template"] = meta["tokenizer.chat_template"]
    return GGUFTokenizer(tokenizer, config, bos_id, list(dict.fromkeys(eos_ids)), pad_id)


def _pre_tokenizer(pre: str) -> pre_tokenizers.PreTokenizer:
    byte_level = pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=True)
    if pre in _DIGITS_THEN_GPT2_PRE:
        return pre_tokenizers.Sequence([pre_tokenizers.Digits(individual_digits=True), byte_level])
    if pre in _SPLIT_PRE:
        return pre_tokenizers.Sequence([
            pre_tokenizers.Split(Regex(_SPLIT_PRE[pre]), behavior="isolated"),
            pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=False),
        ])
    if pre not in _GPT2_PRE:
        logger.warning("GGUF pre-tokenizer %r is unknown; using the GPT-2 split", pre)
    return byte_level


def _post_processor(
    bos: str | None, bos_id: int | None, eos: str | None, eos_id: int | None
) -> processors.PostProcessor:
    if bos is None and eos is None:
        return processors.ByteLevel(trim_offsets=False)
    head = f"{bos}:0 " if bos else ""
    tail = f" {eos}:0" if eos else ""
    specials = [(t, i) for t, i in ((bos, bos_id), (eos, eos_id)) if t is not None]
    return processors.TemplateProcessing(
        single=f"{head}$A:0{tail}",
        pair=f"{head}$A:0{tail} {head.replace(':0', ':1')}$B:1{tail.replace(':0', ':1')}",
        special_tokens=specials,
    )
