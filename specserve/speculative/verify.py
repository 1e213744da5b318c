"""Verification of a draft tree against the target's outputs, as pure functions.

Notation: at a tree node u, p = the target's next-token distribution given the path to u (already
temperature / top-k / top-p / min-p processed by the caller), q = the drafter's distribution the
children of u were drawn from. A verify walk accepts a path of draft tokens from the root and ends
with one token sampled by the target itself (the bonus), so a request gains len(path) + 1 tokens.

Losslessness of `verify_stochastic` (output distributed exactly as the target's), by q_mode:

ONE_HOT  q is taken as one-hot at each child's token: accept child x with probability p(x); on
         rejection zero p(x) and renormalise; after the last child sample from what remains.
         Lossless for ANY rule that picks the children, as long as it does not look at the target's
         coins: for a fixed set of children the output is exactly p, and a mixture over child sets
         of p is p. Duplicate sibling tokens are harmless (the second copy has p(x) = 0 by then).
         This is the right mode for (a) deterministic drafters (n-gram) and (c) top-k children of
         a probabilistic drafter (EAGLE trees): those children are a deterministic function of q,
         so x ~ q does not hold and the min(1, p/q) test would be LOSSY (one child x = argmax q
         with p(x) = 0.3, q(x) = 0.6 is output with probability 0.5: the residual max(p - q, 0)
         has no mass on x).
IID      SpecInfer multi-step speculative sampling: the k siblings are i.i.d. draws from q = the
         parent's draft_probs row. Sibling i is accepted with min(1, p_i(x)/q(x)), on rejection
         p_{i+1} = normalize(max(p_i - q, 0)); lossless by induction from the last sibling (each
         step is a Leviathan step whose "sample from the residual" is the rest of the walk).
WITHOUT_REPLACEMENT  siblings drawn from q without replacement (e.g. Gumbel-top-k sampling, NOT
         deterministic top-k): sibling i was drawn from q_i = q with the earlier siblings' tokens
         zeroed and renormalised, so the same induction holds with q_i in place of q (recursive
         rejection sampling).

SEEDED   (`verify_seeded`, requests with a seed; specserve/runtime/sampling/seeded.py) the target's
         token at node u is its Gumbel-max draw from p_u with the noise of (seed, position of the
         token after u): exactly the token plain seeded sampling draws at that position after that
         path. A child is accepted when its token equals that draw, the bonus is the draw at the
         last accepted node, so the output is plain seeded sampling's, token for token. Lossless per
         position: each position's token is an exact sample of p (Gumbel-max) and positions use
         independent noise, so the sequence is an exact sample of the target whatever the tree —
         even a tree drawn with the same noise (EAGLE's coupled children). Acceptance with a one-hot
         drafter equals ONE_HOT's: siblings x1..xk are accepted with probability p(x1) + ... + p(xk)
         either way. With a drafter that has q it is the Gumbel coupling's P(argmax(log q + G) =
         argmax(log p + G)) (per sibling set, top-m of log q + G), below the IID /
         WITHOUT_REPLACEMENT modes' 1 - TV(p, q) (docs/benchmarks.md, "Sampling").

All modes also need: the subtree under each child is drafted with fresh randomness given the path
(children of node c ~ draft_probs[c] as the mode says). Pruning a sampled tree by looking at the
sampled tokens (e.g. EAGLE-2's re-ranking) breaks IID / WITHOUT_REPLACEMENT; use ONE_HOT then.

Coins: `uniforms` has one U[0, 1) per node. uniforms[c] (c >= 1) is the coin that tests child c;
uniforms[0] drives the final (bonus or residual) sample. Every node is tested at most once per walk,
so the coins used are independent. The tensor-form op
specserve.kernels.reference.tree_speculative_sampling consumes the same layout and must agree with
this module bit for bit.
"""

from __future__ import annotations

from enum import StrEnum
from typing import NamedTuple

import torch
from torch import Tensor

from specserve.runtime.sampling.argmax import argmax_rows
from specserve.speculative.tree import DraftTree


class VerifyResult(NamedTuple):
    accepted_nodes: list[int]  # [1 + num_accepted] node indices along the path, root (0) first
    accepted_tokens: list[int]  # [num_accepted] draft tokens accepted, root excluded
    bonus_token: int  # the target's own token after the last accepted node

    @property
    def output_tokens(self) -> list[int]:
        """The tokens the request gains: accepted drafts then the bonus token."""
        return [*self.accepted_tokens, self.bonus_token]


