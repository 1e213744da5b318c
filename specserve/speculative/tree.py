"""Draft trees: one request's speculative candidates, and a batch of them packed for one forward.

Position convention (used by `DraftTree.positions` and `pack_trees`):

    seq_len    = tokens the request holds so far, prompt + verified output, INCLUDING the root
    prefix_len = seq_len - 1 = tokens whose KV is already in the cache

The root (node 0) is the last verified token. Its KV is NOT in the cache yet: it is fed as node 0 of
the verify forward, so the root sits at position prefix_len = seq_len - 1 and a node at depth d at
seq_len - 1 + d. (SGLang's verify `seq_lens` counts cached tokens, i.e. our prefix_len.)
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass, field

import torch
from torch import Tensor


def _as_long(x: Tensor | Sequence[int], name: str) -> Tensor:
    t = x if isinstance(x, Tensor) else torch.tensor(list(x), dtype=torch.int64)
    assert t.dim() == 1, f"{name} must be 1-D, got shape {tuple(t.shape)}"
    return t.to(torch.int64)


_ROOT_PARENTS = torch.tensor([-1], dtype=torch.int64)  # read only
_ROOT_MASK = torch.ones(1, 1, dtype=torch.bool)  # read only


def _check_topology(n: int, parents: list[int]) -> None:
    """A tree of n nodes in topological order: node 0 the root (parent -1), parents[i] < i."""
    assert n >= 1, "a draft tree has at least the root"
    assert len(parents) == n, f"tokens and parents differ in length: {n} vs {len(parents)}"
    assert parents[0] == -1, f"node 0 is the root, its parent must be -1, got {parents[0]}"
    for i in range(1, n):
        assert 0 <= parents[i] < i, (
            f"node {i}: parent {parents[i]} breaks topological order (need 0 <= parent < {i})"
        )


@dataclass(slots=True, eq=False)
class DraftTree:
    """One request's draft tree, nodes in topological order (parents[i] < i).

    tokens:      [N] int64, node 0 = root = the last verified token.
    parents:     [N] int64, parents[0] = -1.
    draft_probs: [N, V] or None. Row i is the drafter's distribution q *at* node i, i.e. over the
                 children of node i (what verifying those children needs). None for deterministic
                 drafters (n-gram, prompt lookup): their q is one-hot at each drafted token.

    Derived data (depth, links, ancestor mask) is computed on first use and cached.
    """

    tokens: Tensor
    parents: Tensor
    draft_probs: Tensor | None = None
    _parent_list: list[int] = field(init=False, repr=False)
    _links: tuple[list[int], list[int], list[int]] | None = field(
        default=None, init=False, repr=False
    )
    _depth: Tensor | None = field(default=None, init=False, repr=False)
    _first_child: Tensor | None = field(default=None, init=False, repr=False)
    _next_sibling: Tensor | None = field(default=None, init=False, repr=False)
    _mask: Tensor | None = field(default=None, init=False, repr=False)
    _token_list: list[int] | None = field(default=None, init=False, repr=False)

    def __post_init__(self) -> None:
        self.tokens = _as_long(self.tokens, "tokens")
        self.parents = _as_long(self.parents, "parents")
        n = self.tokens.numel()
        par = self.parents.tolist()
        _check_topology(n, par)
        if self.draft_probs is not None:
            assert self.draft_probs.dim() == 2 and self.draft_probs.shape[0] == n, (
                f"draft_probs must be [N={n}, V], got {tuple(self.draft_probs.shape)}"
            )
        self._parent_list = par

    @classmethod
    def chain(
        cls,
        root_token: int,
        draft_tokens: Sequence[int] | Tensor,
        draft_probs: Tensor | None = None,
    ) -> DraftTree:
        """A chain (top-k = 1): root -> d0 -> d1 -> ...; a tree whose nodes each have one child."""
        drafts = _as_long(draft_tokens, "draft_tokens")
        tokens = torch.cat([torch.tensor([root_token], dtype=torch.int64), drafts])
        parents = torch.arange(-1, drafts.numel(), dtype=torch.int64)
        return cls(tokens, parents, draft_probs)

    @classmethod
    def root(cls, root_token: int) -> DraftTree:
        """The one-node tree of a step without a draft (every request of every plain step of a
        speculative server: built without the general validation, which is for drafters'
        trees)."""
        t = object.__new__(cls)
        root_token = int(root_token)
        t.parents = _ROOT_PARENTS  # (tokens: a tensor on first use, __getattr__)
        t.draft_probs = None
        t._parent_list = [-1]
        t._links = ([0], [-1], [-1])
        t._depth = t._first_child = t._next_sibling = None
        t._mask = _ROOT_MASK
        t._token_list = [root_token]
        return t

    @classmethod
    def from_parents(
        cls,
        tokens: Sequence[int] | Tensor,
        parents: Sequence[int] | Tensor,
        draft_probs: Tensor | None = None,
    ) -> DraftTree:
        """Build and validate a tree from token and parent arrays (asserts on malformed input)."""
        if type(tokens) is list and type(parents) is list and draft_probs is None:
            if len(tokens) == 1 and parents == [-1]:
                return cls.root(tokens[0])  # (most trees of a busy batch)
            return cls._from_lists(tokens, parents)
        return cls(_as_long(tokens, "tokens"), _as_long(parents, "parents"), draft_probs)

    @classmethod
    def _from_lists(cls, tokens: list[int], parents: list[int]) -> DraftTree:
        # What the n-gram and suffix drafters hand over each step: the same checks as
        # __post_init__, on the lists, then one tensor each and the lists kept (no tensor ->
        # list round trips in the worker's bookkeeping).
        _check_topology(len(tokens), parents)
        t = object.__new__(cls)
        t.draft_probs = None  # (tokens, parents: tensors on first use, __getattr__)
        t._parent_list = list(parents)
        t._links = t._depth = t._first_child = t._next_sibling = t._mask = None
        t._token_list = [int(x) for x in tokens]
        return t

    def __getattr__(self, name: str):
        # `tokens` / `parents` of a tree built from lists (`root`, `_from_lists`) become tensors
        # on first use: the worker reads most trees of a step only as lists, and a small torch
        # op right after a forward costs 20-60 us (python -m benchmark.bench_step_bookkeeping)
        if name == "tokens":
            self.tokens = torch.tensor(self._token_list, dtype=torch.int64)
            return self.tokens
        if name == "parents":
            self.parents = torch.tensor(self._parent_list, dtype=torch.int64)
            return self.parents
        raise AttributeError(f"{type(self).__name__!r} object has no attribute {name!r}")

    @property
    def token_list(self) -> list[int]:
        """The tokens as a Python list (kept from construction or converted once; read only)."""
        if self._token_list is None:
            self._token_list = self.tokens.tolist()
        return self._token_list

    @property
    def num_nodes(self) -> int:
        return len(self._parent_list)

    def _link_lists(self) -> tuple[list[int], list[int], list[int]]:
        # One pass in topological order; iterating i upward orders siblings by node index.
        if self._links is None:
            n = self.num_nodes
            depth, first_child, next_sibling = [0] * n, [-1] * n, [-1] * n
            last_child = [-1] * n
            for i in range(1, n):
                p = self._parent_list[i]
                depth[i] = depth[p] + 1
                if last_child[p] < 0:
                    first_child[p] = i
                else:
                    next_sibling[last_child[p]] = i
                last_child[p] = i
            self._links = (depth, first_child, next_sibling)
        return self._links

    @property
    def depth_list(self) -> list[int]:
        """Each node's depth, root 0, as a Python list (read only)."""
        return self._link_lists()[0]

    @property
    def depth(self) -> Tensor:
        """[N] int64, root 0."""
        if self._depth is None:
            self._depth = torch.tensor(self._link_lists()[0], dtype=torch.int64)
        return self._depth

    @property
    def first_child(self) -> Tensor:
        """[N] int64, lowest-index child of each node, -1 for leaves."""
        if self._first_child is None:
            self._first_child = torch.tensor(self._link_lists()[1], dtype=torch.int64)
        return self._first_child

    @property
    def next_sibling(self) -> Tensor:
        """[N] int64, next child (by index) of the same parent, -1 for the last; root has -1."""
        if self._next_sibling is None:
            self._next_sibling = torch.tensor(self._link_lists()[2], dtype=torch.int64)
        return self._next_sibling

    def children(self, node: int) -> list[int]:
        """Children of `node` in sibling order (ascending node index)."""
        _, first_child, next_sibling = self._link_lists()
        out, c = [], first_child[node]
        while c >= 0:
            out.append(c)
            c = next_sibling[c]
        return out

    @property
    def ancestor_mask(self) -> Tensor:
        """[N, N] bool: mask[i, j] iff j is i or an ancestor of i (what node i may attend to)."""
        if self._mask is None:
            # rows as Python lists, one tensor at the end (a torch op per row cost more than
            # the rest of a small tree's verify bookkeeping)
            n = self.num_nodes
            rows = [[False] * n]
            rows[0][0] = True
            for i in range(1, n):  # parent row is final before its children (topological order)
                row = rows[self._parent_list[i]].copy()
                row[i] = True
                rows.append(row)
            self._mask = torch.tensor(rows, dtype=torch.bool)
        return self._mask

    def path_tokens(self) -> tuple[Tensor, Tensor]:
        """(node, token) pairs, [K] int64 each: every node with each draft token on its path
        below the root (its ancestors-or-self except node 0). Node u's prediction follows the
        request's history plus exactly these tokens (history-dependent processing, penalties)."""
        node, anc = torch.nonzero(self.ancestor_mask[:, 1:], as_tuple=True)
        return node, self.tokens[1:][anc]

    def positions(self, seq_len: int) -> Tensor:
        """[N] int64 positions: seq_len - 1 + depth (root at prefix_len, see module docstring)."""
        assert seq_len >= 1, f"seq_len counts the root, so it is >= 1, got {seq_len}"
        return self.depth + (seq_len - 1)


