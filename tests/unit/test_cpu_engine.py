"""The CPU engine end to end (specserve/runtime/models/cpu_llama.py over specserve/kernels/cpu): the
same logits as the torch reference engine on the same weights (a quantized GGUF's blocks against
their dequantized float32 copy; every architecture's HF checkpoint), and a token's logits
bit-identical whether it is prefilled, decoded, verified inside a draft tree, or batched with other
requests."""

from __future__ import annotations

import numpy as np
import pytest
import torch

from specserve.kernels import cpu
from specserve.runtime.forward_batch import ForwardBatch, ForwardMode
from specserve.runtime.model_loader.gguf_convert import convert_gguf
from specserve.runtime.model_runner import model_runner as mr
from specserve.runtime.model_runner.model_runner import ModelRunner, RunnerConfig
from tests.helpers.tiny_models import write_tiny_gguf, write_tiny_model

OK, WHY = cpu.available()
pytestmark = pytest.mark.skipif(not OK, reason=f"CPU extension unavailable: {WHY}")


@pytest.fixture(scope="module")
def gguf_dirs(tmp_path_factory):
    """Converted tiny GGUFs: Q4_1 linears + Q8_0 embedding (untied), and a tied Q8_0 one."""
    root = tmp_path_factory.mktemp("cpu_engine")
    out = {}
    for name, kw in {"q4_1": dict(linear_type="Q4_1", embed_type="Q8_0"),
                     "tied_q8": dict(linear_type="Q8_0", embed_type="Q8_0",
                                     tie_word_embeddings=True)}.items():
        path = root / f"{name}.gguf"
        write_tiny_gguf(path, seed=5, **kw)
        out[name] = str(convert_gguf(path, root / name, progress=False))
    return out


def runner(model_dir, fmt="auto", digits=3, **kw):
    return ModelRunner(RunnerConfig(model_dir, "cpu", "float32", max_total_tokens=2048,
                                    weight_format=fmt, activation_digits=digits, **kw))


def prefill_logits(r, ids, **kw):
    slots = torch.arange(1, len(ids) + 1)
    return r.forward(ForwardBatch.build(ForwardMode.EXTEND, [ids], [slots], [0], logits="all",
                                        **kw))


PROMPT = [5, 17, 99, 3, 250, 61, 7, 7, 180, 33, 2, 90, 45, 118, 4, 300, 12]


@pytest.mark.parametrize("name", ["q4_1", "tied_q8"])
def test_gguf_blocks_give_the_torch_engines_logits(gguf_dirs, name):
    fast, ref = runner(gguf_dirs[name]), runner(gguf_dirs[name], "torch")
    assert fast.engine == "cpu" and ref.engine == "torch"
    a, b = prefill_logits(fast, PROMPT).logits, prefill_logits(ref, PROMPT).logits
    # same weights, different summation order (and activations rounded to ~22 bits)
    assert (a - b).abs().max() <= 1e-4 * b.abs().max()
    assert torch.equal(a.argmax(-1), b.argmax(-1))


def test_captured_and_final_hidden_states_match_the_torch_engine(gguf_dirs):
    fast, ref = runner(gguf_dirs["q4_1"]), runner(gguf_dirs["q4_1"], "torch")
    kw = dict(capture_layers=(0, 1, 2))
    slots = torch.arange(1, len(PROMPT) + 1)
    outs = [r.forward(ForwardBatch.build(ForwardMode.EXTEND, [PROMPT], [slots], [0], **kw),
                      return_final_hidden=True) for r in (fast, ref)]
    for layer in (0, 1, 2):
        a, b = outs[0].captured[layer], outs[1].captured[layer]
        assert torch.allclose(a, b, rtol=1e-4, atol=1e-4 * b.abs().max().item())
    assert torch.allclose(outs[0].final_hidden, outs[1].final_hidden, rtol=1e-4, atol=1e-4)
    assert torch.equal(fast.model.compute_logits(outs[0].final_hidden[-1:]), outs[0].logits)


