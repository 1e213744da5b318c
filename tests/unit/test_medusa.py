"""MEDUSA: the public Medusa-1 layout (safetensors and weights-only .pt) and our tied variant
load, mismatched checkpoints fail clearly, the static sparse tree follows the choices, and
greedy and seeded output equal plain decoding on the tiny model at batch 1 and 8, with drafts
accepted (heads steered toward the known continuation)."""

from __future__ import annotations

import json

import pytest
import torch

from specserve.runtime.model_runner.local_generator import LocalGenerator
from specserve.runtime.model_runner.runner_process import RunnerWorker
from specserve.runtime.sampling.sampling_params import SamplingParams
from specserve.speculative.base import RunnerReq, SpecConfig, create_drafter
from specserve.speculative.drafters.medusa import MedusaDrafter, parse_choices
from specserve.speculative.models.medusa import MedusaError, MedusaHeads, load_medusa, save_medusa
from specserve.speculative.worker import SpeculativeWorker
from tests.integration.test_spec_lossless import copy_heavy_prompts
from tests.unit.test_scheduler import Harness, reference, tiny  # noqa: F401

H, V = 16, 50


def random_heads(num_heads=3, num_layers=1, tied=False, seed=0):
    torch.manual_seed(seed)
    heads = MedusaHeads(num_heads, num_layers, H, V, tied=tied)
    for p in heads.parameters():
        p.data.normal_(0, 0.2)
    return heads


@pytest.mark.parametrize("fmt", ["safetensors", "pt"])
def test_public_layout_round_trips(tmp_path, fmt):
    heads = random_heads(num_layers=2)
    save_medusa(heads, tmp_path)
    if fmt == "pt":  # the reference code's torch.save of the heads' state dict
        sd = heads.state_dict_public()
        (tmp_path / "medusa_lm_head.safetensors").unlink()
        torch.save(sd, tmp_path / "medusa_lm_head.pt")
    cfg = json.loads((tmp_path / "config.json").read_text())
    assert cfg["medusa_num_heads"] == 3 and cfg["medusa_num_layers"] == 2
    back = load_medusa(tmp_path, H, V)
    h = torch.randn(4, H)
    assert torch.allclose(back.logits(h), heads.logits(h))
    assert set(heads.state_dict_public()) == {
        f"{i}.{j}.linear.{n}" for i in range(3) for j in range(2) for n in ("weight", "bias")
    } | {f"{i}.2.weight" for i in range(3)}


def test_a_pickled_object_is_refused(tmp_path):
    save_medusa(random_heads(), tmp_path)
    (tmp_path / "medusa_lm_head.safetensors").unlink()
    torch.save({"0.0.linear.weight": object()}, tmp_path / "medusa_lm_head.pt")
    with pytest.raises(Exception, match="(?i)weights_only|unpickl|global"):
        load_medusa(tmp_path, H, V)


def test_tied_heads_use_the_targets_lm_head(tmp_path):
    heads = random_heads(tied=True)
    save_medusa(heads, tmp_path)
    back = load_medusa(tmp_path, H, V)
    assert back.tied and back.out is None
    lm = torch.nn.Linear(H, V, bias=False)
    h = torch.randn(2, H)
    assert torch.allclose(back.logits(h, lm), heads.logits(h, lm))


@pytest.mark.parametrize("hidden,vocab,needle", [(H + 1, V, "hidden size 17"),
                                                 (H, V + 3, "vocabulary 53")])
def test_a_checkpoint_that_does_not_fit_the_target_fails_clearly(tmp_path, hidden, vocab,
                                                                 needle):
    save_medusa(random_heads(), tmp_path)
    with pytest.raises(MedusaError, match=needle):
        load_medusa(tmp_path, hidden, vocab)


def test_missing_files_and_keys_fail_clearly(tmp_path):
    with pytest.raises(MedusaError, match="config.json"):
        load_medusa(tmp_path, H, V)
    save_medusa(random_heads(), tmp_path)
    from safetensors.torch import load_file, save_file

    sd = load_file(str(tmp_path / "medusa_lm_head.safetensors"))
    del sd["1.0.linear.bias"]
    save_file(sd, str(tmp_path / "medusa_lm_head.safetensors"))
    with pytest.raises(MedusaError, match="missing 1.0.linear.bias"):
        load_medusa(tmp_path, H, V)


def test_choices_parse_in_tree_order_and_need_their_prefixes():
    assert parse_choices("[[0, 0], [0], [1], [0, 0, 1]]") == [(0,), (1,), (0, 0), (0, 0, 1)]
    with pytest.raises(ValueError, match="prefix"):
        parse_choices("[[0], [1, 0]]")
    with pytest.raises(ValueError, match="JSON list"):
        parse_choices("[[0], []]")


def identity_heads(model_dir, out_dir, num_heads=3):
    """Tied heads whose ResBlocks are the identity: every head predicts the target's own next
    token at the hidden state's row (so a draft repeats the root; a looping model accepts)."""
    cfg = json.loads((model_dir / "config.json").read_text())
    heads = MedusaHeads(num_heads, 1, cfg["hidden_size"], cfg["vocab_size"], tied=True)
    for p in heads.parameters():
        p.data.zero_()
    return save_medusa(heads, out_dir)