@dataclass(slots=True, eq=False)
class PackedTrees:
    """A batch of draft trees flattened for one TARGET_VERIFY forward and the batched verify.

    T = sum of num_nodes, B = batch size, M = max num_nodes. Flat arrays hold request b's nodes at
    [qo_indptr[b], qo_indptr[b+1]). The [B, M] link tables follow sgl-kernel names and are padded
    with -1 past num_nodes[b]: retrive_index maps (b, local node) to the flat index, next_token is
    the first child's local index, next_sibling the next sibling's local index.
    """

    tokens: Tensor  # [T] int64
    positions: Tensor  # [T] int64, seq_len - 1 + depth
    depth: Tensor  # [T] int64
    parents: Tensor  # [T] int64, FLAT index of the parent, -1 for roots
    qo_indptr: Tensor  # [B + 1] int64
    tree_mask: Tensor  # [sum n_b^2] bool, each request's [n_b, n_b] ancestor mask, row-major
    mask_indptr: Tensor  # [B + 1] int64 offsets into tree_mask
    candidates: Tensor  # [B, M] int64 tokens, -1 padded
    retrive_index: Tensor  # [B, M] int64
    retrive_next_token: Tensor  # [B, M] int64
    retrive_next_sibling: Tensor  # [B, M] int64
    seq_lens: Tensor  # [B] int64
    num_nodes: list[int]
    draft_probs: Tensor | None  # [T, V] or None

    @property
    def batch_size(self) -> int:
        return len(self.num_nodes)

    def mask(self, b: int) -> Tensor:
        """Request b's [n_b, n_b] ancestor mask (a view into tree_mask)."""
        n = self.num_nodes[b]
        start = int(self.mask_indptr[b])
        return self.tree_mask[start : start + n * n].view(n, n)


