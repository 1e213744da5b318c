"""The NGRAM drafter's memory: one token trie of n-grams shared by every request of a server
(SUFFIX's global tree is one too).

Every n-gram (t_s .. t_e) of length <= max_trie_depth (D) that occurred is a path from the root;
a node's count is how many times its n-gram occurred. To draft after a context, take the nodes
of the context's suffixes (longest first) and read their subtrees: a node's children are the
tokens that followed that suffix, ordered by recency or ranked by count. A match of m tokens
can only continue D - m tokens deep, so drafts reach at most D - 1 tokens past the root.

Costs, all independent of the context length (this runs between forwards, on the CPU):
    insert(tokens)   O(len(tokens) * D)
    extend(...)      O(len(new) * D): per request the trie keeps the nodes of its context's last
                     D-1 suffixes ("anchors"); each new token adds one child under each anchor,
                     and those children are the next anchors. A missing request state costs one
                     O(D^2) lookup of the anchors.
    draft(...)       O(D^2) lookups to match suffixes (O(D) with `key` after `extend`), plus
                     O(num_draft_tokens * max_bfs_breadth) to build the tree.

Recency ("touch"): a node is touched when an occurrence ends at it (it moves to the end of its
parent's children and of the global LRU) and when one of its children is counted (LRU only).
Siblings have equal depth, so their order is the order of their last occurrences; it is the
same whether a sequence is fed at once (`insert`) or token by token (`extend`).

Eviction keeps num_nodes <= capacity by removing the least recently touched LEAF, so every
surviving node still has its whole path. The global LRU holds every leaf; a non-leaf popped from
its front leaves the queue ("parked") until it is touched again or its last child is evicted, at
which point it is older than everything queued and goes back to the front. Amortised O(1).

The trie is C++ (`specserve/kernels/cpu/csrc/ngram_trie.cpp`, in the CPU extension); `NgramCache`
wraps it and owns the drafting policy on top (tree size by match length, sure drafts only). Its node
arrays and child table are allocated for `capacity` nodes when it is built (~90 bytes a node), so
its memory is its ceiling from the start. tests/helpers/ngram_reference.py is a small Python trie
the tests check it against. Not thread-safe: the model runner calls it from one thread.
"""

from __future__ import annotations

import json
import logging
from collections.abc import Callable, Hashable, Iterator, Sequence
from dataclasses import dataclass
from pathlib import Path

from specserve.kernels import cpu
from specserve.speculative.tree import DraftTree

logger = logging.getLogger(__name__)

MATCH_TYPES = ("BFS", "PROB")


@dataclass(frozen=True)
class NgramConfig:
    """Trie and drafting parameters (names follow SGLang's --speculative-ngram-* flags).

    capacity:             most trie nodes (root excluded); LRU leaves are evicted beyond.
                          ~90 bytes per node, reserved up front: the 1M default is ~90 MB
                          (SGLang's C++ trie defaults to 10M nodes).
    max_trie_depth:       D, the longest n-gram stored; suffixes of up to D-1 tokens are matched
                          (a D-token match has no stored continuation).
    min_match_window:     shortest suffix that counts as a match.
    max/min_bfs_breadth:  children taken per tree node, decaying with match length + depth.
    match_type:           "BFS" (most recent continuations) | "PROB" (most frequent).
    num_draft_tokens:     default tree size, root included.
    size_by_match:        size each tree by its longest match (`tree_size_for_match`) within
                          the budget, instead of filling the budget whenever anything matches.
    max_tracked_requests: per-request anchor states kept for `extend` (LRU beyond; a dropped
                          state only costs one O(D^2) rebuild).
    """

    capacity: int = 1_000_000
    max_trie_depth: int = 18
    min_match_window: int = 1
    max_bfs_breadth: int = 10
    min_bfs_breadth: int = 1
    match_type: str = "BFS"
    num_draft_tokens: int = 8
    size_by_match: bool = True
    max_tracked_requests: int = 4096

    def __post_init__(self) -> None:
        d = self.max_trie_depth
        if d < 2:
            raise ValueError(f"max_trie_depth must be >= 2, got {d}")
        # One extend step works on at most D(D+1)/2 nodes (anchors, their paths, new children);
        # a larger trie always has an unrelated leaf that is older, so eviction never removes
        # a node the step is working on.
        if self.capacity < d * d:
            raise ValueError(f"capacity must be >= max_trie_depth^2 = {d * d}, got {self.capacity}")
        if not 1 <= self.min_match_window < d:
            raise ValueError(
                f"min_match_window must be in [1, max_trie_depth), got {self.min_match_window}"
            )
        if not 1 <= self.min_bfs_breadth <= self.max_bfs_breadth:
            raise ValueError(
                "need 1 <= min_bfs_breadth <= max_bfs_breadth, got "
                f"{self.min_bfs_breadth}, {self.max_bfs_breadth}"
            )
        if self.match_type not in MATCH_TYPES:
            raise ValueError(f"match_type must be one of {MATCH_TYPES}, got {self.match_type!r}")
        if self.num_draft_tokens < 1:
            raise ValueError(f"num_draft_tokens counts the root, >= 1, got {self.num_draft_tokens}")
        if self.max_tracked_requests < 1:
            raise ValueError(f"max_tracked_requests must be >= 1, got {self.max_tracked_requests}")


