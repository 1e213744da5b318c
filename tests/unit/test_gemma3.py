"""Gemma 3 on both engines, on a tiny random Gemma-3-shaped checkpoint written by transformers
(one KV head, q / k norms, four (1 + w) norms per block, GELU-tanh, scaled embeddings, its own
attention scale, a sliding window of 8 on layer 0 with its own RoPE base): the same logits as
transformers' Gemma3ForCausalLM on prompts longer than the window, and on the CPU engine a
token's logits bit-identical in prefill, chunked prefill, decode and a draft tree, on every
instruction set this CPU runs."""

from __future__ import annotations

import numpy as np
import pytest
import torch

from specserve.kernels import cpu
from specserve.runtime.model_loader.config import ModelConfig
from tests.helpers.tiny_models import write_tiny_model
from tests.unit.test_cpu_engine import PROMPT, every_kind_of_forward, prefill_logits, runner
from tests.unit.test_cpu_kernels import isas

OK, WHY = cpu.available()
LONG = PROMPT + [40, 41, 42, 43, 44, 45, 46, 47, 48, 49, 50, 51]  # 29 tokens: 3+ windows


@pytest.fixture(scope="module")
def gemma_dir(tmp_path_factory):
    return str(write_tiny_model(tmp_path_factory.mktemp("gemma3") / "m", "gemma3", seed=7))


def hf_logits(model_dir: str, ids: list[int]) -> torch.Tensor:
    from transformers import AutoModelForCausalLM

    model = AutoModelForCausalLM.from_pretrained(model_dir, dtype=torch.float32).eval()
    with torch.no_grad():
        return model(torch.tensor([ids])).logits[0].double()


def test_the_config_reads_gemma3s_layers(gemma_dir):
    cfg = ModelConfig.from_dir(gemma_dir)
    assert cfg.is_gemma3 and cfg.qk_norm and cfg.norm_plus_one and cfg.sandwich_norms
    assert (cfg.layer_window(0), cfg.layer_window(1)) == (8, None)
    assert (cfg.layer_rope_theta(0), cfg.layer_rope_theta(1)) == (1e4, 1e6)
    assert cfg.attention_scale == 24**-0.5
    assert cfg.embed_scale == float(np.float32(64**0.5))


@pytest.mark.parametrize("engine", ["torch", "auto"])
def test_both_engines_give_transformers_logits(gemma_dir, engine):
    if engine == "auto" and not OK:
        pytest.skip(WHY)
    r = runner(gemma_dir, engine)
    assert r.engine == ("torch" if engine == "torch" else "cpu")
    ours = prefill_logits(r, LONG).logits.double()
    ref = hf_logits(gemma_dir, LONG)
    assert (ours - ref).abs().max() <= 2e-5 * ref.abs().max()


def test_the_torch_engines_decode_rows_see_the_window(gemma_dir):
    """Decode steps past the window attend to its last 8 positions only (torch_native's
    window mask), as a prefill of the whole prompt does."""
    from specserve.runtime.forward_batch import ForwardBatch, ForwardMode

    r = runner(gemma_dir, "torch")
    full = prefill_logits(r, LONG).logits
    prefill_logits(r, LONG[:20])
    for i in range(20, len(LONG)):
        b = ForwardBatch.build(ForwardMode.DECODE, [[LONG[i]]], [torch.arange(1, i + 2)], [i])
        assert torch.allclose(r.forward(b).logits[0], full[i], rtol=1e-5, atol=1e-5)


@pytest.mark.skipif(not OK, reason=f"CPU extension unavailable: {WHY}")
@pytest.mark.parametrize("fmt", ["auto", "q8_0"])
@pytest.mark.parametrize("isa", ["avx512", "avx2", "generic"])
def test_a_tokens_logits_are_the_same_in_every_kind_of_forward(gemma_dir, monkeypatch, fmt, isa):
    if isa not in isas():
        pytest.skip(f"this CPU has no {isa}")
    monkeypatch.setenv("SPECSERVE_CPU_ISA", isa)
    r = runner(gemma_dir, fmt)
    assert r.model.isa == isa
    every_kind_of_forward(r)