@pytest.mark.parametrize("digits", [1, 3])
def test_a_tokens_logits_are_the_same_in_every_kind_of_forward(gguf_dirs, digits):
    every_kind_of_forward(runner(gguf_dirs["q4_1"], digits=digits))


def test_fp16_kv_keeps_every_forward_exact_and_stays_close_to_fp32_kv(gguf_dirs):
    """--kv-cache-dtype float16: the KV written once as half and read back by every row, so a
    token's logits are still the same in prefill, chunked prefill, decode and a tree; they
    differ from the float32 cache's by the rounding of K / V only."""
    half = runner(gguf_dirs["q4_1"], kv_cache_dtype="float16")
    assert half.kv_pool.dtype == torch.float16
    full16 = every_kind_of_forward(half)
    full32 = prefill_logits(runner(gguf_dirs["q4_1"]), PROMPT).logits
    assert not torch.equal(full16, full32)  # the cache really is half
    assert (full16 - full32).abs().max() <= 2e-2 * full32.abs().max()
    assert torch.equal(full16.argmax(-1), full32.argmax(-1))


def test_kv_cache_dtype_is_checked():
    from specserve.runtime.model_runner.model_runner import resolve_kv_dtype

    assert resolve_kv_dtype("auto", "cpu", torch.float32) == torch.float32
    assert resolve_kv_dtype("float16", "cpu", torch.float32) == torch.float16
    assert resolve_kv_dtype("float16", "torch", torch.float16) == torch.float16
    with pytest.raises(ValueError, match="for the CPU engine"):
        resolve_kv_dtype("float16", "torch", torch.float32)
    with pytest.raises(ValueError, match="auto, float32 or float16"):
        resolve_kv_dtype("fp8", "cpu", torch.float32)


def every_kind_of_forward(r) -> torch.Tensor:
    """A prompt's logits by prefill, chunked prefill, decode steps and a draft tree's
    verify rows are the same bits; returns the prefill's [n, V]."""
    n = len(PROMPT)
    full = prefill_logits(r, PROMPT).logits  # [n, V]
    # prefill in chunks of 5
    rows, done = [], 0
    while done < n:
        c = min(5, n - done)
        b = ForwardBatch.build(ForwardMode.EXTEND, [PROMPT[done:done + c]],
                               [torch.arange(1, done + c + 1)], [done], logits="all")
        rows.append(r.forward(b).logits)
        done += c
    assert torch.equal(torch.cat(rows), full)
    # decode steps after a 6-token prefill
    prefill_logits(r, PROMPT[:6])
    for i in range(6, n):
        b = ForwardBatch.build(ForwardMode.DECODE, [[PROMPT[i]]], [torch.arange(1, i + 2)], [i])
        assert torch.equal(r.forward(b).logits[0], full[i]), f"decode step {i}"
    # a draft tree whose first branch is the true continuation: its rows are decode rows
    prefix, tokens = 8, [PROMPT[8], PROMPT[9], 77, PROMPT[10], 140, PROMPT[11]]
    parents = [-1, 0, 0, 1, 1, 3]
    mask = torch.eye(6, dtype=torch.bool)
    for i in range(1, 6):
        mask[i] |= mask[parents[i]]
    depth = mask.sum(1) - 1
    prefill_logits(r, PROMPT[:prefix])
    b = ForwardBatch.build(ForwardMode.TARGET_VERIFY, [tokens],
                           [torch.arange(1, prefix + 7)], [prefix],
                           positions=[prefix + depth], custom_masks=[mask], logits="all")
    tree = r.forward(b).logits
    for node, pos in ((0, 8), (1, 9), (3, 10), (5, 11)):  # the path that copies the prompt
        assert torch.equal(tree[node], full[pos]), f"node {node}"
    return full


