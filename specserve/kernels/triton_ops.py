"""Triton implementations of the speculative hot-path ops (the torch ones in
specserve/kernels/reference.py are their oracle): build_tree_masks, verify_tree_greedy,
tree_speculative_sampling (target-only and with the draft's q, every q mode) and commit_kv.

Registered for CUDA in the op registry (`specserve.kernels.registry.get(op, "cuda")` picks them
there); on the CPU the tests call them directly under Triton's interpreter (`TRITON_INTERPRET=1`,
set before triton is imported), which runs the kernels' exact indexing on CPU tensors
(tests/unit/test_triton_ops.py). Not yet run on a GPU.

Differences from the reference: no host-side precondition checks (a GPU op must not sync: the
trees must be topological with padding at the tail, as the reference asserts), and every
request's tree is walked by one program, its nodes one after another.
"""

from __future__ import annotations

import os

import torch
from torch import Tensor

from specserve.kernels.reference import TreeMasks, TreeVerifyOutput
from specserve.kernels.registry import register

try:
    import triton
    import triton.language as tl
except ImportError:
    triton = None


def triton_available() -> bool:
    return triton is not None


if triton is not None:

    @triton.jit
    def _tree_masks_kernel(PARENTS, SEQ_LENS, OFFSETS, MASK, POSITIONS, DEPTH, RINDEX, NEXT_TOKEN,
                           NEXT_SIBLING, M, BLOCK: tl.constexpr):
        b = tl.program_id(0)
        i = tl.program_id(1)
        row = PARENTS + b * M
        parent = tl.load(row + i)
        valid = (parent >= 0) | (i == 0)
        mask_row = MASK + (b * M + i) * M
        tl.store(mask_row + i, 1)
        anc = parent
        depth = parent * 0
        for _ in range(0, M):
            has = anc >= 0
            tl.store(mask_row + tl.maximum(anc, 0), 1, mask=has)
            depth += has.to(depth.dtype)
            anc = tl.where(has, tl.load(row + tl.maximum(anc, 0)), anc)
        js = tl.arange(0, BLOCK)
        pars = tl.load(row + js, mask=js < M, other=-2)
        big = M + BLOCK
        first_child = tl.min(tl.where(pars == i, js, big), 0)
        sib = (pars == parent) & (js > i) & (parent >= 0)
        first_sib = tl.min(tl.where(sib, js, big), 0)
        out = b * M + i
        tl.store(NEXT_TOKEN + out, tl.where(first_child < big, first_child, -1))
        tl.store(NEXT_SIBLING + out, tl.where(first_sib < big, first_sib, -1))
        tl.store(DEPTH + out, tl.where(valid, depth, 0))
        tl.store(POSITIONS + out, tl.where(valid, depth, 0) + tl.load(SEQ_LENS + b) - 1)
        tl.store(RINDEX + out, tl.where(valid, tl.load(OFFSETS + b) + i, -1))

    @triton.jit
    def _verify_greedy_kernel(CANDIDATES, RINDEX, NEXT_TOKEN, NEXT_SIBLING, TARGET, PREDICTS,
                              ACCEPT_INDEX, ACCEPT_NUM, M):
        b = tl.program_id(0)
        base = b * M
        cur = tl.load(RINDEX + base)
        child = tl.load(NEXT_TOKEN + base)
        tl.store(ACCEPT_INDEX + base, cur)
        num = child * 0
        for _ in range(0, M):
            active = child >= 0
            c = tl.maximum(child, 0)
            x = tl.load(CANDIDATES + base + c)
            want = tl.load(TARGET + cur)
            acc = active & (x == want)
            c_flat = tl.load(RINDEX + base + c)
            tl.store(PREDICTS + cur, x, mask=acc)
            num += acc.to(num.dtype)
            tl.store(ACCEPT_INDEX + base + num, c_flat, mask=acc)
            cur = tl.where(acc, c_flat, cur)
            nxt = tl.where(acc, tl.load(NEXT_TOKEN + base + c), tl.load(NEXT_SIBLING + base + c))
            child = tl.where(active, nxt, child)
        tl.store(PREDICTS + cur, tl.load(TARGET + cur))  # the bonus token after the path
        tl.store(ACCEPT_NUM + b, num)

    @triton.jit
    def _copy_row(SRC, DST, V, BLOCK_V: tl.constexpr):
        for start in range(0, V, BLOCK_V):
            offs = start + tl.arange(0, BLOCK_V)
            ok = offs < V
            tl.store(DST + offs, tl.load(SRC + offs, mask=ok, other=0.0).to(tl.float64), mask=ok)

    @triton.jit
    def _renormalize(ROW, V, X, DROP_X: tl.constexpr, SUB, SUBTRACT: tl.constexpr,
                     BLOCK_V: tl.constexpr):
        """ROW <- normalize(max(ROW - SUB, 0)) or ROW with X zeroed, normalized; unchanged
        when nothing is left (the reference's fallback)."""
        total = tl.zeros([BLOCK_V], dtype=tl.float64)
        for start in range(0, V, BLOCK_V):
            offs = start + tl.arange(0, BLOCK_V)
            ok = offs < V
            r = tl.load(ROW + offs, mask=ok, other=0.0)
            if SUBTRACT:
                r = tl.maximum(r - tl.load(SUB + offs, mask=ok, other=0.0), 0.0)
            if DROP_X:
                r = tl.where(offs == X, 0.0, r)
            total += r
        s = tl.sum(total, 0)
        if s > 0:
            for start in range(0, V, BLOCK_V):
                offs = start + tl.arange(0, BLOCK_V)
                ok = offs < V
                r = tl.load(ROW + offs, mask=ok, other=0.0)
                if SUBTRACT:
                    r = tl.maximum(r - tl.load(SUB + offs, mask=ok, other=0.0), 0.0)
                if DROP_X:
                    r = tl.where(offs == X, 0.0, r)
                tl.store(ROW + offs, r / s, mask=ok)

    @triton.jit
    def _tree_sampling_kernel(CANDIDATES, RINDEX, NEXT_TOKEN, NEXT_SIBLING, U, TARGET, DRAFT,
                              P_ORIG, P, Q, PREDICTS, ACCEPT_INDEX, ACCEPT_NUM, M, V,
                              thr_single, thr_acc, USE_Q: tl.constexpr, WOR: tl.constexpr,
                              BLOCK_V: tl.constexpr):
        b = tl.program_id(0)
        base = b * M
        p_orig, p, q = P_ORIG + b * V, P + b * V, Q + b * V
        cur = tl.load(RINDEX + base)
        child = tl.load(NEXT_TOKEN + base)
        tl.store(ACCEPT_INDEX + base, cur)
        _copy_row(TARGET + cur * V, p_orig, V, BLOCK_V)
        _copy_row(TARGET + cur * V, p, V, BLOCK_V)
        if USE_Q:
            _copy_row(DRAFT + cur * V, q, V, BLOCK_V)
        num = child * 0
        for _ in range(0, M):
            active = child >= 0
            c = tl.maximum(child, 0)
            x = tl.maximum(tl.load(CANDIDATES + base + c), 0)
            px = tl.load(p + x)
            if USE_Q:
                qx = tl.load(q + x)
                ratio = tl.where(qx > 0, px / tl.where(qx > 0, qx, 1.0), 0.0)
            else:
                ratio = px
            coin = tl.load(U + base + c).to(tl.float64)
            ok = (coin < tl.minimum(ratio / thr_acc, 1.0)) | (tl.load(p_orig + x) >= thr_single)
            acc = active & ok
            rej = active & (not ok)
            if rej:
                _renormalize(p, V, x, not USE_Q, q, USE_Q, BLOCK_V)
                if WOR:
                    _renormalize(q, V, x, True, q, False, BLOCK_V)
            c_flat = tl.load(RINDEX + base + c)
            if acc:
                tl.store(PREDICTS + cur, x.to(tl.int64))
                num += 1
                tl.store(ACCEPT_INDEX + base + num, c_flat)
                cur = c_flat
                _copy_row(TARGET + cur * V, p_orig, V, BLOCK_V)
                _copy_row(TARGET + cur * V, p, V, BLOCK_V)
                if USE_Q:
                    _copy_row(DRAFT + cur * V, q, V, BLOCK_V)
            nxt = tl.where(acc, tl.load(NEXT_TOKEN + base + c), tl.load(NEXT_SIBLING + base + c))
            child = tl.where(active, nxt, child)
        # the final token: inverse CDF of what is left of p, with the root's coin
        total = tl.zeros([BLOCK_V], dtype=tl.float64)
        for start in range(0, V, BLOCK_V):
            offs = start + tl.arange(0, BLOCK_V)
            total += tl.load(p + offs, mask=offs < V, other=0.0)
        threshold = tl.sum(total, 0) * tl.load(U + base).to(tl.float64)
        running = tl.sum(total * 0.0, 0)
        count = num * 0
        for start in range(0, V, BLOCK_V):
            offs = start + tl.arange(0, BLOCK_V)
            ok = offs < V
            cdf = running + tl.cumsum(tl.load(p + offs, mask=ok, other=0.0), 0)
            count += tl.sum((ok & (cdf <= threshold)).to(count.dtype), 0)
            running = tl.max(tl.where(ok, cdf, running), 0)
        tl.store(PREDICTS + cur, tl.minimum(count, V - 1).to(tl.int64))
        tl.store(ACCEPT_NUM + b, num)

    @triton.jit
    def _copy_rows_kernel(SRC, DST, SRC_ROWS, DST_ROWS, ROW, BLOCK: tl.constexpr):
        r = tl.program_id(0)
        s = tl.load(SRC_ROWS + r).to(tl.int64)
        d = tl.load(DST_ROWS + r).to(tl.int64)
        for start in range(0, ROW, BLOCK):
            offs = start + tl.arange(0, BLOCK)
            ok = offs < ROW
            tl.store(DST + d * ROW + offs, tl.load(SRC + s * ROW + offs, mask=ok), mask=ok)


