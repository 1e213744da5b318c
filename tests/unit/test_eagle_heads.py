"""EAGLE-1/2 and EAGLE-3 draft heads: public checkpoint formats, the head's own KV cache (extend
then decode, tree masks), and logits against an independent plain-torch reference."""

from __future__ import annotations

import json

import pytest
import torch
from safetensors.torch import load_file, save_file

from specserve.runtime.errors import ModelLoadError
from specserve.runtime.forward_batch import ForwardBatch, ForwardMode
from specserve.runtime.layers.linear import onednn_bf16_available
from specserve.runtime.model_runner.model_runner import ModelRunner, RunnerConfig
from specserve.speculative.models import Eagle3Head, EagleHead, load_draft_head, save_eagle3_head
from tests.helpers.eagle_checkpoints import (
    read_checkpoint,
    target_tensors,
    write_eagle1_checkpoint,
    write_eagle3_checkpoint,
)
from tests.helpers.eagle_reference import reference_head
from tests.helpers.tiny_models import write_tiny_model

TARGET_LAYERS = 8  # EAGLE-3's default capture layers are then (2, 4, 5)


@pytest.fixture(scope="module")
def target_dir(tmp_path_factory):
    root = tmp_path_factory.mktemp("eagle_target")
    return write_tiny_model(root / "target", "llama", seed=5, num_hidden_layers=TARGET_LAYERS)


@pytest.fixture(scope="module")
def runner(target_dir):
    return ModelRunner(RunnerConfig(str(target_dir), "cpu", "float32", max_total_tokens=256))


def load(path, runner, **kwargs):
    return load_draft_head(path, runner.model_config, runner.model, kv_capacity=256, **kwargs)


def run(head, backend, mode, tokens, slots, prefix_lens, hidden, fused=True, **build):
    batch = ForwardBatch.build(mode, tokens, slots, prefix_lens, **build)
    if isinstance(head, Eagle3Head):
        return head(batch, backend, hidden, hidden_is_fused=fused)
    return head(batch, backend, hidden)


def head_inputs(runner, head, ids):
    """EAGLE rows from a target prefill of `ids`: row t = (token t+1, target hidden t)."""
    batch = ForwardBatch.build(ForwardMode.EXTEND, [ids], [torch.arange(1, len(ids) + 1)], [0],
                               capture_layers=head.capture_layers)
    out = runner.forward(batch, return_final_hidden=head.needs_final_hidden)
    return ids[1:], head.target_hidden(out)[:-1]


def hf_hidden_states(target_dir, ids):
    from transformers import AutoModelForCausalLM

    hf = AutoModelForCausalLM.from_pretrained(target_dir, torch_dtype=torch.float32).eval()
    with torch.no_grad():  # [i] enters layer i; the last one is after the final norm
        return [h[0] for h in hf(torch.tensor([ids]), output_hidden_states=True).hidden_states]


IDS = torch.randint(3, 300, (24,), generator=torch.Generator().manual_seed(11)).tolist()


@pytest.mark.parametrize("fmt,options", [
    ("bin", {}),
    ("safetensors", {"input_layernorm": True, "embed": "random", "key_prefix": "model."}),
    ("bin", {"fc_bias": False, "embed": "target"}),
    ("safetensors", {"norm_before_lm_head": True}),
])
def test_eagle1_logits_match_reference_with_embed_first_concat_and_target_lm_head(
    tmp_path, target_dir, runner, fmt, options,
):
    options = dict(options)
    norm = options.pop("norm_before_lm_head", False)
    ckpt = write_eagle1_checkpoint(tmp_path / "e1", target_dir, fmt=fmt, seed=1, **options)
    head = load(ckpt, runner, norm_before_lm_head=norm)
    assert isinstance(head, EagleHead)
    assert (head.embed_weight is not None) == (options.get("embed") == "random")
    tokens, hidden = head_inputs(runner, head, IDS)
    out = run(head, head.create_backend(), ForwardMode.DRAFT_EXTEND, [tokens],
              [torch.arange(1, len(tokens) + 1)], [0], hidden, logits="all")
    # the reference gets the target's final (normed) hidden state from HF transformers
    ref_hidden = hf_hidden_states(target_dir, IDS)[-1][:-1]
    ref_logits, ref_out = reference_head(
        "eagle", read_checkpoint(ckpt), json.loads((ckpt / "config.json").read_text()),
        target_tensors(target_dir), tokens, [ref_hidden[t] for t in range(len(tokens))],
        norm_before_lm_head=norm,
    )
    torch.testing.assert_close(out.hidden, ref_out, atol=1e-4, rtol=1e-4)
    torch.testing.assert_close(out.logits, ref_logits, atol=1e-4, rtol=1e-4)


