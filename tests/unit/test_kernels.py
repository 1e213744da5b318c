from __future__ import annotations

import random

import numpy as np
import pytest
import torch

from specserve.kernels import registry
from specserve.kernels.registry import KernelNotFoundError, OpRegistry
from specserve.speculative.tree import DraftTree, pack_trees
from specserve.speculative.verify import QMode, verify_greedy_batch, verify_stochastic_batch

REFERENCE_OPS = (
    "build_tree_masks",
    "verify_tree_greedy",
    "tree_speculative_sampling",
    "pack_tree_mask",
    "unpack_tree_mask",
)


# ---------------------------------------------------------------- registry
def test_get_falls_back_to_the_torch_reference_on_cpu() -> None:
    ops = registry.list_ops()
    for name in REFERENCE_OPS:
        assert "torch" in ops[name]
        fn = registry.get(name, "cpu")
        assert fn.__module__ == "specserve.kernels.reference"
        assert registry.get(name, torch.device("cpu"), backend="torch") is fn


def test_unknown_op_or_backend_raises_a_clear_error() -> None:
    with pytest.raises(KernelNotFoundError, match="unknown op 'no_such_op'.*build_tree_masks"):
        registry.get("no_such_op", "cpu")
    with pytest.raises(KernelNotFoundError, match="backend 'sgl_kernel'"):
        registry.get("verify_tree_greedy", "cpu", backend="sgl_kernel")


def test_device_specific_backends_win_only_where_they_run_and_are_available() -> None:
    reg = OpRegistry()
    cuda_ok = {"value": True}

    def ref() -> str:
        return "torch"

    def fast() -> str:
        return "cuda"

    reg.register("op", "torch", ref)
    reg.register("op", "sgl_kernel", fast, lambda: cuda_ok["value"], device_types=("cuda",))
    assert reg.get("op", "cpu") is ref  # never a cuda backend for a cpu tensor
    assert reg.get("op", "cuda:0") is fast  # device type, index ignored
    cuda_ok["value"] = False
    assert reg.get("op", "cuda") is ref  # probe fails (e.g. sgl_kernel not importable)
    assert reg.list_ops() == {"op": ["torch", "sgl_kernel"]}
    with pytest.raises(ValueError, match="already has"):
        reg.register("op", "torch", ref)
    only_cuda = OpRegistry()
    only_cuda.register("op", "sgl_kernel", fast, device_types=("cuda",))
    with pytest.raises(KernelNotFoundError, match="no available implementation"):
        only_cuda.get("op", "cpu")


# ---------------------------------------------------------------- random batches of trees
def _random_trees(seed: int, vocab: int, with_q: bool, count: int = 12) -> list[DraftTree]:
    rng = random.Random(seed)
    gen = torch.Generator().manual_seed(seed)
    trees = []
    for _ in range(count):
        n = rng.choice([1, 2, 5, 9, 16])
        parents = [-1] + [rng.randrange(max(0, i - 3), i) for i in range(1, n)]  # deep-ish
        tokens = [rng.randrange(vocab) for _ in range(n)]
        q = None
        if with_q:
            q = torch.rand(n, vocab, generator=gen, dtype=torch.float64) ** 3
            q = q / q.sum(-1, keepdim=True)
        trees.append(DraftTree.from_parents(tokens, parents, q))
    return trees


def _padded_parents(trees: list[DraftTree]) -> torch.Tensor:
    width = max(t.num_nodes for t in trees)
    out = torch.full((len(trees), width), -1, dtype=torch.int64)
    for b, t in enumerate(trees):
        out[b, : t.num_nodes] = t.parents
    return out


@pytest.mark.parametrize("seed", range(4))
def test_build_tree_masks_agrees_with_draft_tree_and_pack_trees(seed: int) -> None:
    trees = _random_trees(seed, vocab=50, with_q=False)
    seq_lens = [random.Random(seed).randint(1, 100) + b for b in range(len(trees))]
    packed = pack_trees(trees, seq_lens)
    out = registry.get("build_tree_masks", "cpu")(_padded_parents(trees), torch.tensor(seq_lens))
    assert torch.equal(out.retrive_index, packed.retrive_index)
    assert torch.equal(out.retrive_next_token, packed.retrive_next_token)
    assert torch.equal(out.retrive_next_sibling, packed.retrive_next_sibling)
    assert out.num_nodes.tolist() == packed.num_nodes
    for b, t in enumerate(trees):
        n = t.num_nodes
        assert torch.equal(out.tree_mask[b, :n, :n], t.ancestor_mask)
        assert torch.equal(out.positions[b, :n], t.positions(seq_lens[b]))
        assert torch.equal(out.depth[b, :n], t.depth)
        pad = out.tree_mask[b, n:]  # padding rows attend to themselves only
        assert torch.equal(pad, torch.eye(out.tree_mask.shape[1], dtype=torch.bool)[n:])