def batched_and_alone(r) -> tuple[torch.Tensor, torch.Tensor]:
    """Three prompts' logits prefilled together and one at a time, on runner `r`."""
    prompts = [PROMPT, PROMPT[3:9], [9, 8, 7, 6, 5, 4, 3, 2, 1, 10, 20, 30]]
    alone = [prefill_logits(r, p).logits for p in prompts]
    start, slots = 1, []
    for p in prompts:
        slots.append(torch.arange(start, start + len(p)))
        start += len(p)
    b = ForwardBatch.build(ForwardMode.EXTEND, prompts, slots, [0, 0, 0], logits="all")
    return r.forward(b).logits, torch.cat(alone)


def test_a_request_batched_with_others_gets_its_single_logits(gguf_dirs):
    batched, alone = batched_and_alone(runner(gguf_dirs["q4_1"]))
    assert torch.equal(batched, alone)


def test_the_batch_check_catches_a_one_ulp_difference(gguf_dirs, monkeypatch):
    """The negative control of batch invariance: an engine whose batched rows differ from the
    rows alone by one unit in the last place of one logit fails the check above."""
    r = runner(gguf_dirs["q4_1"])
    real = r.forward

    def off_by_one_ulp(batch, *args, **kwargs):
        out = real(batch, *args, **kwargs)
        if batch.batch_size > 1:
            logits = out.logits.clone()  # the engine's are inference tensors
            logits[0, 7] = torch.nextafter(logits[0, 7], torch.tensor(float("inf")))
            return out._replace(logits=logits)
        return out

    monkeypatch.setattr(r, "forward", off_by_one_ulp)
    batched, alone = batched_and_alone(r)
    assert not torch.equal(batched, alone)


@pytest.mark.parametrize("threads", [1, 2])
def test_a_forwards_argmax_is_numpys_argmax_of_its_logits(gguf_dirs, threads):
    """The argmax the engine returns beside the logits (found per thread while the rows are in
    its cache) is the first maximum of each row: what greedy decoding and verification take."""
    r = runner(gguf_dirs["tied_q8"], num_threads=threads)
    outs = [prefill_logits(r, PROMPT), prefill_logits(r, PROMPT[:9])]
    b = ForwardBatch.build(ForwardMode.DECODE, [[PROMPT[9]]], [torch.arange(1, 11)], [9])
    outs.append(r.forward(b))
    for out in outs:
        assert out.argmax is not None and out.argmax.dtype == torch.int64
        assert torch.equal(out.argmax, torch.from_numpy(out.logits.numpy().argmax(-1)))


@pytest.mark.parametrize("arch", ["llama", "mistral", "qwen2", "qwen3"])
def test_hf_checkpoints_of_every_architecture_match_the_torch_engine(tmp_path, arch):
    d = str(write_tiny_model(tmp_path / arch, arch, seed=3))
    fast, ref = runner(d), runner(d, "torch")
    assert fast.model.packed.formats == {"f32": 4 * 2 + 1 + 1}  # float32 checkpoint kept
    a, b = prefill_logits(fast, PROMPT).logits, prefill_logits(ref, PROMPT).logits
    assert torch.allclose(a, b, rtol=1e-5, atol=1e-5 * b.abs().max().item())


@pytest.mark.parametrize("fmt,tol", [("bf16", 3e-2), ("f16", 3e-3), ("q8_0", 3e-2),
                                     ("q4_1", 3e-1)])
def test_weight_format_conversions_stay_close_to_float32(tmp_path, fmt, tol):
    d = str(write_tiny_model(tmp_path / "m", "llama", seed=4))
    fast, ref = runner(d, fmt), runner(d, "torch")
    assert set(fast.model.packed.formats) == {fmt}
    a, b = prefill_logits(fast, PROMPT).logits, prefill_logits(ref, PROMPT).logits
    assert (a - b).abs().max() <= tol * b.abs().max()


