"""The embedded default model (SmolLM2-135M-Instruct Q4_1 GGUF) converts into a directory whose
tokenizer and weights agree with transformers' own GGUF loader.

Uses the real cache (`$SPECSERVE_CACHE_DIR`, default ~/.cache/specserve): the first run converts
(about 10 s), later runs reuse it.
"""

from __future__ import annotations

import json
import shutil
import time
from pathlib import Path

import pytest
import torch

from specserve.runtime.model_loader import (
    ModelConfig,
    apply_chat_template,
    embedded_gguf_path,
    iter_safetensors_weights,
    load_tokenizer,
    resolve_model_path,
)
from specserve.runtime.model_loader.gguf_convert import COMPLETE_MARKER

pytestmark = pytest.mark.slow

TEXTS = {
    "plain": "The quick brown fox jumps over the lazy dog. It's 3:45pm, isn't it?",
    "code": "def fib(n: int) -> int:\n    if n < 2:\n        return n\n"
            "    return fib(n - 1) + fib(n - 2)  # 2x recursion\n\n\nprint(fib(30))\n",
    "unicode": "naïve café — “quotes” 日本語のテキスト 😀👍🏽 Ωμέγα \u00a0nbsp\ttab",
    "specials": "<|im_start|>user\nhello<|im_end|>\n<|endoftext|>",
}
MESSAGES = [
    {"role": "system", "content": "You are terse."},
    {"role": "user", "content": "What is 12 * 12?"},
    {"role": "assistant", "content": "144"},
    {"role": "user", "content": "And 13 * 13?"},
]


@pytest.fixture(scope="module")
def model_dir() -> Path:
    start = time.perf_counter()
    path = resolve_model_path(None)
    print(f"default model ready in {time.perf_counter() - start:.1f}s at {path}")
    return path


@pytest.fixture(scope="module")
def reference_tokenizer():
    from transformers import AutoTokenizer

    gguf = embedded_gguf_path()
    return AutoTokenizer.from_pretrained(str(gguf.parent), gguf_file=gguf.name)


def test_default_model_is_converted_and_cached(model_dir: Path) -> None:
    assert (model_dir / COMPLETE_MARKER).is_file()
    cfg = ModelConfig.from_dir(model_dir)
    assert cfg.architecture == "LlamaForCausalLM"
    assert (cfg.num_hidden_layers, cfg.hidden_size) == (30, 576)
    assert (cfg.vocab_size, cfg.num_attention_heads, cfg.num_key_value_heads) == (49152, 9, 3)
    assert cfg.head_dim == 64 and cfg.tie_word_embeddings
    assert (cfg.bos_token_id, cfg.eos_token_ids) == (1, [2])
    start = time.perf_counter()
    assert resolve_model_path("default") == model_dir
    assert time.perf_counter() - start < 2.0, "a cached default model must not be reconverted"


@pytest.mark.parametrize("kind", sorted(TEXTS))
def test_tokenizer_matches_transformers_gguf_tokenizer(model_dir: Path, reference_tokenizer,
                                                       kind: str) -> None:
    ours = load_tokenizer(model_dir)
    text = TEXTS[kind]
    ids = ours.encode(text)
    assert ids == reference_tokenizer.encode(text)
    assert ours.decode(ids) == text


def test_generic_tokenizer_class_loads_as_autotokenizer_would(model_dir: Path, tmp_path,
                                                               monkeypatch) -> None:
    """load_tokenizer skips AutoTokenizer (and the model config it imports first) when
    tokenizer_config.json names the generic fast class: the same tokenizer, same behaviour; a
    directory naming any other class still goes through AutoTokenizer."""
    import transformers

    ours = load_tokenizer(model_dir)
    auto = transformers.AutoTokenizer.from_pretrained(str(model_dir), local_files_only=True)
    assert type(ours) is type(auto) and len(ours) == len(auto)
    for text in TEXTS.values():
        assert ours.encode(text) == auto.encode(text)
        assert ours.decode(ours.encode(text)) == auto.decode(auto.encode(text))
    assert apply_chat_template(ours, MESSAGES) == apply_chat_template(auto, MESSAGES)
    for attr in ("bos_token_id", "eos_token_id", "pad_token_id", "unk_token_id",
                 "all_special_ids", "model_max_length", "chat_template"):
        assert getattr(ours, attr) == getattr(auto, attr), attr

    other = tmp_path / "other"
    shutil.copytree(model_dir, other, ignore=shutil.ignore_patterns("*.safetensors", "*.gguf"))
    cfg = json.loads((other / "tokenizer_config.json").read_text())
    cfg["tokenizer_class"] = "GPT2TokenizerFast"
    (other / "tokenizer_config.json").write_text(json.dumps(cfg))
    calls = []
    real = transformers.AutoTokenizer.from_pretrained
    monkeypatch.setattr(transformers.AutoTokenizer, "from_pretrained",
                        lambda *a, **k: calls.append(a) or real(*a, **k))
    load_tokenizer(model_dir)
    assert calls == []
    load_tokenizer(other)
    assert len(calls) == 1


