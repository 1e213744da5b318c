"""Torch reference implementations of the tree ops (any device; the oracle for faster backends).

Tensor-form, batched, in sgl-kernel's vocabulary. B requests, M = padded nodes per request,
T = total real nodes in the flat (packed) arrays. Request b's nodes are local indices 0..n_b-1
(tail padding after), node 0 the root. Link tables are [B, M] int64, -1 = none:
  retrive_index[b, i]        flat index of node i in the [T] / [T, V] arrays
  retrive_next_token[b, i]   local index of node i's first child
  retrive_next_sibling[b, i] local index of node i's next sibling (siblings by ascending index)
The verify ops walk all requests in lockstep: each loop round tests one node per request, and a
walk never tests a node twice, so M rounds suffice. They return tensors instead of mutating
arguments, and agree with specserve.speculative.verify (same coin layout, float64 math).
"""

from __future__ import annotations

from typing import NamedTuple

import torch
from torch import Tensor

from specserve.kernels.registry import register


class TreeMasks(NamedTuple):
    tree_mask: Tensor  # [B, M, M] bool, ancestors-or-self (padding rows: self only)
    positions: Tensor  # [B, M] int64, seq_len - 1 + depth (root at prefix_len)
    depth: Tensor  # [B, M] int64 (0 on padding)
    retrive_index: Tensor  # [B, M] int64
    retrive_next_token: Tensor  # [B, M] int64
    retrive_next_sibling: Tensor  # [B, M] int64
    num_nodes: Tensor  # [B] int64


def build_tree_masks(parents: Tensor, seq_lens: Tensor) -> TreeMasks:
    """Masks, positions and links for a batch of trees.

    parents: [B, M] int64 local parent indices, topological (parents[b, i] < i), parents[b, 0] = -1;
    a node i > 0 with parent -1 is padding and must come after every real node.
    seq_lens: [B] tokens so far including the root (see specserve.speculative.tree).
    """
    bsz, width = parents.shape
    dev = parents.device
    parents = parents.to(torch.int64)
    idx = torch.arange(width, device=dev)
    valid = (parents >= 0) | (idx == 0)  # [B, M]
    num_nodes = valid.sum(dim=1)
    assert bool((valid == (idx < num_nodes[:, None])).all()), "padding must be at the tail"
    assert bool((parents < idx).all()), "parents must be topological: parents[b, i] < i"

    # Walk every node up one level per round, marking each ancestor met (rounds = max depth).
    mask = torch.eye(width, dtype=torch.bool, device=dev).expand(bsz, width, width).clone()
    anc = parents.clone()  # [B, M] current ancestor of each node, -1 once past the root
    depth = torch.zeros(bsz, width, dtype=torch.int64, device=dev)
    for _ in range(width):
        has = anc >= 0
        if not bool(has.any()):
            break
        depth += has.long()
        b_idx, i_idx = has.nonzero(as_tuple=True)
        mask[b_idx, i_idx, anc[b_idx, i_idx]] = True
        anc = torch.where(has, parents.gather(1, anc.clamp(min=0)), anc)

    # child[b, i, j]: j is a child of i; sib[b, i, j]: j > i shares i's parent.
    child = parents[:, None, :] == idx[None, :, None]
    sib = (parents[:, None, :] == parents[:, :, None]) & (idx[None, None, :] > idx[None, :, None])
    sib &= (parents >= 0)[:, :, None]
    # argmax over bool (as uint8) returns the first True index, i.e. the lowest-index one.
    next_token = torch.where(child.any(-1), child.to(torch.uint8).argmax(-1), -1)
    next_sibling = torch.where(sib.any(-1), sib.to(torch.uint8).argmax(-1), -1)

    offsets = torch.cumsum(num_nodes, 0) - num_nodes  # [B] flat offset of each root
    retrive_index = torch.where(valid, offsets[:, None] + idx[None, :], -1)
    positions = depth + (seq_lens.to(dev, torch.int64)[:, None] - 1)
    return TreeMasks(mask, positions, depth, retrive_index, next_token, next_sibling, num_nodes)


class TreeVerifyOutput(NamedTuple):
    predicts: Tensor  # [T] int64: at an accepted node's flat index the token after it; else -1
    accept_index: Tensor  # [B, M] int64 flat indices of the accepted path, root first, -1 padded
    accept_token_num: Tensor  # [B] int64 accepted draft tokens (root excluded)