@pytest.mark.parametrize("aux_ids,capture", [(None, (2, 4, 5)), ([0, 3, 6], (1, 4, 7))])
def test_eagle3_logits_match_reference_with_fused_capture_layers_then_own_hidden(
    tmp_path, target_dir, runner, aux_ids, capture,
):
    ckpt = write_eagle3_checkpoint(tmp_path / "e3", target_dir, seed=2, aux_layer_ids=aux_ids,
                                   key_prefix="model.")
    head = load(ckpt, runner)
    assert isinstance(head, Eagle3Head) and head.capture_layers == capture
    tokens, fused = head_inputs(runner, head, IDS)
    n = len(tokens)
    backend = head.create_backend()
    slots = torch.arange(1, n + 3)
    first = run(head, backend, ForwardMode.DRAFT_EXTEND, [tokens], [slots[:n]], [0], fused,
                logits="all")
    # two draft steps on the head's own (pre-norm) output, as a chain
    step1 = run(head, backend, ForwardMode.DECODE, [[17]], [slots[: n + 1]], [n],
                first.hidden[-1:], fused=False)
    step2 = run(head, backend, ForwardMode.DECODE, [[29]], [slots[: n + 2]], [n + 1],
                step1.hidden, fused=False)
    hs = hf_hidden_states(target_dir, IDS)
    ref_fused = torch.cat([hs[i] for i in capture], dim=-1)[:-1]  # [n, 3H]
    ref_logits, ref_out = reference_head(
        "eagle3", read_checkpoint(ckpt), json.loads((ckpt / "config.json").read_text()),
        target_tensors(target_dir), tokens + [17, 29],
        [ref_fused[t] for t in range(n)] + [None, None],  # None: previous row's output
    )
    torch.testing.assert_close(first.logits, ref_logits[:n], atol=1e-4, rtol=1e-4)
    torch.testing.assert_close(step1.logits[0], ref_logits[n], atol=1e-4, rtol=1e-4)
    torch.testing.assert_close(step2.logits[0], ref_logits[n + 1], atol=1e-4, rtol=1e-4)
    torch.testing.assert_close(step2.hidden[0], ref_out[n + 1], atol=1e-4, rtol=1e-4)


def make_head(kind, tmp_path, target_dir, runner):
    if kind == "eagle":
        return load(write_eagle1_checkpoint(tmp_path / "e1", target_dir, seed=3), runner)
    return load(write_eagle3_checkpoint(tmp_path / "e3", target_dir, seed=4), runner)


def random_rows(head, n, gen, fused=True):
    """n random rows: tokens and hidden inputs ([n, 3H] fused for EAGLE-3, else [n, H])."""
    eagle3_fused = isinstance(head, Eagle3Head) and fused
    width = head.fc.in_features if eagle3_fused else head.config.hidden_size
    return torch.randint(3, 300, (n,), generator=gen).tolist(), torch.randn(n, width, generator=gen)


