from __future__ import annotations

import math

import pytest
import torch

from specserve.kernels.reference import build_tree_masks, tree_speculative_sampling
from specserve.speculative.tree import DraftTree
from specserve.speculative.verify import (
    QMode,
    verify_greedy,
    verify_greedy_batch,
    verify_stochastic,
    verify_stochastic_batch,
)


@pytest.fixture(autouse=True, scope="module")
def _one_torch_thread():
    # The simulations are many small ops on [40k, 6] tensors: with 2 cores shared with other
    # jobs, OpenMP threads spin-wait on each other and a 3 s module takes a minute. Restored after.
    before = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(before)


V = 6  # tiny vocabulary: every cell of the two-token joint gets thousands of samples
TRIALS = 40_000


# ---------------------------------------------------------------- greedy, hand-built trees
#   root(0) ── 1:10 ── 3:20
#          └── 2:11 ── 4:21
#                  └── 5:22 ── 6:30
BRANCHY = DraftTree.from_parents([99, 10, 11, 20, 21, 22, 30], [-1, 0, 0, 1, 2, 2, 5])


def test_greedy_accepts_a_depth_two_match_in_the_second_branch() -> None:
    argmax = torch.tensor([11, 20, 22, 0, 0, 7, 0])  # root->11 (node 2), node 2->22 (node 5)
    res = verify_greedy(BRANCHY, argmax)
    assert res.accepted_nodes == [0, 2, 5]
    assert res.accepted_tokens == [11, 22]
    assert res.bonus_token == 7  # node 5's argmax (7) matches no child (30)
    assert res.output_tokens == [11, 22, 7]


def test_greedy_with_no_match_returns_only_the_target_token() -> None:
    res = verify_greedy(BRANCHY, torch.tensor([12, 20, 22, 0, 0, 30, 0]))
    assert res == ([0], [], 12)


def test_greedy_full_chain_accepted_plus_bonus() -> None:
    chain = DraftTree.chain(1, [2, 3, 4])
    res = verify_greedy(chain, torch.tensor([2, 3, 4, 5]))
    assert res.accepted_nodes == [0, 1, 2, 3] and res.output_tokens == [2, 3, 4, 5]


def test_greedy_batch_matches_single_tree_verification() -> None:
    trees = [BRANCHY, DraftTree.chain(1, [2, 3]), DraftTree.chain(4, [])]
    logits = torch.randn(7 + 3 + 1, 40, generator=torch.Generator().manual_seed(0))
    logits[0, 11] = logits[2, 22] = logits[7, 2] = 100.0  # force some acceptance
    batch = verify_greedy_batch(trees, logits)
    off = 0
    for tree, res in zip(trees, batch):
        assert res == verify_greedy(tree, logits[off : off + tree.num_nodes].argmax(-1))
        off += tree.num_nodes
    assert batch[0].accepted_tokens == [11, 22] and batch[1].accepted_tokens[:1] == [2]


# ---------------------------------------------------------------- statistical losslessness
def _dists(gen: torch.Generator, *shape: int, keep: int | None = None) -> torch.Tensor:
    """Random distributions over V; keep=k zeroes all but the top k (a top-k processed target)."""
    x = torch.rand(*shape, V, generator=gen, dtype=torch.float64) ** 2 + 0.02
    if keep is not None:
        x = torch.where(x >= x.topk(keep, -1).values[..., -1:], x, 0.0)
    return x / x.sum(-1, keepdim=True)


def _parents(branching: list[int]) -> tuple[list[int], list[list[int]]]:
    parents, levels = [-1], [[0]]
    for k in branching:
        nxt = []
        for u in levels[-1]:
            for _ in range(k):
                parents.append(u)
                nxt.append(len(parents) - 1)
        levels.append(nxt)
    return parents, levels