def verify_tree_greedy(
    candidates: Tensor,
    retrive_index: Tensor,
    retrive_next_token: Tensor,
    retrive_next_sibling: Tensor,
    target_predict: Tensor,
) -> TreeVerifyOutput:
    """Greedy tree verify. candidates: [B, M] tokens; target_predict: [T] target argmax per node.

    The tokens a request gains are predicts[accept_index[b, :accept_token_num[b] + 1]].
    """
    bsz, width = candidates.shape
    dev = candidates.device
    rows = torch.arange(bsz, device=dev)
    predicts = torch.full_like(target_predict, -1, dtype=torch.int64)
    accept_index = torch.full((bsz, width), -1, dtype=torch.int64, device=dev)
    accept_index[:, 0] = retrive_index[:, 0]
    num_acc = torch.zeros(bsz, dtype=torch.int64, device=dev)
    cur_flat = retrive_index[:, 0].clone()  # [B] flat index of the last accepted node
    child = retrive_next_token[:, 0].clone()  # [B] local index of the child under test
    for _ in range(width):
        active = child >= 0
        if not bool(active.any()):
            break
        c = child.clamp(min=0)
        x = candidates[rows, c]
        want = target_predict[cur_flat].to(torch.int64)  # target argmax after the current path
        acc = active & (x == want)
        predicts[cur_flat[acc]] = x[acc]
        num_acc += acc.long()
        accept_index[rows[acc], num_acc[acc]] = retrive_index[rows[acc], c[acc]]
        cur_flat = torch.where(acc, retrive_index[rows, c], cur_flat)
        nxt = torch.where(acc, retrive_next_token[rows, c], retrive_next_sibling[rows, c])
        child = torch.where(active, nxt, child)
    predicts[cur_flat] = target_predict[cur_flat].to(torch.int64)  # bonus token
    return TreeVerifyOutput(predicts, accept_index, num_acc)


def _renormalize_rows(r: Tensor, fallback: Tensor) -> Tensor:
    s = r.sum(-1, keepdim=True)
    return torch.where(s > 0, r / torch.where(s > 0, s, 1.0), fallback)