def test_bf16_checkpoints_stay_bf16(tmp_path):
    from safetensors.torch import load_file, save_file

    d = write_tiny_model(tmp_path / "m", "llama", seed=6)
    st = load_file(str(d / "model.safetensors"))
    save_file({k: v.to(torch.bfloat16) for k, v in st.items()}, str(d / "model.safetensors"),
              metadata={"format": "pt"})
    fast = runner(str(d))
    assert set(fast.model.packed.formats) == {"bf16"}
    ref = runner(str(d), "torch")
    a, b = prefill_logits(fast, PROMPT).logits, prefill_logits(ref, PROMPT).logits
    assert (a - b).abs().max() <= 1e-4 * b.abs().max()


def test_without_the_extension_auto_fails_unless_allowed_and_explicit_formats_fail(
        monkeypatch, caplog):
    monkeypatch.setattr(cpu, "available", lambda: (False, "no compiler"))
    monkeypatch.delenv(cpu.ALLOW_NO_CPU_EXT, raising=False)
    with pytest.raises(cpu.CpuExtensionUnavailable, match="no compiler.*ALLOW_NO_CPU_EXT=1"):
        mr.resolve_engine("auto", torch.device("cpu"))
    assert mr.resolve_engine("torch", torch.device("cpu")) == "torch"  # asked for: no extension
    monkeypatch.setenv(cpu.ALLOW_NO_CPU_EXT, "1")
    assert mr.resolve_engine("auto", torch.device("cpu")) == "torch"
    assert "CPU engine unavailable (no compiler)" in caplog.text
    with pytest.raises(ValueError, match="q4_1 needs the CPU extension: no compiler"):
        mr.resolve_engine("q4_1", torch.device("cpu"))
    with pytest.raises(ValueError, match="must be one of"):
        mr.resolve_engine("q3_k", torch.device("cpu"))


def test_dense_views_for_heads_and_trainers(gguf_dirs):
    from safetensors.torch import load_file

    fast, ref = runner(gguf_dirs["q4_1"]), runner(gguf_dirs["q4_1"], "torch")
    dense = load_file(f"{gguf_dirs['q4_1']}/model.safetensors")  # the dequantized copy
    assert torch.equal(fast.model.embed_tokens, dense["model.embed_tokens.weight"])
    assert torch.equal(fast.model.lm_head.weight, dense["lm_head.weight"])
    ids = torch.tensor([3, 9, 27])
    assert torch.equal(fast.model.embed(ids), ref.model.embed(ids))
    h = torch.randn(2, 64)
    assert torch.allclose(fast.model.compute_logits(h), ref.model.compute_logits(h), atol=1e-4)
    assert torch.allclose(fast.model.norm(h), ref.model.norm(h), atol=1e-6)
    assert np.isfinite(fast.model.norm.weight.numpy()).all()


def test_a_bad_batch_raises_instead_of_writing_outside_the_kv_pool(gguf_dirs):
    r = runner(gguf_dirs["q4_1"])
    capacity = r.kv_capacity
    bad = ForwardBatch.build(ForwardMode.EXTEND, [[5, 6]], [torch.tensor([1, capacity + 7])], [0])
    with pytest.raises(RuntimeError, match="KV slot out of range"):
        r.forward(bad)
    ok = prefill_logits(r, PROMPT).logits  # the engine is still fine afterwards
    assert torch.isfinite(ok).all()