# A context suffix of at least this many tokens matched is a confident match: drafts from it
# are accepted most of the time (on the train split, 3-token matches got >= 1 draft accepted
# 81% of the time against 49% for 1-token matches; docs/benchmarks.md), so a backed-off request
# still drafts on one.
CONFIDENT_MATCH = 3


def tree_size_for_match(m: int, base: int, budget: int) -> int:
    """Tree nodes (root included) for a draft whose longest context match is `m` tokens.

    On the CPU a verify node costs ~1 ms, ~5% of a decode step (past a few rows the matmuls
    are compute-bound), so nodes go where they are likely to be accepted: half the base size
    for a 1-token match, three quarters for 2, halfway from base to the budget for 3, the
    whole budget (deep drafts included) for longer matches."""
    if m <= 0 or budget <= 1:
        return 1
    if m == 1:
        n = max(2, base // 2)
    elif m == 2:
        n = max(2, 3 * base // 4)
    elif m == CONFIDENT_MATCH:
        n = (base + max(base, budget)) // 2
    else:
        n = budget
    return min(n, budget)


def bfs_breadths(cfg: NgramConfig) -> list[int]:
    """Breadth for (match length m, tree level l), indexed by m + l - 2 in [0, D-2]: the
    linear decay SGLang uses, spanning exactly max_bfs_breadth (m = l = 1) down to
    min_bfs_breadth (m + l = D, the deepest continuation the trie holds)."""
    depth = cfg.max_trie_depth
    span = max(depth - 2, 1)
    lo, delta = cfg.min_bfs_breadth, cfg.max_bfs_breadth - cfg.min_bfs_breadth
    return [lo + delta * max(span - i, 0) // span for i in range(depth)]


def trie_extension():
    """The CPU extension module that holds the trie; raises CpuExtensionUnavailable saying so.
    NGRAM and SUFFIX call it when their options are resolved, so a server without it fails at
    start with that message, not later in its model runner."""
    try:
        return cpu.load()
    except cpu.CpuExtensionUnavailable as exc:
        raise cpu.CpuExtensionUnavailable(
            f"the n-gram trie (NGRAM, SUFFIX) is part of the CPU extension: {exc}") from exc


class NgramCache:
    """A capacity-bounded n-gram trie with LRU leaf eviction, and tree drafting from it (the
    C++ trie of the CPU extension; see the module docstring). Request keys that are not
    strings are keyed by their repr."""

    def __init__(self, cfg: NgramConfig) -> None:
        self.cfg = cfg
        self._t = trie_extension().NgramTrie(
            cfg.capacity, cfg.max_trie_depth, cfg.min_match_window, cfg.max_bfs_breadth,
            bfs_breadths(cfg), cfg.match_type == "PROB", cfg.max_tracked_requests)
        logger.info("n-gram trie (C++): up to %s nodes, %.0f MB reserved", f"{cfg.capacity:,}",
                    self.reserved_bytes / 2**20)

    @staticmethod
    def _key(key: Hashable | None) -> str | None:
        return key if key is None or type(key) is str else "\0" + repr(key)

    @property
    def num_nodes(self) -> int:
        """Trie nodes excluding the root; always <= cfg.capacity."""
        return self._t.num_nodes

    @property
    def reserved_bytes(self) -> int:
        """Bytes allocated for the nodes and the child table (all of it at construction)."""
        return self._t.reserved_bytes

    @property
    def last_match_len(self) -> int:
        """m of the last draft (0: no match), for the drafter's own-context rule and replays."""
        return self._t.last_match_len

    def count(self, ngram: Sequence[int]) -> int:
        """How many times `ngram` was counted (0 if it is not in the trie)."""
        return self._t.count(ngram)

    def insert(self, tokens: Sequence[int]) -> None:
        """Count every n-gram (length <= D) of `tokens`, e.g. a prompt. O(len * D)."""
        self._t.insert(tokens)

    def extend(self, key: Hashable, context_tail: Sequence[int], new_tokens: Sequence[int]) -> None:
        """Count the n-grams that END in `new_tokens`, which follow `context_tail`.

        Only the last D-1 tokens of `context_tail` are read. Feeding a sequence in pieces this
        way yields exactly the counts and recency orders of one `insert` of the whole sequence
        (as long as nothing was evicted meanwhile); context n-grams missing from the trie are
        added with count 1 (they occurred). The request's anchors are kept under `key` so the
        next call costs O(len(new_tokens) * D); call `release(key)` when it finishes.
        """
        self._t.extend(self._key(key), context_tail, new_tokens)

    def release(self, key: Hashable) -> None:
        """Forget a finished request's anchors (its n-grams stay in the trie)."""
        self._t.release(self._key(key))

    def remove(self, tokens: Sequence[int]) -> None:
        """Uncount every n-gram (length <= D) of `tokens`, as one `insert` of them counted it: a
        node whose count reaches 0 leaves the trie with its subtree; n-grams evicted meanwhile
        are skipped. O(len * D). (How a bounded cache forgets one old request's output.)"""
        self._t.remove(tokens)

    def draft(
        self,
        context_tail: Sequence[int],
        num_draft_tokens: int | None = None,
        *,
        key: Hashable | None = None,
        confident_only: bool = False,
    ) -> DraftTree:
        """A draft tree of at most `num_draft_tokens` nodes rooted at context_tail[-1].

        Reads only the last D-1 tokens. Suffixes are matched longest first (down to
        min_match_window) and their continuations merged into one tree until it is full; no
        match gives the root-only tree. BFS takes, at tree level l below a match of length m,
        the bfs_breadths[m + l - 2] most recent children; PROB grows the tree best first by
        P(path), the product of count / sibling total over each node's top max_bfs_breadth
        children. With `size_by_match` the tree is sized by the longest match
        (`tree_size_for_match`), and `confident_only` drafts only on a confident match. With the
        `key` of the request's last `extend` over the same context, the suffix nodes are
        reused instead of looked up.
        """
        tokens, parents = self.draft_lists(context_tail, num_draft_tokens, key=key,
                                           confident_only=confident_only)
        return DraftTree.from_parents(tokens, parents)

    def draft_lists(
        self,
        context_tail: Sequence[int],
        num_draft_tokens: int | None = None,
        *,
        key: Hashable | None = None,
        confident_only: bool = False,
    ) -> tuple[list[int], list[int]]:
        """`draft` as plain (tokens, parents) lists, parents[i] < i, parents[0] = -1."""
        budget = self.cfg.num_draft_tokens if num_draft_tokens is None else num_draft_tokens
        tokens, parents = self._t.draft_lists(context_tail, budget, self._key(key))
        m = self._t.last_match_len
        if confident_only and m < CONFIDENT_MATCH:
            size = 1
        elif self.cfg.size_by_match:
            size = tree_size_for_match(m, self.cfg.num_draft_tokens, budget)
        else:
            size = budget
        # the trie built the whole budget's tree in order: any smaller tree is its prefix
        return tokens[:size], parents[:size]

    def draft_scored(
        self,
        context_tail: Sequence[int],
        max_nodes: int,
        *,
        spec_factor: float,
        spec_offset: float,
        min_prob: float,
        key: Hashable | None = None,
    ) -> tuple[list[int], list[int], list[float], float, int]:
        """Suffix decoding's tree: (tokens, parents, probs, score, match length); nodes in
        best-first order (probs non-increasing after the root's 1.0, parents first).

        For every matched suffix of the context (length m, longest first) a best-first tree
        grows below its node (`ngram_context.grow_best_first`): a continuation's probability
        is the product of count / parent's child total along its path, nodes below `min_prob`
        are pruned, and the tree holds at most min(max_nodes - 1, spec_factor * m +
        spec_offset) drafts. Its score is the sum of its nodes' probabilities (the expected
        number of accepted drafts); the best-scoring tree wins. A match whose size limit
        cannot beat the best score so far is skipped. Children are read from each node's top
        `max_bfs_breadth` by count (all of them that can pass min_prob >= 1/breadth)."""
        return self._t.draft_scored(context_tail, max_nodes, spec_factor, spec_offset, min_prob,
                                    self._key(key))

    def load_corpus(
        self, path: str | Path, tokenize: Callable[[str], Sequence[int]] | None = None
    ) -> int:
        """Preload documents; returns the number of tokens inserted.

        `.jsonl`: one record per line, {"tokens": [...]}, {"text": "..."} or a bare JSON string.
        Any other file: plain text, one document per blank-line-separated paragraph. Text needs
        `tokenize` (text -> token ids). Each document is inserted on its own (no n-gram spans
        two documents).
        """
        total = 0
        for ids in read_corpus(path, tokenize):
            self.insert(ids)
            total += len(ids)
        return total

    def dump(self) -> list[tuple[tuple[int, ...], int]]:
        """Every stored n-gram with its count, depth first, children in recency order (tests)."""
        return [(tuple(gram), c) for gram, c in self._t.dump()]

    def check_integrity(self) -> None:
        """Assert every structural invariant (O(num_nodes); for tests and debugging)."""
        try:
            self._t.check_integrity()
        except RuntimeError as e:  # (a C++ logic_error)
            raise AssertionError(str(e)) from None


def read_corpus(
    path: str | Path, tokenize: Callable[[str], Sequence[int]] | None = None
) -> Iterator[Sequence[int]]:
    """The documents of a corpus file as token id sequences, one at a time (the format:
    `NgramCache.load_corpus`)."""
    path = Path(path)
    if not path.is_file():
        raise ValueError(f"n-gram corpus not found: {path}")

    def encode(text: str, where: str) -> Sequence[int]:
        if tokenize is None:
            raise ValueError(f"{where}: text needs a tokenizer (pass tokenize=...)")
        return tokenize(text)

    with path.open(encoding="utf-8") as f:
        if path.suffix != ".jsonl":
            for para in f.read().split("\n\n"):
                if para.strip():
                    yield encode(para, str(path))
            return
        for line_no, line in enumerate(f, start=1):
            if line.strip():
                yield _jsonl_record(line, f"{path}:{line_no}", encode)


def _jsonl_record(line: str, where: str,
                  encode: Callable[[str, str], Sequence[int]]) -> Sequence[int]:
    try:
        rec = json.loads(line)
    except json.JSONDecodeError as e:
        raise ValueError(f"{where}: invalid JSON: {e.msg}") from e
    if isinstance(rec, str):
        return encode(rec, where)
    if isinstance(rec, dict) and "tokens" in rec:
        return rec["tokens"]
    if isinstance(rec, dict) and "text" in rec:
        return encode(rec["text"], where)
    raise ValueError(f'{where}: expected {{"tokens": [...]}}, {{"text": ...}} or a JSON string')