def _check_agreement(trees, results, out) -> None:
    packed_offsets = [0]
    for t in trees:
        packed_offsets.append(packed_offsets[-1] + t.num_nodes)
    for b, res in enumerate(results):
        k = int(out.accept_token_num[b])
        path = out.accept_index[b, : k + 1].tolist()
        assert [i - packed_offsets[b] for i in path] == res.accepted_nodes
        assert out.accept_index[b, k + 1 :].eq(-1).all()
        assert out.predicts[path].tolist() == res.output_tokens


@pytest.mark.parametrize("seed", range(4))
def test_verify_tree_greedy_op_agrees_with_python_verify(seed: int) -> None:
    vocab = 8
    trees = _random_trees(seed, vocab, with_q=False)
    # Target argmax: mostly the token of some child, so walks go deep; sometimes anything.
    rng, argmax = random.Random(seed), []
    for t in trees:
        toks = t.tokens.tolist()
        for u in range(t.num_nodes):
            kids = t.children(u)
            hit = kids and rng.random() < 0.8
            argmax.append(toks[rng.choice(kids)] if hit else rng.randrange(vocab))
    logits = torch.nn.functional.one_hot(torch.tensor(argmax), vocab).float()
    results = verify_greedy_batch(trees, logits)
    packed = pack_trees(trees, [10] * len(trees))
    out = registry.get("verify_tree_greedy", "cpu")(
        packed.candidates, packed.retrive_index, packed.retrive_next_token,
        packed.retrive_next_sibling, torch.tensor(argmax),
    )  # fmt: skip
    _check_agreement(trees, results, out)
    assert max(len(r.accepted_tokens) for r in results) >= 3  # the walks really went deep


@pytest.mark.parametrize("q_mode", list(QMode))
@pytest.mark.parametrize(("seed", "thresholds"), [(0, {}), (1, {}), (2, {"threshold_acc": 0.6})])
def test_tree_speculative_sampling_op_agrees_with_python_verify(
    q_mode: QMode, seed: int, thresholds: dict
) -> None:
    vocab = 6
    trees = _random_trees(seed, vocab, with_q=True, count=80)
    packed = pack_trees(trees, [5] * len(trees))
    gen = torch.Generator().manual_seed(seed)
    probs = torch.rand(packed.tokens.numel(), vocab, generator=gen, dtype=torch.float64) ** 2
    probs[probs < 0.05] = 0.0  # zeros, as after top-k / top-p / min-p
    probs[:, 0] += 1e-3  # no all-zero row
    probs = probs / probs.sum(-1, keepdim=True)
    coins = torch.rand(packed.tokens.numel(), generator=gen, dtype=torch.float64)
    results = verify_stochastic_batch(trees, probs, coins, q_mode=q_mode, **thresholds)
    coins_2d = torch.zeros(packed.candidates.shape, dtype=torch.float64)
    for b, n in enumerate(packed.num_nodes):
        lo = int(packed.qo_indptr[b])
        coins_2d[b, :n] = coins[lo : lo + n]
    out = registry.get("tree_speculative_sampling", "cpu")(
        packed.candidates, packed.retrive_index, packed.retrive_next_token,
        packed.retrive_next_sibling, coins_2d, probs, packed.draft_probs,
        q_mode=str(q_mode), **thresholds,
    )  # fmt: skip
    _check_agreement(trees, results, out)
    assert sum(len(r.accepted_tokens) for r in results) >= 10  # exercised acceptance
    assert sum(len(r.accepted_tokens) == 0 for r in results) >= 3  # and the residual path


# ---------------------------------------------------------------- mask bit packing
@pytest.mark.parametrize("n", [1, 7, 8, 9, 33, 64])
def test_pack_tree_mask_matches_numpy_packbits_little_and_round_trips(n: int) -> None:
    gen = torch.Generator().manual_seed(n)
    mask = torch.rand(3, n, n, generator=gen) < 0.4  # [B, N, N]
    packed = registry.get("pack_tree_mask", "cpu")(mask)
    assert packed.dtype == torch.uint8 and packed.shape == (3, n, (n + 7) // 8)
    expected = np.packbits(mask.numpy(), axis=-1, bitorder="little")
    assert np.array_equal(packed.numpy(), expected)
    assert torch.equal(registry.get("unpack_tree_mask", "cpu")(packed, n), mask)


def test_pack_tree_mask_puts_column_j_in_bit_j_mod_8_of_byte_j_div_8() -> None:
    mask = torch.zeros(1, 12, dtype=torch.bool)
    mask[0, 10] = True
    assert registry.get("pack_tree_mask", "cpu")(mask).tolist() == [[0, 1 << 2]]