class QMode(StrEnum):
    ONE_HOT = "one_hot"
    IID = "iid"
    WITHOUT_REPLACEMENT = "without_replacement"


def greedy_walk(tree: DraftTree, argmax: list[int]) -> VerifyResult:
    """`verify_greedy` with the target's argmax at each node as a list (len = num_nodes)."""
    assert len(argmax) == tree.num_nodes, (
        f"argmax has {len(argmax)} entries for a tree of {tree.num_nodes} nodes")
    tokens = tree.token_list
    nodes, accepted = [0], []
    node = 0
    while True:
        want = argmax[node]  # the target's greedy token after the path to `node`
        nxt = next((c for c in tree.children(node) if tokens[c] == want), -1)
        if nxt < 0:
            return VerifyResult(nodes, accepted, want)
        nodes.append(nxt)
        accepted.append(want)
        node = nxt


def verify_greedy(tree: DraftTree, target_argmax: Tensor) -> VerifyResult:
    """Longest root path whose every token equals the target argmax at its parent.

    target_argmax: [N] int, the target's argmax at each node. At node u the child whose token is
    target_argmax[u] is accepted (the first such child by index if siblings repeat a token); the
    walk stops where none matches and target_argmax there is the bonus token. The output equals
    non-speculative greedy decoding token for token.
    """
    assert target_argmax.numel() == tree.num_nodes, (
        f"target_argmax has {target_argmax.numel()} entries for a tree of {tree.num_nodes} nodes"
    )
    return greedy_walk(tree, target_argmax.reshape(-1).tolist())


def verify_greedy_batch(trees: list[DraftTree], target_logits_flat: Tensor) -> list[VerifyResult]:
    """verify_greedy over a batch. target_logits_flat: [sum N, V] logits (or probs), trees in order.

    One vectorised argmax and one host transfer for the batch; the walks are tiny.
    """
    total = sum(t.num_nodes for t in trees)
    assert target_logits_flat.shape[0] == total, (
        f"target_logits_flat has {target_logits_flat.shape[0]} rows, the trees {total} nodes"
    )
    argmax = argmax_rows(target_logits_flat).tolist()  # [sum N]
    out, off = [], 0
    for t in trees:
        out.append(greedy_walk(t, argmax[off : off + t.num_nodes]))
        off += t.num_nodes
    return out


def verify_seeded(tree: DraftTree, target_draws: Tensor) -> VerifyResult:
    """Longest root path whose every token equals the target's seeded draw at its parent.

    target_draws: [N] int, the target's own token at each node (Gumbel-max with the request's
    (seed, position) noise from its processed p at that node). The walk is the greedy one with
    draws in place of the argmax; the output equals plain seeded sampling token for token.
    """
    assert target_draws.numel() == tree.num_nodes, (
        f"target_draws has {target_draws.numel()} entries for a tree of {tree.num_nodes} nodes"
    )
    return greedy_walk(tree, target_draws.reshape(-1).tolist())


def _renormalize(r: Tensor, fallback: Tensor) -> Tensor:
    # The residual is empty only through rounding (a child with ratio 1 is always accepted);
    # keep the previous distribution then rather than divide by zero.
    s = r.sum()
    return r / s if s > 0 else fallback


def sample_from(p: Tensor, u: float) -> int:
    """Inverse-CDF sample from unnormalised p [V] with one uniform u in [0, 1).

    Tokens with p = 0 are never returned (the first cdf entry strictly above u * total).
    """
    cdf = p.cumsum(-1)
    idx = torch.searchsorted(cdf, cdf[-1:] * u, right=True)
    return min(int(idx), p.numel() - 1)


