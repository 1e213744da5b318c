"""MTP modules inside a checkpoint: a synthetic Qwen2 checkpoint with MiMo's `model.mtp_layers.0`
(and one with DeepSeek-style `model.layers.{N}` + `eh_proj`) loads into the EAGLE-style worker,
computes what the layout's reference does (checked against Hugging Face's Qwen2 decoder layer),
drafts, and is lossless, greedy and seeded, with drafts accepted (the module steered toward the
known continuation, as the EAGLE tests steer their heads); a checkpoint without MTP layers
fails with a clear message."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import torch
from safetensors.torch import load_file, save_file

from specserve.runtime.errors import ModelLoadError
from specserve.runtime.forward_batch import ForwardBatch, ForwardMode
from specserve.runtime.model_runner.local_generator import LocalGenerator
from specserve.runtime.model_runner.model_runner import ModelRunner, RunnerConfig
from specserve.runtime.model_runner.runner_process import RunnerWorker
from specserve.runtime.sampling.sampling_params import SamplingParams
from specserve.speculative.base import SpecConfig, create_drafter
from specserve.speculative.drafters.eagle import MtpDrafter
from specserve.speculative.models.mtp_head import load_mtp_head
from specserve.speculative.worker import SpeculativeWorker
from tests.helpers.tiny_models import write_tiny_model
from tests.integration.test_spec_lossless import copy_heavy_prompts
from tests.unit.test_eagle_worker import Steered, hints_of
from tests.unit.test_scheduler import Harness


class SteeredMtp(Steered, MtpDrafter):
    pass


def add_mtp(model_dir: Path, layout: str, seed: int = 9) -> dict[str, torch.Tensor]:
    """Add one MTP module in `layout` ("mimo" | "deepseek") to the checkpoint; returns its
    tensors by their suffix."""
    cfg = json.loads((model_dir / "config.json").read_text())
    h, inter = cfg["hidden_size"], cfg["intermediate_size"]
    heads, kv = cfg["num_attention_heads"], cfg["num_key_value_heads"]
    hd = h // heads
    g = torch.Generator().manual_seed(seed)

    def rnd(*shape, scale=0.1):
        return (scale * torch.randn(*shape, generator=g)).contiguous()

    def norm():
        return (1.0 + 0.1 * torch.randn(h, generator=g)).contiguous()

    block = {
        "input_layernorm.weight": norm(), "post_attention_layernorm.weight": norm(),
        "self_attn.q_proj.weight": rnd(heads * hd, h), "self_attn.q_proj.bias": rnd(heads * hd),
        "self_attn.k_proj.weight": rnd(kv * hd, h), "self_attn.k_proj.bias": rnd(kv * hd),
        "self_attn.v_proj.weight": rnd(kv * hd, h), "self_attn.v_proj.bias": rnd(kv * hd),
        "self_attn.o_proj.weight": rnd(h, heads * hd),
        "mlp.gate_proj.weight": rnd(inter, h), "mlp.up_proj.weight": rnd(inter, h),
        "mlp.down_proj.weight": rnd(h, inter),
    }
    if layout == "mimo":
        prefix = "model.mtp_layers.0."
        own = {"token_layernorm.weight": norm(), "hidden_layernorm.weight": norm(),
               "input_proj.weight": rnd(h, 2 * h), "final_layernorm.weight": norm()}
    else:
        prefix = f"model.layers.{cfg['num_hidden_layers']}."
        own = {"enorm.weight": norm(), "hnorm.weight": norm(), "eh_proj.weight": rnd(h, 2 * h),
               "shared_head.norm.weight": norm()}
    tensors = {**block, **own}
    file = next(model_dir.glob("*.safetensors"))
    state = load_file(str(file))
    state.update({prefix + k: v for k, v in tensors.items()})
    save_file(state, str(file), metadata={"format": "pt"})
    return tensors


@pytest.fixture(scope="module", params=["mimo", "deepseek"])
def mtp_model(request, tmp_path_factory):
    d = write_tiny_model(tmp_path_factory.mktemp(f"mtp_{request.param}") / "m", "qwen2", seed=4)
    tensors = add_mtp(d, request.param)
    runner = ModelRunner(RunnerConfig(str(d), "cpu", "float32", max_total_tokens=4096))
    return request.param, d, tensors, runner


def reference_mtp(layout, tensors, model_dir, runner, ids, hidden):
    """The layout's MTP module in plain torch with Hugging Face's Qwen2 decoder layer."""
    from transformers import AutoConfig
    from transformers.models.qwen2.modeling_qwen2 import (
        Qwen2DecoderLayer,
        Qwen2RMSNorm,
        Qwen2RotaryEmbedding,
    )

    cfg = AutoConfig.from_pretrained(model_dir)
    layer = Qwen2DecoderLayer(cfg, 0).eval()
    layer.load_state_dict({k: v for k, v in tensors.items()
                           if k.split(".")[0] in ("self_attn", "mlp", "input_layernorm",
                                                  "post_attention_layernorm")})

    def rms(w):
        n = Qwen2RMSNorm(cfg.hidden_size, cfg.rms_norm_eps)
        n.weight.data.copy_(w)
        return n

    names = (("token_layernorm", "hidden_layernorm", "input_proj", "final_layernorm")
             if layout == "mimo" else ("enorm", "hnorm", "eh_proj", "shared_head.norm"))
    e = rms(tensors[f"{names[0]}.weight"])(runner.model.embed(torch.tensor(ids)))
    h = rms(tensors[f"{names[1]}.weight"])(hidden)
    x = torch.cat((h, e) if layout == "mimo" else (e, h), -1) @ tensors[f"{names[2]}.weight"].T
    t = len(ids)
    pos = torch.arange(t)[None]
    rope = Qwen2RotaryEmbedding(cfg)
    mask = torch.full((t, t), float("-inf")).triu(1)[None, None]
    with torch.no_grad():
        out = layer(x[None], attention_mask=mask, position_ids=pos,
                    position_embeddings=rope(x[None], pos))
        out = out[0] if isinstance(out, tuple) else out
        return runner.model.compute_logits(rms(tensors[f"{names[3]}.weight"])(out[0]))


def test_the_module_computes_what_its_layout_defines(mtp_model):
    layout, d, tensors, runner = mtp_model
    head = load_mtp_head(d, runner.model_config, runner.model, kv_capacity=512)
    ids = [5, 9, 13, 2, 40, 41]
    hidden = torch.randn(len(ids), runner.model_config.hidden_size)
    batch = ForwardBatch.build(ForwardMode.EXTEND, [ids], [torch.arange(1, len(ids) + 1)], [0])
    batch.logits_indices = torch.arange(len(ids))
    got = head(batch, head.create_backend(), hidden).logits
    ref = reference_mtp(layout, tensors, d, runner, ids, hidden)
    assert (got - ref).abs().max().item() < 1e-3


def test_a_checkpoint_without_mtp_layers_fails_clearly(tmp_path):
    d = write_tiny_model(tmp_path / "plain", "qwen2", seed=1)
    runner = ModelRunner(RunnerConfig(str(d), "cpu", "float32", max_total_tokens=256))
    with pytest.raises(ModelLoadError, match="no MTP layers"):
        create_drafter(SpecConfig("MTP", 3, num_steps=2, eagle_topk=1), runner)


@pytest.mark.parametrize("params", [{"temperature": 0.0},
                                    {"temperature": 0.8, "top_p": 0.9, "seed": 0}],
                         ids=["greedy", "seeded"])
@pytest.mark.parametrize("concurrency", [1, 8])
def test_mtp_equals_plain_with_drafts_accepted(mtp_model, concurrency, params):
    _, d, _, runner = mtp_model
    prompts = copy_heavy_prompts(24, seed=40 + concurrency)
    gen = LocalGenerator(runner)
    sps = [SamplingParams(max_new_tokens=16, ignore_eos=True,
                          **{**params, **({"seed": 100 + i} if "seed" in params else {})})
           for i in range(len(prompts))]
    ref = [r.output_ids for r in gen.generate(prompts, sps)]
    cfg = SpecConfig("MTP", 4, num_steps=2, eagle_topk=2, disable_adaptive=True)
    drafter = SteeredMtp(cfg, runner)
    drafter.hints = hints_of(prompts, ref)
    h = Harness((d, runner), num_draft_tokens=4, max_running_requests=concurrency)
    h.worker = RunnerWorker(runner, SpeculativeWorker(cfg, drafter, runner))
    for i, (p, sp) in enumerate(zip(prompts, sps)):
        h.submit(f"r{i}", p, **sp.to_dict())
    h.run()
    assert [h.outputs[f"r{i}"] for i in range(len(prompts))] == ref
    info = h.sched.info()
    # steered drafts land: a decisive share of the drafts, not a handful
    assert info["spec_decode_num_accepted_tokens"] > 0.3 * info["spec_decode_num_draft_tokens"]
    assert info["avg_spec_accept_length"] > 1.5, info["avg_spec_accept_length"]
    h.sched.check_no_leak()