def test_chat_template_matches_transformers(model_dir: Path, reference_tokenizer) -> None:
    ours = load_tokenizer(model_dir)
    ids = apply_chat_template(ours, MESSAGES)
    expected = reference_tokenizer.apply_chat_template(
        MESSAGES, add_generation_prompt=True, tokenize=True, return_dict=False
    )
    assert ids == list(expected)
    assert ours.decode(ids).endswith("<|im_end|>\n<|im_start|>assistant\n")


def test_digits_are_split_before_whitespace_like_llama_cpp_smollm(model_dir: Path) -> None:
    # llama.cpp's "smollm" pre-tokenizer splits every digit first, then applies the GPT-2 split,
    # so the two spaces in "a  1" stay one pre-token ("ĠĠ"). transformers' GGUF loader skips
    # the digit step and yields "Ġ", "Ġ" here; we follow llama.cpp (and SmolLM2's tokenizer).
    ours = load_tokenizer(model_dir)
    assert ours.convert_ids_to_tokens(ours.encode("a  1")) == ["a", "ĠĠ", "1"]
    assert ours.convert_ids_to_tokens(ours.encode("x2024")) == ["x", "2", "0", "2", "4"]


def _transformers_gguf_weights() -> dict[str, torch.Tensor]:
    from transformers import AutoConfig, AutoModelForCausalLM
    from transformers.utils import is_accelerate_available

    gguf = embedded_gguf_path()
    if is_accelerate_available():
        model = AutoModelForCausalLM.from_pretrained(
            str(gguf.parent), gguf_file=gguf.name, dtype=torch.float32
        )
        return model.state_dict()
    # from_pretrained(gguf_file=...) insists on `accelerate`; its GGUF reader does not need it.
    from transformers.modeling_gguf_pytorch_utils import load_gguf_checkpoint

    config = AutoConfig.from_pretrained(str(gguf.parent), gguf_file=gguf.name)
    with torch.device("meta"):
        skeleton = AutoModelForCausalLM.from_config(config)
    return load_gguf_checkpoint(str(gguf), return_tensors=True, model_to_load=skeleton)["tensors"]


def test_weights_match_transformers_gguf_dequantization(model_dir: Path) -> None:
    reference = _transformers_gguf_weights()
    ours = dict(iter_safetensors_weights(model_dir))
    checked = ["model.embed_tokens.weight", "model.norm.weight",
               "model.layers.0.self_attn.q_proj.weight", "model.layers.0.self_attn.k_proj.weight",
               "model.layers.0.self_attn.v_proj.weight", "model.layers.0.mlp.down_proj.weight",
               "model.layers.29.self_attn.q_proj.weight", "model.layers.29.self_attn.k_proj.weight"]
    for name in checked:
        assert ours[name].shape == reference[name].shape, name
        torch.testing.assert_close(ours[name], reference[name].float(), atol=1e-6, rtol=0)
    assert set(ours) <= set(reference) and len(ours) == 272


def test_converted_model_answers_sensibly_in_transformers(model_dir: Path) -> None:
    # End to end: a wrong q/k un-permute or tokenizer would turn this answer into noise.
    from transformers import AutoModelForCausalLM

    tokenizer = load_tokenizer(model_dir)
    model = AutoModelForCausalLM.from_pretrained(model_dir, dtype=torch.float32)
    ids = apply_chat_template(tokenizer, [{"role": "user",
                                           "content": "What is the capital of France?"}])
    with torch.no_grad():
        out = model.generate(torch.tensor([ids]), max_new_tokens=10, do_sample=False)
    assert "Paris" in tokenizer.decode(out[0, len(ids):])