@pytest.mark.parametrize("kind,fused", [("eagle", True), ("eagle3", True), ("eagle3", False)])
def test_extend_then_decode_over_head_kv_equals_one_extend(tmp_path, target_dir, runner, kind,
                                                           fused):
    head = make_head(kind, tmp_path, target_dir, runner)
    backend = head.create_backend()
    gen = torch.Generator().manual_seed(6)
    lens, split = [70, 9], [60, 2]  # 70 > the checkpoint's max_position_embeddings (64)
    rows = [random_rows(head, n, gen, fused) for n in lens]
    full_slots = [torch.arange(1, n + 1) + 100 * b for b, n in enumerate(lens)]
    full = run(head, backend, ForwardMode.EXTEND, [t for t, _ in rows], full_slots, [0, 0],
               torch.cat([h for _, h in rows]), fused)
    slots = [s + 50 for s in full_slots]  # fresh slots of the same pool
    run(head, backend, ForwardMode.DRAFT_EXTEND, [t[:k] for (t, _), k in zip(rows, split)],
        [s[:k] for s, k in zip(slots, split)], [0, 0],
        torch.cat([h[:k] for (_, h), k in zip(rows, split)]), fused)
    pos = list(split)
    while any(p < n for p, n in zip(pos, lens)):
        live = [b for b in range(2) if pos[b] < lens[b]]
        out = run(head, backend, ForwardMode.DECODE, [[rows[b][0][pos[b]]] for b in live],
                  [slots[b][: pos[b] + 1] for b in live], [pos[b] for b in live],
                  torch.stack([rows[b][1][pos[b]] for b in live]), fused)
        for i, b in enumerate(live):
            pos[b] += 1
            if pos[b] == lens[b]:
                torch.testing.assert_close(out.logits[i], full.logits[b], atol=1e-4, rtol=1e-4)
                end = sum(lens[: b + 1]) - 1
                torch.testing.assert_close(out.hidden[i], full.hidden[end], atol=1e-4, rtol=1e-4)


@pytest.mark.parametrize("kind", ["eagle", "eagle3"])
def test_tree_mask_gives_each_node_the_output_of_its_path_run_causally(tmp_path, target_dir,
                                                                        runner, kind):
    head = make_head(kind, tmp_path, target_dir, runner)
    backend = head.create_backend()
    gen = torch.Generator().manual_seed(8)
    prefix_tokens, prefix_hidden = random_rows(head, 12, gen)
    parents = [-1, 0, 0, 1, 1, 2, 3]
    mask = torch.zeros(7, 7, dtype=torch.bool)
    for i in range(7):
        j = i
        while j != -1:
            mask[i, j], j = True, parents[j]
    depth = mask.sum(1) - 1
    # draft steps after the first feed the head's own hidden: [N, H], not fused
    tree_tokens, tree_hidden = random_rows(head, 7, gen, fused=False)
    slots = torch.arange(1, 20)
    run(head, backend, ForwardMode.DRAFT_EXTEND, [prefix_tokens], [slots[:12]], [0],
        prefix_hidden)
    tree = run(head, backend, ForwardMode.DRAFT_DECODE, [tree_tokens], [slots], [12],
               tree_hidden, fused=False, positions=[12 + depth], custom_masks=[mask],
               logits="all")
    for node in range(7):
        path = torch.nonzero(mask[node]).flatten().tolist()
        ref_slots = torch.arange(100, 113 + len(path))
        run(head, backend, ForwardMode.EXTEND, [prefix_tokens], [ref_slots[:12]], [0],
            prefix_hidden)
        ref = run(head, backend, ForwardMode.EXTEND, [[tree_tokens[j] for j in path]],
                  [ref_slots[: 12 + len(path)]], [12], tree_hidden[path], fused=False)
        torch.testing.assert_close(tree.logits[node], ref.logits[0], atol=1e-4, rtol=1e-4)
        torch.testing.assert_close(tree.hidden[node], ref.hidden[-1], atol=1e-4, rtol=1e-4)


def test_d2t_maps_draft_ids_to_their_target_ids(tmp_path, target_dir, runner):
    hot = torch.tensor([3, 4, 10, 57, 58, 100, 250, 319] + list(range(120, 176)))
    hot = hot.sort().values
    ckpt = write_eagle3_checkpoint(tmp_path / "e3", target_dir, hot_ids=hot)
    head = load(ckpt, runner)
    assert torch.equal(head.map_to_target(torch.arange(64)), hot)
    assert torch.equal(head.map_to_target(torch.tensor([[63, 0]])), torch.tensor([[319, 3]]))
    assert torch.equal(torch.nonzero(head.t2d).flatten(), hot)


@pytest.mark.parametrize("writer,kwargs,message", [
    (write_eagle1_checkpoint, {"hidden_size": 32}, "hidden_size 32 does not match .* 64"),
    (write_eagle3_checkpoint, {"hidden_size": 32}, "hidden_size 32 does not match .* 64"),
    (write_eagle1_checkpoint, {"vocab_size": 100, "embed": "random"}, "vocabulary of 100 .*320"),
    (write_eagle3_checkpoint, {"vocab_size": 100}, "vocabulary of 100 .*320"),
])
def test_head_that_does_not_fit_the_target_is_refused_naming_the_mismatch(
    tmp_path, target_dir, runner, writer, kwargs, message,
):
    ckpt = writer(tmp_path / "head", target_dir, **kwargs)
    with pytest.raises(ModelLoadError, match=message):
        load(ckpt, runner)