def tree_speculative_sampling(
    candidates: Tensor,
    retrive_index: Tensor,
    retrive_next_token: Tensor,
    retrive_next_sibling: Tensor,
    uniforms: Tensor,
    target_probs: Tensor,
    draft_probs: Tensor | None = None,
    q_mode: str = "one_hot",
    threshold_single: float = 1.0,
    threshold_acc: float = 1.0,
) -> TreeVerifyOutput:
    """Stochastic tree verify (SpecInfer), the tensor form of
    specserve.speculative.verify.verify_stochastic.

    uniforms: [B, M], uniforms[b, i] tests node i, uniforms[b, 0] drives the final sample.
    target_probs / draft_probs: [T, V] at each node; q_mode "one_hot" | "iid" |
    "without_replacement" (see specserve.speculative.verify for when each is lossless). Thresholds
    below 1 are LOSSY (SGLang's accept thresholds).
    """
    assert q_mode in ("one_hot", "iid", "without_replacement"), f"unknown q_mode {q_mode!r}"
    use_q = q_mode != "one_hot"
    assert not use_q or draft_probs is not None, f"q_mode={q_mode} needs draft_probs"
    bsz, width = candidates.shape
    dev = candidates.device
    rows = torch.arange(bsz, device=dev)
    coins = uniforms.to(dev, torch.float64)
    predicts = torch.full((target_probs.shape[0],), -1, dtype=torch.int64, device=dev)
    accept_index = torch.full((bsz, width), -1, dtype=torch.int64, device=dev)
    accept_index[:, 0] = retrive_index[:, 0]
    num_acc = torch.zeros(bsz, dtype=torch.int64, device=dev)
    cur_flat = retrive_index[:, 0].clone()
    child = retrive_next_token[:, 0].clone()
    p_orig = target_probs[cur_flat].to(torch.float64)  # [B, V] p at the current node
    p = p_orig  # [B, V] residual target after the siblings rejected so far
    q = draft_probs[cur_flat].to(torch.float64) if use_q else None  # [B, V]
    for _ in range(width):
        active = child >= 0
        if not bool(active.any()):
            break
        c = child.clamp(min=0)
        x = candidates[rows, c].clamp(min=0)[:, None]  # [B, 1]
        px = p.gather(1, x)[:, 0]
        if use_q:
            qx = q.gather(1, x)[:, 0]
            ratio = torch.where(qx > 0, px / torch.where(qx > 0, qx, 1.0), 0.0)
        else:
            ratio = px  # q(x) = 1
        ok = coins[rows, c] < torch.clamp(ratio / threshold_acc, max=1.0)
        ok |= p_orig.gather(1, x)[:, 0] >= threshold_single
        acc, rej = active & ok, active & ~ok

        # Rejected rows: p <- normalize(max(p - q, 0)), q one-hot at x when use_q is off.
        if use_q:
            r = torch.clamp(p - q, min=0.0)
        else:
            r = p.scatter(1, x, 0.0)
        p = torch.where(rej[:, None], _renormalize_rows(r, p), p)
        if q_mode == "without_replacement":
            q = torch.where(rej[:, None], _renormalize_rows(q.scatter(1, x, 0.0), q), q)

        # Accepted rows: record x after the current node, descend, restart p (and q) there.
        c_flat = retrive_index[rows, c]
        predicts[cur_flat[acc]] = x[acc, 0]
        num_acc += acc.long()
        accept_index[rows[acc], num_acc[acc]] = c_flat[acc]
        cur_flat = torch.where(acc, c_flat, cur_flat)
        if bool(acc.any()):
            p_orig = torch.where(acc[:, None], target_probs[cur_flat].to(torch.float64), p_orig)
            p = torch.where(acc[:, None], p_orig, p)
            if use_q:
                q = torch.where(acc[:, None], draft_probs[cur_flat].to(torch.float64), q)
        nxt = torch.where(acc, retrive_next_token[rows, c], retrive_next_sibling[rows, c])
        child = torch.where(active, nxt, child)

    # Final token: inverse-CDF sample from the remaining p with the root coin.
    cdf = p.cumsum(-1)
    bonus = torch.searchsorted(cdf, cdf[:, -1:] * coins[:, :1], right=True)[:, 0]
    predicts[cur_flat] = bonus.clamp(max=p.shape[1] - 1)
    return TreeVerifyOutput(predicts, accept_index, num_acc)


def pack_tree_mask(mask: Tensor) -> Tensor:
    """Bit-pack a bool mask [..., R, C] into uint8 [..., R, ceil(C / 8)], little bit order.

    Column j of a row lands in bit (j % 8) of byte j // 8 (FlashInfer's packbits "little").
    """
    cols = mask.shape[-1]
    nbytes = (cols + 7) // 8
    padded = torch.nn.functional.pad(mask.to(torch.uint8), (0, nbytes * 8 - cols))
    bits = padded.reshape(*mask.shape[:-1], nbytes, 8)
    weights = (1 << torch.arange(8, device=mask.device, dtype=torch.int32)).to(torch.uint8)
    return (bits * weights).sum(-1, dtype=torch.int32).to(torch.uint8)


def unpack_tree_mask(packed: Tensor, num_cols: int) -> Tensor:
    """Inverse of pack_tree_mask: uint8 [..., R, ceil(C / 8)] -> bool [..., R, num_cols]."""
    shifts = torch.arange(8, device=packed.device, dtype=torch.uint8)
    bits = (packed[..., None] >> shifts) & 1  # [..., R, nbytes, 8]
    return bits.reshape(*packed.shape[:-1], -1)[..., :num_cols].bool()


def commit_kv(k_layers: list[Tensor], v_layers: list[Tensor], src: Tensor, dst: Tensor) -> None:
    """Move KV rows in place, every layer: pool[dst[i]] = pool[src[i]] (all rows read before any
    is written, so src and dst may overlap). The accepted path's KV to its committed slots."""
    for pool in (*k_layers, *v_layers):
        pool[dst] = pool.index_select(0, src)


for _name, _fn in (
    ("build_tree_masks", build_tree_masks),
    ("commit_kv", commit_kv),
    ("verify_tree_greedy", verify_tree_greedy),
    ("tree_speculative_sampling", tree_speculative_sampling),
    ("pack_tree_mask", pack_tree_mask),
    ("unpack_tree_mask", unpack_tree_mask),
):
    register(_name, "torch", _fn)