def build_tree_masks(parents: Tensor, seq_lens: Tensor) -> TreeMasks:
    """specserve.kernels.reference.build_tree_masks, one program per (request, node)."""
    bsz, width = parents.shape
    dev = parents.device
    parents = parents.to(torch.int64).contiguous()
    idx = torch.arange(width, device=dev)
    num_nodes = ((parents >= 0) | (idx == 0)).sum(1)
    offsets = (torch.cumsum(num_nodes, 0) - num_nodes).contiguous()
    mask = torch.zeros((bsz, width, width), dtype=torch.bool, device=dev)
    out = [torch.empty((bsz, width), dtype=torch.int64, device=dev) for _ in range(5)]
    positions, depth, rindex, next_token, next_sibling = out
    _tree_masks_kernel[(bsz, width)](
        parents, seq_lens.to(dev, torch.int64).contiguous(), offsets, mask, positions, depth,
        rindex, next_token, next_sibling, width, BLOCK=triton.next_power_of_2(width))
    return TreeMasks(mask, positions, depth, rindex, next_token, next_sibling, num_nodes)


def verify_tree_greedy(candidates: Tensor, retrive_index: Tensor, retrive_next_token: Tensor,
                       retrive_next_sibling: Tensor, target_predict: Tensor) -> TreeVerifyOutput:
    """specserve.kernels.reference.verify_tree_greedy, one program per request."""
    bsz, width = candidates.shape
    dev = candidates.device
    predicts = torch.full((target_predict.shape[0],), -1, dtype=torch.int64, device=dev)
    accept_index = torch.full((bsz, width), -1, dtype=torch.int64, device=dev)
    accept_num = torch.zeros(bsz, dtype=torch.int64, device=dev)
    _verify_greedy_kernel[(bsz,)](
        candidates.to(torch.int64).contiguous(), retrive_index.contiguous(),
        retrive_next_token.contiguous(), retrive_next_sibling.contiguous(),
        target_predict.to(torch.int64).contiguous(), predicts, accept_index, accept_num, width)
    return TreeVerifyOutput(predicts, accept_index, accept_num)