def edit_checkpoint(ckpt, config_edits=None, tensor_edits=None):
    config = json.loads((ckpt / "config.json").read_text())
    (ckpt / "config.json").write_text(json.dumps({**config, **(config_edits or {})}))
    state = load_file(str(ckpt / "model.safetensors"))
    save_file({**state, **(tensor_edits or {})}, str(ckpt / "model.safetensors"))


@pytest.mark.parametrize("edits,message", [
    ({"config_edits": {"num_attention_heads": 4}}, r"q_proj.weight has shape \(128, 128\)"),
    ({"config_edits": {"draft_vocab_size": 65}}, r"lm_head.weight has shape \(64, 64\)"),
    ({"tensor_edits": {"t2d": torch.ones(320, dtype=torch.bool)}}, "t2d does not mark"),
    ({"tensor_edits": {"d2t": torch.full((64,), 300)}}, "outside the target's 320"),
    ({"tensor_edits": {"layers.0.mlp.down_proj.weight": torch.zeros(64, 96)}}, "mix"),
])
def test_inconsistent_eagle3_checkpoint_is_refused(tmp_path, target_dir, runner, edits, message):
    ckpt = write_eagle3_checkpoint(tmp_path / "e3", target_dir)
    edit_checkpoint(ckpt, **edits)
    with pytest.raises(ModelLoadError, match=message):
        load(ckpt, runner)


def test_target_model_directory_is_not_taken_for_a_head(target_dir, runner):
    with pytest.raises(ModelLoadError, match="not an EAGLE draft head"):
        load(target_dir, runner)


class _WritesAFile:
    def __init__(self, path):
        self.path = str(path)

    def __reduce__(self):
        return (open, (self.path, "w"))  # runs at unpickling time under a plain pickle.load


def test_bin_with_non_tensor_pickle_is_refused_without_running_it(tmp_path, target_dir, runner):
    ckpt = write_eagle1_checkpoint(tmp_path / "e1", target_dir, fmt="bin")
    state = torch.load(ckpt / "pytorch_model.bin", weights_only=True)
    marker = tmp_path / "pwned"
    torch.save({**state, "extra": _WritesAFile(marker)}, ckpt / "pytorch_model.bin")
    with pytest.raises(ModelLoadError, match="weights_only"):
        load(ckpt, runner)
    assert not marker.exists()
    torch.load(ckpt / "pytorch_model.bin", weights_only=False)  # the payload is real
    assert marker.exists()
    torch.save({**state, "note": "not a tensor"}, ckpt / "pytorch_model.bin")
    with pytest.raises(ModelLoadError, match="'note' is not a tensor"):
        load(ckpt, runner)