def _simulate(
    branching: list[int],
    drafts: str,
    seed: int,
    *,
    keep: int | None = None,
    q_mode: str = "one_hot",
    pass_q: str = "real",
    trials: int = TRIALS,
    **thresholds: float,
) -> tuple[torch.Tensor, torch.Tensor, float]:
    """Run `trials` verify steps of a Markov target/drafter over one tree shape.

    The target's next-token law is p1 at the root, p2[x] after a first token x, p3[x] after a
    second token x (likewise q1/q2/q3 for the drafter). drafts: "iid" | "wor" | "topk" children of
    each node from the drafter's q there, or "fixed" distinct tokens. Returns the [V] counts of the
    first output token, the [V, V] counts of the first two (a second token that the step did not
    produce is drawn from p2[y1], as the next step would), and the mean accepted length.
    """
    gen = torch.Generator().manual_seed(seed)
    p1, p2, p3 = _dists(gen, keep=keep), _dists(gen, V, keep=keep), _dists(gen, V, keep=keep)
    q1, q2, q3 = _dists(gen), _dists(gen, V), _dists(gen, V)
    parents, levels = _parents(branching)
    n, b = len(parents), trials
    tokens = torch.zeros(b, n, dtype=torch.int64)
    tgt = torch.empty(b, n, V, dtype=torch.float64)
    qs = torch.empty(b, n, V, dtype=torch.float64)
    for depth, level in enumerate(levels):
        for u in level:
            tok = tokens[:, u]
            tgt[:, u] = (p1.expand(b, V), p2[tok], p3[tok])[min(depth, 2)]
            qs[:, u] = (q1.expand(b, V), q2[tok], q3[tok])[min(depth, 2)]
            kids = [c for c in range(n) if parents[c] == u]
            if not kids:
                continue
            k = len(kids)
            if drafts == "iid":
                tokens[:, kids] = torch.multinomial(qs[:, u], k, replacement=True, generator=gen)
            elif drafts == "wor":
                tokens[:, kids] = torch.multinomial(qs[:, u], k, replacement=False, generator=gen)
            elif drafts == "topk":
                tokens[:, kids] = qs[:, u].topk(k, -1).indices
            else:  # fixed distinct tokens, a deterministic drafter
                tokens[:, kids] = torch.randperm(V, generator=gen)[:k]
    links = build_tree_masks(torch.tensor([parents] * b), torch.full((b,), 10))
    draft = {"real": qs, "ones": torch.ones_like(qs)}[pass_q].reshape(b * n, V)
    out = tree_speculative_sampling(
        tokens, links.retrive_index, links.retrive_next_token, links.retrive_next_sibling,
        torch.rand(b, n, generator=gen, dtype=torch.float64), tgt.reshape(b * n, V),
        draft, q_mode=q_mode, **thresholds,
    )  # fmt: skip
    y1 = out.predicts[out.accept_index[:, 0]]
    second = out.predicts[out.accept_index[:, 1].clamp(min=0)]
    fresh = torch.multinomial(p2[y1], 1, generator=gen)[:, 0]
    y2 = torch.where(out.accept_token_num >= 1, second, fresh)
    first = torch.bincount(y1, minlength=V).double()
    joint = torch.bincount(y1 * V + y2, minlength=V * V).double().view(V, V)
    expected = (p1, p1[:, None] * p2)
    return (first, expected[0]), (joint, expected[1]), out.accept_token_num.double().mean().item()


def _consistent(counts: torch.Tensor, probs: torch.Tensor, z: float = 4.0) -> bool:
    """Chi-square goodness of fit at about 4 sigma (Wilson-Hilferty critical value)."""
    counts, probs = counts.reshape(-1), probs.reshape(-1)
    if counts[probs == 0].sum() > 0:
        return False  # a token the target can never produce
    exp = probs[probs > 0] * counts.sum()
    stat = ((counts[probs > 0] - exp) ** 2 / exp).sum().item()
    dof = int((probs > 0).sum()) - 1
    crit = dof * (1 - 2 / (9 * dof) + z * math.sqrt(2 / (9 * dof))) ** 3
    return stat < crit


def _lossless(first: tuple, joint: tuple) -> bool:
    return _consistent(*first) and _consistent(*joint)


@pytest.mark.parametrize(
    ("branching", "drafts", "q_mode", "keep"),
    [
        ([3, 2], "fixed", "one_hot", None),  # (a) deterministic drafter, distinct siblings
        ([3, 2], "fixed", "one_hot", 3),  # (a) with zeros in p from top-k processing
        ([1, 1, 1], "iid", "iid", None),  # Leviathan chain with a probabilistic drafter
        ([3, 2], "iid", "iid", None),  # (b) SpecInfer: i.i.d. siblings
        ([3, 2], "iid", "iid", 2),  # (b) with zeros in p
        ([3, 2], "topk", "one_hot", None),  # (c) top-k children, q ignored
        ([3, 2], "wor", "without_replacement", 3),  # siblings sampled without replacement
        ([3, 2], "iid", "one_hot", None),  # one-hot is lossless whatever picked the children
    ],
)
def test_stochastic_verify_output_is_distributed_as_the_target(
    branching: list[int], drafts: str, q_mode: str, keep: int | None
) -> None:
    first, joint, mean_acc = _simulate(branching, drafts, seed=11, q_mode=q_mode, keep=keep)
    assert _lossless(first, joint)
    assert mean_acc > 0.2  # the drafts are really being accepted, not all rejected