def tree_speculative_sampling(
    candidates: Tensor, retrive_index: Tensor, retrive_next_token: Tensor,
    retrive_next_sibling: Tensor, uniforms: Tensor, target_probs: Tensor,
    draft_probs: Tensor | None = None, q_mode: str = "one_hot", threshold_single: float = 1.0,
    threshold_acc: float = 1.0,
) -> TreeVerifyOutput:
    """specserve.kernels.reference.tree_speculative_sampling, one program per request; the residual
    distributions live in float64 scratch rows [B, V] (the reference's precision)."""
    assert q_mode in ("one_hot", "iid", "without_replacement"), f"unknown q_mode {q_mode!r}"
    use_q = q_mode != "one_hot"
    assert not use_q or draft_probs is not None, f"q_mode={q_mode} needs draft_probs"
    bsz, width = candidates.shape
    vocab = target_probs.shape[1]
    dev = candidates.device
    predicts = torch.full((target_probs.shape[0],), -1, dtype=torch.int64, device=dev)
    accept_index = torch.full((bsz, width), -1, dtype=torch.int64, device=dev)
    accept_num = torch.zeros(bsz, dtype=torch.int64, device=dev)
    scratch = torch.zeros((3, bsz, vocab), dtype=torch.float64, device=dev)
    target = target_probs.contiguous()
    draft = draft_probs.contiguous() if use_q else target
    _tree_sampling_kernel[(bsz,)](
        candidates.to(torch.int64).contiguous(), retrive_index.contiguous(),
        retrive_next_token.contiguous(), retrive_next_sibling.contiguous(),
        uniforms.to(dev, torch.float64).contiguous(), target, draft, scratch[0], scratch[1],
        scratch[2], predicts, accept_index, accept_num, width, vocab, float(threshold_single),
        float(threshold_acc), USE_Q=use_q, WOR=q_mode == "without_replacement",
        BLOCK_V=min(1024, triton.next_power_of_2(vocab)))
    return TreeVerifyOutput(predicts, accept_index, accept_num)