def verify_stochastic(
    tree: DraftTree,
    target_probs: Tensor,
    uniforms: Tensor | None = None,
    *,
    generator: torch.Generator | None = None,
    q_mode: QMode | str = QMode.ONE_HOT,
    threshold_single: float = 1.0,
    threshold_acc: float = 1.0,
) -> VerifyResult:
    """Multi-draft speculative sampling over the tree (SpecInfer), q_mode per the module docstring.

    target_probs: [N, V] processed target probabilities at every node. uniforms: [N] in [0, 1)
    (coin layout in the module docstring); drawn from `generator` when None.

    LOSSY options, off at their default 1.0 (SGLang's --speculative-accept-threshold-single/-acc):
    a child is also accepted when the target's original p(x) at its parent >= threshold_single,
    and the acceptance test becomes u < min(1, ratio / threshold_acc), ratio = p_i(x) / q(x).
    SGLang applies threshold_acc to the target mass accumulated over the siblings tried so far,
    with one coin per node: for one-hot q it accepts sibling i after i-1 rejections with
    probability p(x_i) / (t - acc), here p(x_i) / (t (1 - acc)) (acc = mass rejected so far).
    Both agree at t = 1 and on the first sibling, and both raise acceptance as t falls. We keep
    per-child coins because a shared coin is only exact for one-hot q, not for IID q.
    """
    mode = QMode(q_mode)
    n = tree.num_nodes
    assert target_probs.dim() == 2 and target_probs.shape[0] == n, (
        f"target_probs must be [N={n}, V], got {tuple(target_probs.shape)}"
    )
    assert mode is QMode.ONE_HOT or tree.draft_probs is not None, (
        f"q_mode={mode.value} needs draft_probs on the tree"
    )
    assert threshold_acc > 0, "threshold_acc must be > 0"
    if uniforms is None:
        uniforms = torch.rand(n, generator=generator, dtype=torch.float64)
    coins = uniforms.reshape(-1).tolist()
    assert len(coins) == n, f"need {n} uniforms, got {len(coins)}"
    tokens = tree.tokens.tolist()
    nodes, accepted = [0], []

    node = 0
    while True:
        p_orig = target_probs[node].to(torch.float64)  # [V] p at `node`, as the target gave it
        p = p_orig  # [V] current target: residual after the rejected siblings
        q = None if mode is QMode.ONE_HOT else tree.draft_probs[node].to(torch.float64)  # [V]
        nxt = -1
        for c in tree.children(node):
            x = tokens[c]
            if q is None:
                ratio = p[x].item()  # q(x) = 1
            else:
                qx = q[x].item()
                # x ~ q makes q(x) = 0 impossible; if the drafter lied, reject (p unchanged below).
                ratio = p[x].item() / qx if qx > 0 else 0.0
            if coins[c] < min(1.0, ratio / threshold_acc) or p_orig[x].item() >= threshold_single:
                nxt = c
                break
            if q is None:  # p <- normalize(max(p - onehot(x), 0)): zero x, renormalise
                r = p.clone()
                r[x] = 0.0
            else:  # p <- normalize(max(p - q, 0))
                r = torch.clamp(p - q, min=0.0)
            p = _renormalize(r, p)
            if mode is QMode.WITHOUT_REPLACEMENT:  # the next sibling was drawn with x removed
                q2 = q.clone()
                q2[x] = 0.0
                q = _renormalize(q2, q)
        if nxt < 0:
            # All children rejected (or a leaf: p is the target at the end of the path).
            return VerifyResult(nodes, accepted, sample_from(p, coins[0]))
        nodes.append(nxt)
        accepted.append(tokens[nxt])
        node = nxt


def verify_stochastic_batch(
    trees: list[DraftTree],
    target_probs_flat: Tensor,
    uniforms_flat: Tensor | None = None,
    *,
    generator: torch.Generator | None = None,
    q_mode: QMode | str = QMode.ONE_HOT,
    threshold_single: float = 1.0,
    threshold_acc: float = 1.0,
) -> list[VerifyResult]:
    """verify_stochastic over a batch. target_probs_flat: [sum N, V]; uniforms_flat: [sum N]."""
    total = sum(t.num_nodes for t in trees)
    assert target_probs_flat.shape[0] == total, (
        f"target_probs_flat has {target_probs_flat.shape[0]} rows, the trees {total} nodes"
    )
    if uniforms_flat is None:
        uniforms_flat = torch.rand(total, generator=generator, dtype=torch.float64)
    out, off = [], 0
    for t in trees:
        end = off + t.num_nodes
        out.append(
            verify_stochastic(
                t,
                target_probs_flat[off:end],
                uniforms_flat[off:end],
                q_mode=q_mode,
                threshold_single=threshold_single,
                threshold_acc=threshold_acc,
            )
        )
        off = end
    return out