def pack_trees(trees: list[DraftTree], seq_lens: Sequence[int] | Tensor) -> PackedTrees:
    """Flatten a batch of trees (possibly different sizes) for the attention backend and verify.

    seq_lens[b] follows the module convention (tokens so far including the root).
    """
    lens = _as_long(seq_lens, "seq_lens").cpu()
    assert len(trees) >= 1, "pack_trees needs at least one tree"
    assert lens.numel() == len(trees), f"{len(trees)} trees but {lens.numel()} seq_lens"
    has_q = [t.draft_probs is not None for t in trees]
    assert all(has_q) or not any(has_q), "either every tree carries draft_probs or none does"
    num_nodes = [t.num_nodes for t in trees]
    bsz, width = len(trees), max(num_nodes)
    offsets = [0]
    for n in num_nodes:
        offsets.append(offsets[-1] + n)
    sq = [n * n for n in num_nodes]
    mask_offsets = [0]
    for s in sq:
        mask_offsets.append(mask_offsets[-1] + s)

    candidates = torch.full((bsz, width), -1, dtype=torch.int64)
    retrive_index = torch.full((bsz, width), -1, dtype=torch.int64)
    next_token = torch.full((bsz, width), -1, dtype=torch.int64)
    next_sibling = torch.full((bsz, width), -1, dtype=torch.int64)
    flat_parents = []
    for b, t in enumerate(trees):
        n, off = num_nodes[b], offsets[b]
        candidates[b, :n] = t.tokens
        retrive_index[b, :n] = torch.arange(off, off + n)
        next_token[b, :n] = t.first_child
        next_sibling[b, :n] = t.next_sibling
        flat_parents.append(torch.where(t.parents >= 0, t.parents + off, t.parents))

    return PackedTrees(
        tokens=torch.cat([t.tokens for t in trees]),
        positions=torch.cat([t.positions(int(s)) for t, s in zip(trees, lens.tolist())]),
        depth=torch.cat([t.depth for t in trees]),
        parents=torch.cat(flat_parents),
        qo_indptr=torch.tensor(offsets, dtype=torch.int64),
        tree_mask=torch.cat([t.ancestor_mask.reshape(-1) for t in trees]),
        mask_indptr=torch.tensor(mask_offsets, dtype=torch.int64),
        candidates=candidates,
        retrive_index=retrive_index,
        retrive_next_token=next_token,
        retrive_next_sibling=next_sibling,
        seq_lens=lens,
        num_nodes=num_nodes,
        draft_probs=torch.cat([t.draft_probs for t in trees]) if all(has_q) else None,
    )