@pytest.mark.parametrize(
    ("name", "kwargs"),
    [
        # (c) done wrong: top-k children checked with min(1, p/q) as if x ~ q
        ("topk with q ratio", dict(branching=[2, 2], drafts="topk", q_mode="iid")),
        # accepts with p(x) instead of min(1, p/q) and never shrinks the residual (q = 1 rows)
        ("accept with p", dict(branching=[3, 2], drafts="iid", q_mode="iid", pass_q="ones")),
        # i.i.d. siblings verified as if drawn without replacement
        ("iid as wor", dict(branching=[3, 2], drafts="iid", q_mode="without_replacement")),
        ("wor as iid", dict(branching=[3, 2], drafts="wor", q_mode="iid")),
        # LOSSY thresholds
        ("threshold_acc", dict(branching=[3, 2], drafts="fixed", threshold_acc=0.7)),
        ("threshold_single", dict(branching=[3, 2], drafts="fixed", threshold_single=0.25)),
    ],
)
def test_the_statistical_check_catches_wrong_verifiers(name: str, kwargs: dict) -> None:
    first, joint, _ = _simulate(seed=11, **kwargs)
    assert not _lossless(first, joint), f"{name} should not pass as lossless"


def test_lower_accept_thresholds_raise_acceptance() -> None:
    base = _simulate([3, 2], "fixed", seed=3, trials=8000)[2]
    acc = _simulate([3, 2], "fixed", seed=3, trials=8000, threshold_acc=0.5)[2]
    single = _simulate([3, 2], "fixed", seed=3, trials=8000, threshold_single=0.2)[2]
    assert acc > base + 0.1 and single > base + 0.1


def test_threshold_single_accepts_a_confident_child_whatever_the_coin() -> None:
    tree = DraftTree.chain(0, [2])
    probs = torch.tensor([[0.1, 0.1, 0.4, 0.4], [0.25] * 4], dtype=torch.float64)
    coins = torch.tensor([0.5, 0.999], dtype=torch.float64)  # coin of node 1 rejects p(x) = 0.4
    assert verify_stochastic(tree, probs, coins).accepted_tokens == []
    assert verify_stochastic(tree, probs, coins, threshold_single=0.4).accepted_tokens == [2]
    assert verify_stochastic(tree, probs, coins, threshold_acc=0.3).accepted_tokens == [2]


def _python_first_tokens(drafts: str, q_mode: QMode, trials: int = 5000) -> tuple:
    # The direct per-tree path (not the tensor op): root with 3 children drawn from q[0].
    gen = torch.Generator().manual_seed(5)
    p, q = _dists(gen, 2, keep=4), _dists(gen, 2)  # rows: root, children (leaves)
    if drafts == "iid":
        kids = torch.multinomial(q[0].expand(trials, V), 3, replacement=True, generator=gen)
    else:
        kids = q[0].topk(3).indices.expand(trials, 3)
    counts = torch.zeros(V, dtype=torch.float64)
    for row in kids.tolist():
        tree = DraftTree.from_parents([0, *row], [-1, 0, 0, 0], q[[0, 1, 1, 1]])
        res = verify_stochastic(tree, p[[0, 1, 1, 1]], generator=gen, q_mode=q_mode)
        counts[res.output_tokens[0]] += 1
    return counts, p[0]


def test_python_verifier_is_lossless_on_iid_siblings_and_the_check_has_power() -> None:
    assert _consistent(*_python_first_tokens("iid", QMode.IID))
    assert _consistent(*_python_first_tokens("topk", QMode.ONE_HOT))
    assert not _consistent(*_python_first_tokens("topk", QMode.IID))  # case (c) done wrong


def test_stochastic_batch_matches_single_tree_calls() -> None:
    gen = torch.Generator().manual_seed(9)
    trees = [BRANCHY, DraftTree.chain(3, [1, 2])]
    trees = [
        DraftTree.from_parents(t.tokens % V, t.parents, _dists(gen, t.num_nodes)) for t in trees
    ]
    probs, coins = _dists(gen, 10), torch.rand(10, generator=gen, dtype=torch.float64)
    batch = verify_stochastic_batch(trees, probs, coins, q_mode="iid")
    assert batch[0] == verify_stochastic(trees[0], probs[:7], coins[:7], q_mode="iid")
    assert batch[1] == verify_stochastic(trees[1], probs[7:], coins[7:], q_mode="iid")


def test_stochastic_verify_rejects_bad_arguments() -> None:
    with pytest.raises(AssertionError, match="needs draft_probs"):
        verify_stochastic(BRANCHY, torch.full((7, V), 1 / V), q_mode="iid")
    with pytest.raises(AssertionError, match="target_probs"):
        verify_stochastic(BRANCHY, torch.full((6, V), 1 / V))
    with pytest.raises(ValueError):
        verify_stochastic(BRANCHY, torch.full((7, V), 1 / V), q_mode="sometimes")
