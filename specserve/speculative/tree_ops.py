"""Batched tree verification through the op registry's tensor-form ops (`specserve/kernels/`).

The speculative worker verifies a step's trees in one of two ways, with the same results bit for
bit:

- `walk` (the CPU default): each tree is walked in Python (`specserve.speculative.verify`). For a
  handful of trees of 4-12 nodes on the CPU that is the cheapest form: a few list lookups per node.
- the tensor form (the default on CUDA): the batch's trees become padded [B, M] tensors (tokens,
  parents), `build_tree_masks` derives the first-child / next-sibling links, and ONE
  `verify_tree_greedy` (greedy and seeded requests: the target's token per node is its argmax or
  its seeded draw) or `tree_speculative_sampling` (unseeded sampled requests) call verifies every
  tree; the host reads the accepted paths back once. On CUDA the registry picks the Triton ops
  (`specserve/kernels/triton_ops.py`), so a step costs no per-node host syncs; anywhere the torch
  references (`specserve/kernels/reference.py`) run.

`--speculative-tree-ops auto|walk|torch|triton` picks the form: `auto` is the registry's best op
on CUDA and the walk elsewhere; `torch` / `triton` name a registry backend (the Triton ops also
run on CPU tensors under `TRITON_INTERPRET=1`, which is how the tests prove them in a server).
"""

from __future__ import annotations

from collections.abc import Sequence

import torch
from torch import Tensor

from specserve.kernels import registry
from specserve.speculative.tree import DraftTree
from specserve.speculative.verify import QMode, VerifyResult

CHOICES = ("auto", "walk", "torch", "triton")


class TreeOps:
    """The registry's tree ops of one backend on one device, applied to lists of DraftTrees."""

    def __init__(self, backend: str | None, device: torch.device | str) -> None:
        self.device = torch.device(device)
        self.backend = backend
        self._masks = registry.get("build_tree_masks", self.device, backend)
        self._greedy = registry.get("verify_tree_greedy", self.device, backend)
        self._sampling = registry.get("tree_speculative_sampling", self.device, backend)

    def describe(self) -> str:
        return f"tensor ops ({self.backend or 'best'} on {self.device.type})"

    def _links(self, trees: Sequence[DraftTree]) -> tuple[Tensor, Tensor, Tensor, Tensor]:
        """candidates [B, M] and retrive_index / next_token / next_sibling [B, M]."""
        width = max(t.num_nodes for t in trees)
        cand = torch.zeros((len(trees), width), dtype=torch.int64)
        parents = torch.full((len(trees), width), -1, dtype=torch.int64)
        for b, t in enumerate(trees):
            cand[b, : t.num_nodes] = t.tokens
            parents[b, : t.num_nodes] = t.parents
        # seq_lens only feed positions, which verification does not read
        ones = torch.ones(len(trees), dtype=torch.int64, device=self.device)
        m = self._masks(parents.to(self.device), ones)
        return cand.to(self.device), m.retrive_index, m.retrive_next_token, m.retrive_next_sibling

    @staticmethod
    def _results(trees: Sequence[DraftTree], out) -> list[VerifyResult]:
        """VerifyResults from a TreeVerifyOutput: one host transfer for the batch."""
        predicts = out.predicts.cpu().tolist()
        index = out.accept_index.cpu().tolist()
        num = out.accept_token_num.cpu().tolist()
        results, off = [], 0
        for b, t in enumerate(trees):
            flat = index[b][: num[b] + 1]
            nodes = [f - off for f in flat]
            gained = [predicts[f] for f in flat]  # the token after each path node
            results.append(VerifyResult(nodes, gained[:-1], gained[-1]))
            off += t.num_nodes
        return results

    def walk_tokens(self, trees: Sequence[DraftTree], target_tokens: Tensor) -> list[VerifyResult]:
        """`verify_greedy` / `verify_seeded` over a batch: target_tokens [sum N] is the target's
        own token at every node (its argmax, or its seeded draw), trees in order."""
        if not trees:
            return []
        cand, rindex, nxt, sib = self._links(trees)
        out = self._greedy(cand, rindex, nxt, sib, target_tokens.to(self.device, torch.int64))
        return self._results(trees, out)

    def sample(self, trees: Sequence[DraftTree], target_probs: Tensor, uniforms: list[Tensor],
               q_mode: QMode | str = QMode.ONE_HOT, threshold_single: float = 1.0,
               threshold_acc: float = 1.0) -> list[VerifyResult]:
        """`verify_stochastic` over a batch with one q_mode: target_probs [sum N, V] processed
        p at every node, uniforms[b] [N_b] the coins `verify_stochastic` would take."""
        if not trees:
            return []
        mode = QMode(q_mode)
        cand, rindex, nxt, sib = self._links(trees)
        coins = torch.zeros(cand.shape, dtype=torch.float64)
        for b, u in enumerate(uniforms):
            coins[b, : u.numel()] = u.reshape(-1).cpu()
        draft = None
        if mode is not QMode.ONE_HOT:
            draft = torch.cat([t.draft_probs for t in trees]).to(self.device)
        out = self._sampling(cand, rindex, nxt, sib, coins.to(self.device),
                             target_probs.to(self.device), draft, mode.value,
                             threshold_single, threshold_acc)
        return self._results(trees, out)


def make_tree_ops(choice: str, device: torch.device | str) -> TreeOps | None:
    """None for the per-tree Python walk, else the registry's ops (see the module docstring)."""
    assert choice in CHOICES, f"unknown tree ops {choice!r}; choose one of {CHOICES}"
    dev = torch.device(device)
    if choice == "walk" or (choice == "auto" and dev.type == "cpu"):
        return None
    return TreeOps(None if choice == "auto" else choice, dev)