@pytest.mark.parametrize("embed", ["none", "random"])
def test_eagle3_save_then_load_round_trips_the_public_layout(tmp_path, target_dir, runner, embed):
    ckpt = write_eagle3_checkpoint(tmp_path / "e3", target_dir, seed=9, embed=embed,
                                   aux_layer_ids=[0, 3, 6])
    head = load(ckpt, runner)
    saved = save_eagle3_head(head, tmp_path / "saved")
    assert set(load_file(str(saved / "model.safetensors"))) == set(read_checkpoint(ckpt))
    again = load(saved, runner)
    assert again.capture_layers == head.capture_layers == (1, 4, 7)
    for (name, a), (name_b, b) in zip(head.state_dict().items(), again.state_dict().items()):
        assert name == name_b and torch.equal(a, b), name
    gen = torch.Generator().manual_seed(10)
    tokens, fused = random_rows(head, 9, gen)
    outs = [run(h, h.create_backend(), ForwardMode.EXTEND, [tokens], [torch.arange(1, 10)], [0],
                fused, logits="all") for h in (head, again)]
    assert torch.equal(outs[0].logits, outs[1].logits)
    if head.pack_weights():  # CPU oneDNN fast path, where available: same outputs, no save
        packed = run(head, head.create_backend(), ForwardMode.EXTEND, [tokens],
                     [torch.arange(1, 10)], [0], fused, logits="all")
        torch.testing.assert_close(packed.logits, outs[0].logits, atol=1e-4, rtol=1e-4)
        with pytest.raises(ValueError, match="prepacked"):
            save_eagle3_head(head, tmp_path / "packed")
        # bf16 matmuls (draft heads on CPUs with bf16 dot products): close, not equal
        bf = load(saved, runner)
        if onednn_bf16_available():
            assert bf.pack_weights(torch.bfloat16)
            low = run(bf, bf.create_backend(), ForwardMode.EXTEND, [tokens],
                      [torch.arange(1, 10)], [0], fused, logits="all")
            assert low.logits.dtype == torch.float32
            err = (low.logits - outs[0].logits).abs().max() / outs[0].logits.abs().max()
            assert 0 < err < 0.05
        else:  # AVX2-only: no oneDNN bf16 path, the head stays fp32
            assert bf.pack_weights(torch.bfloat16) == 0
        # q8_0 blocks on the CPU engine's kernels (the CPU default for draft heads)
        from specserve.kernels import cpu

        if cpu.available()[0]:
            q8 = load(saved, runner)
            assert q8.pack_weights("q8_0")
            low = run(q8, q8.create_backend(), ForwardMode.EXTEND, [tokens],
                      [torch.arange(1, 10)], [0], fused, logits="all")
            err = (low.logits - outs[0].logits).abs().max() / outs[0].logits.abs().max()
            assert 0 < err < 0.05
            with pytest.raises(ValueError, match="prepacked"):
                save_eagle3_head(q8, tmp_path / "q8")


@pytest.mark.parametrize("fmt,tol", [("f32", 1e-4), ("q8_0", 0.15)])
def test_eagle3_head_in_the_cpu_engine_matches_the_torch_head(tmp_path, target_dir, runner, fmt,
                                                             tol):
    """One engine call per forward (fc, the 2H-wide q/k/v input, the layer, norm, LM head and
    top-k) gives the torch head's logits and hidden states over extend, chain and tree steps;
    in float32 to float tolerance, in q8_0 within its rounding."""
    ckpt = write_eagle3_checkpoint(tmp_path / "e3", target_dir, seed=6)
    ref, ours = load(ckpt, runner), load(ckpt, runner)
    assert ours.run_in_cpu_engine(fmt, 1)
    tokens, fused = head_inputs(runner, ref, IDS)
    n = len(tokens)
    slots = torch.arange(1, n + 4)
    steps = [  # (mode, tokens, slots, prefix_lens, hidden source, build kwargs)
        (ForwardMode.DRAFT_EXTEND, [tokens], [slots[:n]], [0], "fused", {"logits": "all"}),
        (ForwardMode.DECODE, [[17]], [slots[: n + 1]], [n], "last", {}),
        (ForwardMode.DRAFT_DECODE, [[29, 31]], [slots[: n + 3]], [n + 1], "last2",
         {"custom_masks": [torch.tensor([[True, False], [False, True]])], "logits": "all"}),
    ]
    outs = {}
    for head, name in ((ref, "ref"), (ours, "ours")):
        backend, prev = head.create_backend(), None
        got = []
        for mode, toks, sl, pre, src, kw in steps:
            hidden = (fused if src == "fused" else prev.hidden[-1:] if src == "last"
                      else prev.hidden[-1:].expand(2, -1))
            prev = run(head, backend, mode, toks, sl, pre, hidden, fused=src == "fused", **kw)
            got.append(prev)
        outs[name] = got
    for r, o in zip(outs["ref"], outs["ours"]):
        torch.testing.assert_close(o.logits, r.logits, atol=tol, rtol=tol)
        torch.testing.assert_close(o.hidden, r.hidden, atol=tol, rtol=tol)
    top = ours(ForwardBatch.build(ForwardMode.DECODE, [[5]], [slots[: n + 1]], [n]),
               ours.create_backend(), outs["ours"][0].hidden[-1:], hidden_is_fused=False, topk=3)
    logq = torch.log_softmax(top.logits, dim=-1)
    torch.testing.assert_close(top.top_logq, logq.topk(3).values, atol=1e-5, rtol=1e-5)
    assert top.top_ids.tolist() == logq.topk(3).indices.tolist()
