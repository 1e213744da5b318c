"""NGRAM speculation: drafts from a global n-gram trie of prompts and outputs (no draft model).

One `NgramCache` is shared by every request of the server: what one request wrote (a document
it quoted, code it repeated) helps the next. The drafter is deterministic, so verification
treats q as one-hot (lossless for any tree it builds).
"""

from __future__ import annotations

import logging

from speculative.base import Drafter, SpecConfig, SpecReq, register_algorithm
from speculative.ngram_cache import NgramCache, NgramConfig
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
            else:
                trees.append(self.cache.draft(r.tokens[-depth:], r.budget, key=r.rid,
                                              backed_off=r.backed_off))
        return trees

    def release(self, rid: str) -> None:
        self.cache.release(rid)

    def reset(self) -> None:
        self.cache = NgramCache(self.cache.cfg)

    def observe(self, rid: str, tokens: list[int], num_new: int) -> None:
        if num_new >= len(tokens):
            self.cache.insert(tokens)  # a new request's prompt
            return
        tail = tokens[-(self.cfg.ngram_max_trie_depth + num_new) : -num_new]
        self.cache.extend(rid, tail, tokens[-num_new:])
