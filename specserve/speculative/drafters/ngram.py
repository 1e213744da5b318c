"""NGRAM speculation: drafts from a global n-gram trie of prompts and outputs (no draft model).

One `NgramCache` is shared by every request of the server: what one request wrote (a document
it quoted, code it repeated) helps the next. A request's tokens are counted when it drafts (see
`observe`): one that never drafts, in a compute-bound batch, costs the trie nothing. On a short
(1-3 token) context match the tree comes from the request's own prompt and output first, the
trie filling the rest (`ngram_context`).
The drafter is deterministic, so verification treats q as one-hot (lossless for any tree it
builds).
"""

from __future__ import annotations

import dataclasses
import logging
from collections import OrderedDict
from dataclasses import dataclass

from specserve.speculative.base import Drafter, RunnerReq, register_algorithm
from specserve.speculative.ngram_cache import (
    NgramCache,
    NgramConfig,
    tree_size_for_match,
    trie_extension,
)
from specserve.speculative.ngram_context import (
    OWN_CONTEXT_MAX_MATCH,
    ContextIndex,
    own_context_tree,
)
from specserve.speculative.options import ResolveContext, SpecConfig, SpecOptions, flag, option
from specserve.speculative.planning import TreeSizes
from specserve.speculative.tree import DraftTree

logger = logging.getLogger(__name__)


@dataclass(slots=True)
class _NgramReq:
    """What the drafter keeps of one request (its one entry in `NgramDrafter.reqs`)."""

    history: list[int] | None = None  # its latest token history (`observe`)
    counted: int | None = None  # tokens of it the trie has counted (None: it never drafted)
    context: ContextIndex | None = None  # its token positions, for own-context drafts


@dataclass(frozen=True)
class NgramOptions(SpecOptions):
    ngram_capacity: int = option(1_000_000, "NGRAM: most trie nodes kept (least recently used "
                                 "evicted); the C++ trie reserves ~90 bytes a node at start")
    ngram_max_trie_depth: int = option(18, "NGRAM: longest n-gram stored and suffix matched",
                                       vllm="prompt_lookup_max")
    ngram_min_match_window: int = option(1, "NGRAM: shortest context suffix that counts as a "
                                         "match", vllm="prompt_lookup_min")
    ngram_max_bfs_breadth: int = option(10, "NGRAM: tree breadth at depth 1 (BFS)")
    ngram_min_bfs_breadth: int = option(1, "NGRAM: tree breadth at the deepest level (BFS)")
    ngram_match_type: str = option("BFS", "NGRAM: BFS (most recent continuations) or PROB "
                                   "(most frequent)", choices=("BFS", "PROB"))
    ngram_external_corpus_path: str | None = option(
        None, "NGRAM: JSONL/text corpus preloaded into the trie")
    ngram_max_draft_tokens: int | None = option(
        None, "NGRAM: tree nodes (root included) a request may draft while the step's total "
        "stays within it, i.e. when it decodes alone: on a long context match with match "
        "sizing, else after a step that accepted a whole default-size draft (default: 2x "
        "--speculative-num-draft-tokens; equal to it turns deep drafts off)")
    ngram_disable_match_sizing: bool = option(
        False, "NGRAM: draft the whole budget whenever the context matches, instead of sizing "
        "each tree by the match length (longer match, larger tree; a backed-off request drafts "
        "again on a long match)")
    ngram_disable_own_context: bool = option(
        False, "NGRAM: on a 1- or 2-token context match, draft from the trie alone, instead of "
        "from the request's own prompt and output first (the trie fills what is left)")