def commit_kv(k_layers: list[Tensor], v_layers: list[Tensor], src: Tensor, dst: Tensor) -> None:
    """specserve.kernels.reference.commit_kv: gather every src row first, then scatter to dst."""
    if src.numel() == 0:
        return
    src = src.to(torch.int64).contiguous()
    dst = dst.to(torch.int64).contiguous()
    n = src.numel()
    for pool in (*k_layers, *v_layers):
        row = pool[0].numel()
        tmp = torch.empty((n, *pool.shape[1:]), dtype=pool.dtype, device=pool.device)
        ident = torch.arange(n, device=pool.device)
        block = min(1024, triton.next_power_of_2(row))
        _copy_rows_kernel[(n,)](pool, tmp, src, ident, row, BLOCK=block)
        _copy_rows_kernel[(n,)](tmp, pool, ident, dst, row, BLOCK=block)


if triton is not None:
    # On CUDA the registry picks these first. Under TRITON_INTERPRET=1 they run on CPU tensors
    # too, registered device-agnostic: after the torch references, so only a caller that asks
    # for backend "triton" gets them there (the tests, `--speculative-tree-ops triton`).
    _INTERPRET = os.environ.get("TRITON_INTERPRET") == "1"

    def _runs_here() -> bool:
        return _INTERPRET or torch.cuda.is_available()

    for _name, _fn in (("build_tree_masks", build_tree_masks),
                       ("verify_tree_greedy", verify_tree_greedy),
                       ("tree_speculative_sampling", tree_speculative_sampling),
                       ("commit_kv", commit_kv)):
        register(_name, "triton", _fn, available=_runs_here,
                 device_types=None if _INTERPRET else ("cuda",))
