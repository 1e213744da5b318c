"""NGRAM speculation: drafts from a global n-gram trie of prompts and outputs (no draft model).

One `NgramCache` is shared by every request of the server: what one request wrote (a document
it quoted, code it repeated) helps the next. On a short (1-3 token) context match the tree comes
from the request's own prompt and output first, the trie filling the rest (`ngram_context`).
The drafter is deterministic, so verification treats q as one-hot (lossless for any tree it
builds).
"""

from __future__ import annotations

import logging
from collections import OrderedDict

from speculative.base import Drafter, SpecConfig, SpecReq, register_algorithm
from speculative.ngram_cache import NgramCache, NgramConfig, tree_size_for_match
from speculative.ngram_context import OWN_CONTEXT_MAX_MATCH, ContextIndex, own_context_tree
from speculative.tree import DraftTree

logger = logging.getLogger(__name__)


@register_algorithm("NGRAM")
class NgramDrafter(Drafter):
    def __init__(self, cfg: SpecConfig, runner) -> None:
        super().__init__(cfg, runner)
        # with match sizing, a backed-off request still drafts on a confident (long) match
        self.drafts_when_backed_off = cfg.ngram_match_sizing
        self.cache = NgramCache(NgramConfig(
            capacity=cfg.ngram_capacity,
            max_trie_depth=cfg.ngram_max_trie_depth,
            min_match_window=cfg.ngram_min_match_window,
            max_bfs_breadth=cfg.ngram_max_bfs_breadth,
            min_bfs_breadth=cfg.ngram_min_bfs_breadth,
            match_type=cfg.ngram_match_type,
            num_draft_tokens=cfg.num_draft_tokens,
            size_by_match=cfg.ngram_match_sizing,
        ))
        # per-request token positions for own-context drafts, LRU-bounded like the trie's states
        self.own_context = cfg.ngram_own_context
        self._contexts: OrderedDict[str, ContextIndex] = OrderedDict()
        self._max_contexts = self.cache.cfg.max_tracked_requests
        if cfg.ngram_external_corpus_path:
            n = self.cache.load_corpus(cfg.ngram_external_corpus_path, tokenize=self._tokenize)
            logger.info("n-gram trie preloaded with %d tokens from %s", n,
                        cfg.ngram_external_corpus_path)

    def _tokenize(self, text: str) -> list[int]:
        if not hasattr(self, "_tok"):
            from runtime.model_loader.tokenizer import load_tokenizer

            self._tok = load_tokenizer(self.runner.model_config.model_dir)
        return self._tok.encode(text, add_special_tokens=False)

    def propose(self, reqs: list[SpecReq]) -> list[DraftTree]:
        depth = self.cfg.ngram_max_trie_depth
        trees = []
        for r in reqs:
            if r.budget <= 1:
                trees.append(DraftTree.chain(r.tokens[-1], []))
                continue
            tokens, parents = self.cache.draft_lists(r.tokens[-depth:], r.budget, key=r.rid,
                                                     backed_off=r.backed_off)
            if self.own_context:
                tokens, parents = self._own_context_first(r, tokens, parents)
            trees.append(DraftTree.from_parents(tokens, parents))
        return trees

    def _own_context_first(self, r: SpecReq, tokens: list[int],
                           parents: list[int]) -> tuple[list[int], list[int]]:
        """On a short match, the trie's tree rebuilt from the request's own context first (the
        trie's nodes fill what is left); the same node count."""
        index = self._contexts.get(r.rid)
        if index is None:
            index = self._contexts[r.rid] = ContextIndex()
            if len(self._contexts) > self._max_contexts:
                self._contexts.popitem(last=False)
        else:
            self._contexts.move_to_end(r.rid)
        index.catch_up(r.tokens)  # every step, so its cost stays O(new tokens)
        m = self.cache.last_match_len
        if not 1 <= m <= OWN_CONTEXT_MAX_MATCH or len(tokens) <= 1:
            return tokens, parents
        size = r.budget
        if self.cfg.ngram_match_sizing:
            size = tree_size_for_match(m, self.cfg.num_draft_tokens, r.budget)
        starts = index.continuations(r.tokens, m, size - 1)
        if not starts:
            return tokens, parents
        return own_context_tree(r.tokens, starts, size, tokens, parents)

    def release(self, rid: str) -> None:
        self.cache.release(rid)
        self._contexts.pop(rid, None)

    def reset(self) -> None:
        self.cache = NgramCache(self.cache.cfg)
        self._contexts.clear()

    def observe(self, rid: str, tokens: list[int], num_new: int) -> None:
        if num_new >= len(tokens):
            self.cache.insert(tokens)  # a new request's prompt
            return
        tail = tokens[-(self.cfg.ngram_max_trie_depth + num_new) : -num_new]
        self.cache.extend(rid, tail, tokens[-num_new:])