@register_algorithm("NGRAM")
class NgramDrafter(Drafter):
    options = NgramOptions
    # torch engine (fp32, weight-bandwidth-bound): a verify pass of 8 nodes costs ~1.15x a
    # decode step. CPU engine: ~5x faster decode, so each node is dearer (T(4)/T(1) ~1.5,
    # T(8)/T(1) ~2.4); on train-split rewrite/ShareGPT prompts 4 nodes beat 6, 8 and 12
    # (`python -m benchmark.bench_speculative --split train --configs NGRAM
    # NGRAM:num_draft_tokens=6 NGRAM:num_draft_tokens=8 NGRAM:num_draft_tokens=12`).
    default_num_draft_tokens = {"cpu": 4, "torch": 8}
    vllm_methods = ("ngram", "prompt_lookup")

    @classmethod
    def resolve_options(cls, opts: NgramOptions, ctx: ResolveContext) -> NgramOptions:
        opts = super().resolve_options(opts, ctx)
        n, deep = opts.num_draft_tokens, opts.ngram_max_draft_tokens
        deep = 2 * n if deep is None else deep
        if deep < n:
            raise ValueError(f"{flag('ngram_max_draft_tokens')} must be >= "
                             f"{flag('num_draft_tokens')} ({n}), got {deep}")
        trie_extension()  # after the flags' own errors: a server fails at start, not later
        return dataclasses.replace(opts, ngram_max_draft_tokens=deep)

    @classmethod
    def tree_sizes(cls, cfg: SpecConfig) -> TreeSizes:
        # with match sizing a tree grows with the context match, so any request alone may get
        # the deep size, and a long match is a sure draft even for a request kept back
        sizing = not cfg.ngram_disable_match_sizing
        return TreeSizes(cfg.num_draft_tokens, cfg.ngram_max_draft_tokens, deep_for_all=sizing,
                         judges_confidence=sizing)

    def __init__(self, cfg: SpecConfig, runner) -> None:
        super().__init__(cfg, runner)
        self.cache = NgramCache(NgramConfig(
            capacity=cfg.ngram_capacity,
            max_trie_depth=cfg.ngram_max_trie_depth,
            min_match_window=cfg.ngram_min_match_window,
            max_bfs_breadth=cfg.ngram_max_bfs_breadth,
            min_bfs_breadth=cfg.ngram_min_bfs_breadth,
            match_type=cfg.ngram_match_type,
            num_draft_tokens=cfg.num_draft_tokens,
            size_by_match=not cfg.ngram_disable_match_sizing,
        ))
        self.own_context = not cfg.ngram_disable_own_context
        # per request, least recently used first; bounded like the trie's request states
        self.reqs: OrderedDict[str, _NgramReq] = OrderedDict()
        self._max_reqs = self.cache.cfg.max_tracked_requests
        if cfg.ngram_external_corpus_path:
            n = self.cache.load_corpus(cfg.ngram_external_corpus_path, tokenize=self._tokenize)
            logger.info("n-gram trie preloaded with %d tokens from %s", n,
                        cfg.ngram_external_corpus_path)

    def _tokenize(self, text: str) -> list[int]:
        if not hasattr(self, "_tok"):
            from specserve.runtime.model_loader.tokenizer import load_tokenizer

            self._tok = load_tokenizer(self.runner.model_config.model_dir)
        return self._tok.encode(text, add_special_tokens=False)

    def propose(self, reqs: list[RunnerReq]) -> list[DraftTree]:
        depth = self.cfg.ngram_max_trie_depth
        for r in reqs:  # every drafting request's n-grams first, as if counted as they came
            if r.budget > 1:
                self._count(r.rid, self._req(r.rid), r.tokens)
        trees = []
        for r in reqs:
            if r.budget <= 1:
                trees.append(DraftTree.root(r.tokens[-1]))
                continue
            tokens, parents = self.cache.draft_lists(r.tokens[-depth:], r.budget, key=r.rid,
                                                     confident_only=r.confident_only)
            if self.own_context:
                tokens, parents = self._own_context_first(r, tokens, parents)
            trees.append(DraftTree.from_parents(tokens, parents))
        return trees

    def _own_context_first(self, r: RunnerReq, tokens: list[int],
                           parents: list[int]) -> tuple[list[int], list[int]]:
        """On a short match, the trie's tree rebuilt from the request's own context first (the
        trie's nodes fill what is left); the same node count."""
        q = self._req(r.rid)
        if q.context is None:
            q.context = ContextIndex()
        index = q.context
        index.catch_up(r.tokens)  # every step, so its cost stays O(new tokens)
        m = self.cache.last_match_len
        if not 1 <= m <= OWN_CONTEXT_MAX_MATCH or len(tokens) <= 1:
            return tokens, parents
        size = r.budget
        if not self.cfg.ngram_disable_match_sizing:
            size = tree_size_for_match(m, self.cfg.num_draft_tokens, r.budget)
        starts = index.continuations(r.tokens, m, size - 1)
        if not starts:
            return tokens, parents
        return own_context_tree(r.tokens, starts, size, tokens, parents)

    def _req(self, rid: str) -> _NgramReq:
        q = self.reqs.get(rid)
        if q is None:
            q = self.reqs[rid] = _NgramReq()
            if len(self.reqs) > self._max_reqs:  # (a request never released)
                self.reqs.popitem(last=False)
        else:
            self.reqs.move_to_end(rid)
        return q

    def live_requests(self) -> int:
        return len(self.reqs)

    def release(self, rid: str) -> None:
        q = self.reqs.pop(rid, None)
        if q is not None and q.history is not None and q.counted is not None:
            self._count(rid, q, q.history)  # a request that drafted leaves all its n-grams
        self.cache.release(rid)

    def reset(self) -> None:
        cfg, self.cache = self.cache.cfg, None  # the old trie's memory goes first
        self.cache = NgramCache(cfg)
        self.reqs.clear()

    # Counting is lazy. The trie counts a request's n-grams just before its first draft (its
    # prompt and output so far), then before each draft the tokens since, and its last tokens
    # when it finishes, so a request that drafts feeds the trie exactly what counting every
    # token as it came would have, in time for every draft it makes (a piecewise `extend`
    # equals one `insert`). A request that never drafts (at c = 32 the load-aware plan gives
    # a compute-bound batch no draft slots) leaves no n-grams: counting ~18 n-grams per token
    # in Python took ~1 ms of a ~50 ms batch-32 step that no one drafted from (docs/benchmarks.md,
    # "Step time outside the forward"). What one request wrote still helps the next as long as
    # drafting is on.
    def observe(self, rid: str, tokens: list[int], num_new: int) -> None:
        self._req(rid).history = tokens

    def _count(self, rid: str, q: _NgramReq, tokens: list[int]) -> None:
        done, n = q.counted or 0, len(tokens)
        if done < n:
            depth = self.cfg.ngram_max_trie_depth
            self.cache.extend(rid, tokens[max(done - depth, 0):done], tokens[done:])
        q.counted = n