def test_the_tree_follows_the_choices(tiny, tmp_path):  # noqa: F811
    path = identity_heads(tiny[0], tmp_path / "heads")
    d = create_drafter(SpecConfig("MEDUSA", 6, draft_model_path=str(path),
                                  medusa_choices="[[0], [1], [0, 0], [0, 1], [0, 0, 0]]"),
                       tiny[1])

    class Out:
        final_hidden = torch.randn(3, json.loads((tiny[0] / "config.json").read_text())[
            "hidden_size"])

    from specserve.speculative.base import TargetRows

    d.draft_extend([TargetRows("r", 0, torch.arange(3), torch.tensor([0, 1, 2]), [5, 6, 7],
                               [4, 5, 6])], Out)
    tree = d.propose([RunnerReq.drafting("r", [1, 2, 3], 6)])[0]
    assert tree.parents.tolist() == [-1, 0, 0, 1, 1, 3]
    t = tree.tokens.tolist()
    assert t[1] == t[3] == t[5] and t[2] == t[4]  # identity heads: the same top-2 at every depth
    assert t[1] != t[2]
    cut = d.propose([RunnerReq.drafting("r", [1, 2, 3], 3)])[0]
    assert cut.tokens.numel() == 3  # the budget cuts


class SteeredMedusa(MedusaDrafter):
    """Makes each head's known next token (from `truth`: prompt -> output) its top score in
    three requests' steps of four (the fourth left as the heads have it)."""

    truth: dict[tuple, list[int]]

    def _head_logits(self, reqs):
        logits = super()._head_logits(reqs).clone()  # [depth, B, V]
        for b, r in enumerate(reqs):
            cont = next((out[len(r.tokens) - len(p):] for p, out in self.truth.items()
                         if list(p) == r.tokens[: len(p)]), [])
            if len(r.tokens) % 4 == 3:
                continue
            for d in range(min(len(cont), logits.shape[0])):
                logits[d, b, cont[d]] = logits[d, b].max() + 6.0
        return logits


@pytest.mark.parametrize("params", [{"temperature": 0.0},
                                    {"temperature": 0.8, "top_p": 0.9, "seed": 0}],
                         ids=["greedy", "seeded"])
@pytest.mark.parametrize("concurrency", [1, 8])
def test_tiny_model_medusa_equals_plain_with_drafts_accepted(tiny, tmp_path, concurrency,  # noqa: F811
                                                            params):
    path = identity_heads(tiny[0], tmp_path / "heads")
    prompts = copy_heavy_prompts(24, seed=30 + concurrency)
    sps = [SamplingParams(max_new_tokens=20, ignore_eos=True,
                          **{**params, **({"seed": 100 + i} if "seed" in params else {})})
           for i in range(len(prompts))]
    ref = [r.output_ids for r in LocalGenerator(tiny[1]).generate(prompts, sps)]
    h = Harness(tiny, num_draft_tokens=6, max_running_requests=concurrency)
    cfg = SpecConfig("MEDUSA", 6, draft_model_path=str(path), disable_adaptive=True)
    runner = tiny[1]
    drafter = SteeredMedusa(cfg, runner)
    drafter.truth = {tuple(p): r for p, r in zip(prompts, ref)}
    h.worker = RunnerWorker(runner, SpeculativeWorker(cfg, drafter, runner))
    for i, (p, sp) in enumerate(zip(prompts, sps)):
        h.submit(f"r{i}", p, **sp.to_dict())
    h.run()
    assert [h.outputs[f"r{i}"] for i in range(len(prompts))] == ref
    info = h.sched.info()
    assert info["spec_decode_num_accepted_tokens"] > 0.3 * info["spec_decode_num_draft_tokens"]
    assert info["avg_spec_accept_length"] > 1.5, info["avg_spec_accept_length"]
    h.sched.check_no_leak()


def test_medusa_needs_heads_and_sizes_its_tree_from_the_choices(tmp_path):
    from specserve.launch.server_args import ServerArgs
    from specserve.speculative.drafters.medusa import DEFAULT_MEDUSA_HEADS

    with pytest.raises(ValueError, match="MEDUSA needs --speculative-draft-model-path"):
        ServerArgs(model_path=str(tmp_path), speculative_algorithm="MEDUSA").resolve()
    # the default model serves the shipped heads with the tree chosen for them: 3 drafts
    shipped = ServerArgs(speculative_algorithm="MEDUSA").resolve()
    assert shipped.speculative_draft_model_path == str(DEFAULT_MEDUSA_HEADS)
    assert shipped.speculative_num_draft_tokens == 4
    heads = load_medusa(DEFAULT_MEDUSA_HEADS, 576, 49152)
    assert heads.tied and heads.num_heads == 3
    args = ServerArgs(speculative_algorithm="MEDUSA", speculative_draft_model_path=str(tmp_path),
                      speculative_medusa_choices="[[0], [1], [0, 0]]").resolve()
    assert args.speculative_num_draft_tokens == 4