@pytest.mark.parametrize("engine", ["auto", "torch"])
def test_a_layer_range_forward_resumes_where_an_early_exit_stopped(gguf_dirs, engine):
    """Early exit at layer E, then layers [E, L) from the captured hidden state: the logits are
    the full forward's (bit for bit on the CPU engine, whose layers are batch-invariant)."""
    full = prefill_logits(runner(gguf_dirs["q4_1"], engine), PROMPT).logits
    r = runner(gguf_dirs["q4_1"], engine)
    n_layers = r.model_config.num_hidden_layers
    for exit_at in range(1, n_layers):
        r = runner(gguf_dirs["q4_1"], engine)
        slots = torch.arange(1, len(PROMPT) + 1)
        first = r.forward(ForwardBatch.build(ForwardMode.EXTEND, [PROMPT], [slots], [0],
                                             logits="all", capture_layers=(exit_at,)),
                          layers=(0, exit_at))
        assert first.logits.shape == full.shape  # the early exit's own (draft) logits
        rest = r.forward(ForwardBatch.build(ForwardMode.EXTEND, [PROMPT], [slots], [0],
                                            logits="all"),
                         layers=(exit_at, -1), hidden_in=first.captured[exit_at])
        if r.engine == "cpu":
            assert torch.equal(rest.logits, full)
        else:
            assert torch.allclose(rest.logits, full, atol=1e-5, rtol=1e-5)


@pytest.mark.parametrize("threads", [1, 2])
def test_a_forwards_logit_stats_are_its_logits_and_the_same_for_every_kind_of_forward(
        gguf_dirs, threads):
    """With logit_top >= 0 a forward returns each logits row's log-sum-exp and top entries
    (logprobs without reading the rows again): those of its logits, and for a token the same
    bits whether it was prefilled or decoded, as its logits are."""
    r = runner(gguf_dirs["q4_1"], num_threads=threads)
    assert prefill_logits(r, PROMPT).logit_stats is None  # nobody asked
    full = prefill_logits(r, PROMPT, logit_top=4)
    st = full.logit_stats
    _, lse, vals, ids = cpu.load().logit_stats(full.logits, 4, threads, r.model.isa)
    assert torch.equal(st.lse, lse) and torch.equal(st.top_vals, vals)
    assert torch.equal(st.top_ids, ids)
    assert torch.allclose(st.lse.double(), torch.logsumexp(full.logits.double(), -1),
                          rtol=1e-6)
    prefill_logits(r, PROMPT[:6])
    for i in range(6, len(PROMPT)):
        b = ForwardBatch.build(ForwardMode.DECODE, [[PROMPT[i]]], [torch.arange(1, i + 2)], [i])
        b.logit_top = 2
        dec = r.forward(b).logit_stats
        assert torch.equal(dec.lse[0], st.lse[i]), f"decode step {i}"
        assert torch.equal(dec.top_ids[0], st.top_ids[i, :2])


# a K-quant file's mix, as llama.cpp's Q4_K_M makes it for Gemma 3 (K = 256-multiples only)
KQUANT_MIX = {"q_proj": "Q5_0", "k_proj": "Q5_0", "v_proj": "Q8_0", "o_proj": "Q4_K",
              "gate_proj": "Q5_0", "up_proj": "Q5_0", "down_proj": "Q6_K"}


def test_k_quant_and_5_bit_blocks_are_kept_and_give_the_torch_engines_logits(tmp_path):
    """`--weight-format auto` runs a K-quant file's own blocks: Q4_K and Q6_K, Q5_0 (gate / up),
    and q / k / v of Q5_0 and Q8_0 fused exactly as Q8_0; the logits are the torch engine's on
    the dequantized weights, and a token's are the same in every kind of forward."""
    path = tmp_path / "kq.gguf"
    write_tiny_gguf(path, seed=8, linear_type=KQUANT_MIX, embed_type="Q8_0",
                    tie_word_embeddings=True, hidden=256, inter=512)
    d = str(convert_gguf(path, tmp_path / "kq", progress=False))
    fast, ref = runner(d), runner(d, "torch")
    assert fast.model.packed.formats == {"q8_0": 2 + 1, "q4_k": 2, "q5_0": 2, "q6_k": 2}
    a, b = prefill_logits(fast, PROMPT).logits, prefill_logits(ref, PROMPT).logits
    assert (a - b).abs().max() <= 1e-4 * b.abs().max()
    every_kind_of_forward(fast)
