"""SUFFIX speculation: suffix decoding (Oliaro et al. 2024, arXiv 2411.04975; vLLM's
`method="suffix"`), no draft model.

Two suffix structures answer every step, through one best-first tree grower
(`specserve.speculative.ngram_context.grow_best_first`):
- the request's own prompt and output so far, as a positional index (`ngram_context.ContextIndex`,
  the one NGRAM's own-context drafts read): one int per token, so a long prompt costs nothing
  to index, and its trees equal those of a depth-bounded count trie over the same tokens
  (dropped when the request finishes);
- one global tree over the outputs of earlier and running requests, bounded by
  `--speculative-suffix-max-cached-requests` (the oldest request's output is uncounted when a
  new one arrives beyond it) and by `--speculative-suffix-cache-capacity` nodes (least recently
  used leaves evicted), so its memory has a fixed ceiling; a depth-bounded token trie with
  counts (`specserve.speculative.ngram_cache.NgramCache`, the trie NGRAM drafts from too).
For each, every suffix of the context that the tree holds (up to `max_tree_depth` - 1 tokens)
grows a best-first tree: a continuation's probability is the product of count / sibling total
along its path, pruned below `min_token_prob`, at most `max_spec_factor * match_len +
max_spec_offset` drafts (and the step's node budget). Each tree's score is the sum of its
nodes' probabilities (the expected accepted drafts); the two trees are merged (a path both hold
keeps the higher probability), best first, and cut where another node would cost more verify
time than it is expected to bring (`worth_drafting`: the controller's `best_prefix` on the
engine's verify-cost curve). Long
matches in text that repeats across requests (agentic loops, one JSON schema filled again and
again) draft long, short matches draft one or two tokens or nothing.

Deterministic, so verification treats q as one-hot: greedy output is exact and sampled output
follows the target distribution for any tree.
"""

from __future__ import annotations

import dataclasses
import math
from array import array
from collections import OrderedDict
from dataclasses import dataclass

from specserve.speculative.base import Drafter, RunnerReq, register_algorithm
from specserve.speculative.ngram_cache import NgramCache, NgramConfig, trie_extension
from specserve.speculative.ngram_context import ContextIndex
from specserve.speculative.options import ResolveContext, SpecConfig, SpecOptions, flag, option
from specserve.speculative.planning import TreeSizes, best_prefix
from specserve.speculative.tree import DraftTree

# A request the controller keeps from drafting still drafts a tree this confident: the
# expected number of accepted drafts, the tree's score.
CONFIDENT_SCORE = 2.0
# Requests whose own index is kept at once (a request never released is dropped beyond this).
MAX_LIVE_TREES = 4096
# How far the global tree's estimates are trusted, learned online (`SourceCalibration`).
CALIBRATION_PRIOR = 8.0  # pseudo-nodes per source, estimated = accepted (trust at first)
CALIBRATION_DECAY = 0.998  # per observed drafting step of any request: a memory of ~500
MIN_GLOBAL_TRUST = 0.05


@dataclass(slots=True)
class _SuffixReq:
    """What the drafter keeps of one live request (its one entry in `SuffixDrafter.reqs`)."""

    tree: ContextIndex  # its own prompt and output, indexed
    prompt_len: int
    # its last draft until the step's tokens are observed: tokens, parents, each node's source
    # and its estimate before calibration
    pending: tuple[list[int], list[int], list[str], list[float]] | None = None


class SourceCalibration:
    """How well each suffix structure's estimates predict acceptance, learned from the steps.

    A node's estimate is a product of count / total along its path: the request's own history
    and the global tree's other outputs both say "always followed by x" after one occurrence,
    but on text that does not repeat across requests (rewrites of different passages, chat)
    the global tree's phrases come from other requests' answers and are accepted far less
    often than its estimates say. Per source, the decayed sums of drafted nodes' estimates and
    of those accepted give an observed rate; the global tree's estimates are scaled by its
    rate over the request tree's (at most 1, at least MIN_GLOBAL_TRUST) before the two trees
    are merged and cut by cost, so where other requests' outputs do predict this one
    (repeated tasks, agent loops) the factor stays near 1 and nothing changes. The request
    tree's own estimates are left as they are (the cost cut of `worth_drafting` is calibrated
    with them)."""

    SOURCES = ("request", "global")

    def __init__(self) -> None:
        self.estimated = dict.fromkeys(self.SOURCES, CALIBRATION_PRIOR)
        self.accepted = dict.fromkeys(self.SOURCES, CALIBRATION_PRIOR)

    def rate(self, source: str) -> float:
        return self.accepted[source] / self.estimated[source]

    def global_trust(self) -> float:
        return min(1.0, max(MIN_GLOBAL_TRUST, self.rate("global") / self.rate("request")))

    def update(self, estimated: dict[str, float], accepted: dict[str, float]) -> None:
        for src in self.SOURCES:
            self.estimated[src] = self.estimated[src] * CALIBRATION_DECAY + estimated[src]
            self.accepted[src] = self.accepted[src] * CALIBRATION_DECAY + accepted[src]


def merge_best_first(trees: list[tuple], budget: int, origins: list[int] | None = None,
                     ) -> tuple[list[int], list[int], list[float]]:
    """Several best-first trees (tokens, parents, probs, ...) over the same root merged into
    one: a path both hold keeps the higher probability; nodes in best-first order again (a
    child's probability never exceeds its parent's in any tree, so parents still come first),
    at most `budget` nodes. `origins`, if given, receives each node's tree index (root: -1)."""
    best: dict[tuple[int, ...], tuple[float, int]] = {}
    for k, (tokens, parents, probs, *_) in enumerate(trees):
        paths: list[tuple[int, ...]] = [()]
        for i in range(1, len(tokens)):
            path = paths[parents[i]] + (tokens[i],)
            paths.append(path)
            if probs[i] > best.get(path, (-1.0, 0))[0]:
                best[path] = (probs[i], k)
    order = sorted(best.items(), key=lambda kv: (-kv[1][0], len(kv[0])))[: budget - 1]
    root = trees[0][0][0]
    index = {(): 0}
    out_t, out_p, out_q = [root], [-1], [1.0]
    if origins is not None:
        origins[:] = [-1]
    for path, (prob, k) in order:
        parent = index.get(path[:-1])
        if parent is None:  # (a tie ordered a child first; cannot happen with ties by length)
            continue
        index[path] = len(out_t)
        out_t.append(path[-1])
        out_p.append(parent)
        out_q.append(prob)
        if origins is not None:
            origins.append(k)
    return out_t, out_p, out_q


@dataclass(frozen=True)
class SuffixOptions(SpecOptions):
    suffix_max_tree_depth: int = option(
        24, "SUFFIX: depth of the suffix trees: the longest context suffix matched + 1",
        vllm="suffix_decoding_max_tree_depth")
    suffix_max_cached_requests: int = option(
        10_000, "SUFFIX: requests whose outputs the global tree holds (the oldest is uncounted "
        "beyond it; 0 turns the global tree off)",
        vllm="suffix_decoding_max_cached_requests")
    suffix_cache_capacity: int = option(
        2_000_000, "SUFFIX: most nodes of the global tree, ~90 bytes each, reserved at start "
        "by the C++ trie (least recently used leaves evicted beyond)")
    suffix_max_spec_factor: float = option(
        1.0, "SUFFIX: drafts per step at most this times the matched suffix length (+ offset)",
        vllm="suffix_decoding_max_spec_factor")
    suffix_max_spec_offset: float = option(
        0.0, "SUFFIX: added to max_spec_factor * match length (may be negative)")
    suffix_min_token_prob: float = option(
        0.1, "SUFFIX: drop draft tokens whose estimated probability (product of frequencies "
        "along the path) is below this", vllm="suffix_decoding_min_token_prob")
    suffix_planned_sizes: bool = option(
        False, "SUFFIX: let the scheduler plan tree sizes from each request's running "
        "acceptance rate, as for the other algorithms, instead of handing out the size caps "
        "and letting SUFFIX cut each tree by its nodes' probabilities and the verify-cost curve")
    suffix_global_calibration: bool = option(
        True, "SUFFIX: learn online how often the global tree's drafts are accepted against the "
        "request tree's and scale its estimates by that (false: trust its count ratios as they "
        "are)")
    suffix_max_draft_tokens: int | None = option(
        None, "SUFFIX: tree nodes (root included) a request may draft while the step's total "
        "stays within it, i.e. when it decodes alone (default: 2x "
        "--speculative-num-draft-tokens)")


@register_algorithm("SUFFIX")
class SuffixDrafter(Drafter):
    options = SuffixOptions
    # as NGRAM's (a CPU-engine verify node costs ~1/5 of a decode step at batch 1); the trees
    # are sized by the match, so the budget is a ceiling
    default_num_draft_tokens = {"cpu": 4, "torch": 8}
    vllm_methods = ("suffix",)
    judges_confidence = True

    @classmethod
    def resolve_options(cls, opts: SuffixOptions, ctx: ResolveContext) -> SuffixOptions:
        opts = super().resolve_options(opts, ctx)
        n, deep = opts.num_draft_tokens, opts.suffix_max_draft_tokens
        deep = 2 * n if deep is None else deep
        if deep < n:
            raise ValueError(f"{flag('suffix_max_draft_tokens')} must be >= "
                             f"{flag('num_draft_tokens')} ({n}), got {deep}")
        if opts.suffix_max_tree_depth < 2:
            raise ValueError(f"{flag('suffix_max_tree_depth')} must be >= 2")
        if opts.suffix_max_cached_requests < 0:
            raise ValueError(f"{flag('suffix_max_cached_requests')} must be >= 0")
        if opts.suffix_cache_capacity < opts.suffix_max_tree_depth ** 2:
            raise ValueError(f"{flag('suffix_cache_capacity')} must be >= "
                             f"{flag('suffix_max_tree_depth')}^2")
        if not 0.0 < opts.suffix_min_token_prob <= 1.0:
            raise ValueError(f"{flag('suffix_min_token_prob')} must be in (0, 1]")
        if opts.suffix_max_spec_factor < 0:
            raise ValueError(f"{flag('suffix_max_spec_factor')} must be >= 0")
        trie_extension()  # after the flags' own errors: a server fails at start, not later
        return dataclasses.replace(opts, suffix_max_draft_tokens=deep)

    @classmethod
    def tree_sizes(cls, cfg: SpecConfig) -> TreeSizes:
        # a request the controller lets draft gets its cap, cut here by the nodes'
        # probabilities, which know more than the request's running acceptance rate
        return TreeSizes(cfg.num_draft_tokens, cfg.suffix_max_draft_tokens, deep_for_all=True,
                         self_sized=not cfg.suffix_planned_sizes, judges_confidence=True)

    def __init__(self, cfg: SpecConfig, runner) -> None:
        super().__init__(cfg, runner)
        depth = cfg.suffix_max_tree_depth
        # every child that can pass min_token_prob is among a node's top ceil(1/p) by count
        breadth = max(1, min(64, math.ceil(1.0 / cfg.suffix_min_token_prob)))
        self._global_cfg = NgramConfig(capacity=cfg.suffix_cache_capacity, max_trie_depth=depth,
                                       max_bfs_breadth=breadth)
        self.global_tree = NgramCache(self._global_cfg)
        # per live request, least recently used first
        self.reqs: OrderedDict[str, _SuffixReq] = OrderedDict()
        # outputs the global tree counts, oldest first (finished or running)
        self.outputs: OrderedDict[str, array] = OrderedDict()
        self.last_source = ""  # "request" / "global" / "": where the last draft came from
        self.last_probs: list[float] = [1.0]  # the last draft's node probabilities (replay)
        self.calibration = SourceCalibration()
        self._payable: dict[tuple[int, int], bool] = {}  # can_pay's answers for one curve
        self._payable_for = None  # ... this one

    def describe(self) -> str:
        c = self.cfg
        return (f"suffix trees of depth {c.suffix_max_tree_depth}, up to "
                f"{c.num_draft_tokens} nodes ({c.suffix_max_draft_tokens} alone), "
                f"{c.suffix_max_spec_factor} x match + {c.suffix_max_spec_offset}, "
                f"p >= {c.suffix_min_token_prob}; global tree over "
                f"{c.suffix_max_cached_requests} requests' outputs")

    # ---- drafting -----------------------------------------------------------------------
    def propose(self, reqs: list[RunnerReq]) -> list[DraftTree]:
        return [DraftTree.from_parents(*self.draft_lists(r, len(reqs))) for r in reqs]

    def draft_lists(self, r: RunnerReq, batch_size: int = 1) -> tuple[list[int], list[int]]:
        root = ([r.tokens[-1]], [-1])
        self.last_source, self.last_probs = "", [1.0]
        q = self.reqs.get(r.rid)
        if q is not None:
            q.pending = None
        if r.budget <= 1 or not (r.explore or self.can_pay(batch_size, r.budget)):
            return root
        c = self.cfg
        tail = r.tokens[-c.suffix_max_tree_depth:]
        kw = {"spec_factor": c.suffix_max_spec_factor, "spec_offset": c.suffix_max_spec_offset,
              "min_prob": c.suffix_min_token_prob, "key": r.rid}
        found = []
        if q is not None:
            q.tree.catch_up(r.tokens)
            found.append(("request", q.tree.draft_scored(
                r.tokens, r.budget, spec_factor=c.suffix_max_spec_factor,
                spec_offset=c.suffix_max_spec_offset, min_prob=c.suffix_min_token_prob,
                max_depth=c.suffix_max_tree_depth)))
        if c.suffix_max_cached_requests > 0:
            found.append(("global", self.global_tree.draft_scored(tail, r.budget, **kw)))
        found = [(src, t) for src, t in found if t[3] > 0]
        if not found:
            return root
        trust = self.calibration.global_trust() if self.cfg.suffix_global_calibration else 1.0
        # the global tree's estimates, as far as its record supports them (the root stays 1)
        scale = [trust if src == "global" else 1.0 for src, _ in found]
        found = [(src, t) if f == 1.0 else
                 (src, (t[0], t[1], [1.0] + [q * f for q in t[2][1:]], t[3] * f, *t[4:]))
                 for (src, t), f in zip(found, scale)]
        self.last_source = max(found, key=lambda f: f[1][3])[0]
        if r.confident_only and max(t[3] for _, t in found) < CONFIDENT_SCORE:
            return root
        origins: list[int] = []
        tokens, parents, probs = merge_best_first([t for _, t in found], r.budget, origins)
        # (a probe of the verify cost keeps the whole tree: its forward times the bigger size)
        k = len(probs) if r.explore else self.worth_drafting(probs, batch_size)
        self.last_probs = probs[:k]
        if k > 1 and q is not None:
            srcs = [found[o][0] for o in origins[1:k]]
            est = [p / scale[o] for p, o in zip(probs[1:k], origins[1:k])]  # before scaling
            q.pending = (tokens[:k], parents[:k], srcs, est)
        return tokens[:k], parents[:k]

    def _learn(self, q: _SuffixReq, new: list[int]) -> None:
        """Score the request's last draft against the tokens it gained (accepted drafts, then
        the target's own token: the walk down the tree follows exactly the accepted path)."""
        pending, q.pending = q.pending, None
        if pending is None:
            return
        tokens, parents, srcs, est = pending
        accepted_nodes, node = set(), 0
        for t in new:
            nxt = next((u for u in range(node + 1, len(tokens))
                        if parents[u] == node and tokens[u] == t), -1)
            if nxt < 0:
                break
            accepted_nodes.add(nxt)
            node = nxt
        estimated = dict.fromkeys(SourceCalibration.SOURCES, 0.0)
        accepted = dict.fromkeys(SourceCalibration.SOURCES, 0.0)
        for u in range(1, len(tokens)):
            src = srcs[u - 1]
            estimated[src] += est[u - 1]
            accepted[src] += u in accepted_nodes
        self.calibration.update(estimated, accepted)

    def can_pay(self, batch_size: int, budget: int) -> bool:
        """Whether any tree of at most `budget` nodes could keep a draft in `worth_drafting`
        at this batch size. Exact: every node's probability is at most 1 (products of count
        fractions, the global tree's scaled by a trust <= 1, merged by max), and the cut's
        rate only falls as a probability does, so when a tree of certain drafts is cut to
        its root, every tree is, and drafting it is skipped. On a CPU-engine curve measured
        at start-up no draft pays in a batch of ~48 or more, where drafting each request's
        trees costs ~45 us (py-spy at batch ~35: ~1.6 ms a step; docs/benchmarks.md,
        "Step time outside the forward")."""
        if self.verify_cost is None or self.cfg.disable_adaptive:
            return True
        if self._payable_for is not self.verify_cost or len(self._payable) > 4096:
            self._payable, self._payable_for = {}, self.verify_cost
        ok = self._payable.get((batch_size, budget))
        if ok is None:
            ok = self.worth_drafting([1.0] * budget, batch_size) > 1
            self._payable[batch_size, budget] = ok
        return ok

    def worth_drafting(self, probs: list[float], batch_size: int = 1) -> int:
        """Nodes (root included) of a best-first tree worth verifying: the controller's
        `best_prefix` on the verify-cost curve measured on this machine (set by the worker;
        None: no cut). Where rows are nearly free (a GPU, or a small batch on a memory-bound
        engine) this keeps everything above min_token_prob; on the CPU engine a row costs ~1/5
        of a decode step alone and about a whole token's share of the step once the batch is
        compute-bound (B >= 8), so the unlikely tail goes first and, in busy batches, all but
        near-certain drafts."""
        if self.cfg.disable_adaptive:
            return len(probs)  # --speculative-disable-adaptive: the full budget
        return best_prefix(probs, batch_size, self.verify_cost)

    # ---- state --------------------------------------------------------------------------
    def observe(self, rid: str, tokens: list[int], num_new: int) -> None:
        depth = self.cfg.suffix_max_tree_depth
        q = self.reqs.get(rid)
        if q is None or num_new >= len(tokens):  # a new request: its prompt
            q = self.reqs[rid] = _SuffixReq(ContextIndex(), len(tokens))
            q.tree.catch_up(tokens)
            if len(self.reqs) > MAX_LIVE_TREES:  # (a request never released)
                self.reqs.popitem(last=False)
            return
        self.reqs.move_to_end(rid)
        q.tree.catch_up(tokens)
        new = tokens[-num_new:]
        self._learn(q, new)
        if self.cfg.suffix_max_cached_requests <= 0:
            return
        out = self.outputs.get(rid)
        if out is None:
            out = self.outputs[rid] = array("i")
            while len(self.outputs) > self.cfg.suffix_max_cached_requests:
                _, gone = self.outputs.popitem(last=False)
                self.global_tree.remove(gone)
        # the global tree counts outputs only: their first token has no output context yet
        start = q.prompt_len
        ctx_out = tokens[max(start, len(tokens) - num_new - depth):len(tokens) - num_new]
        self.global_tree.extend(rid, ctx_out, new)
        out.extend(new)

    def live_requests(self) -> int:
        return len(self.reqs)

    def release(self, rid: str) -> None:
        self.reqs.pop(rid, None)
        self.global_tree.release(rid)  # its output stays counted until it is the oldest

    def reset(self) -> None:
        self.global_tree = None  # the old tree's memory goes first
        self.global_tree = NgramCache(self._global_cfg)
        self.calibration = SourceCalibration()
        self.reqs.clear()
        self.outputs.clear()

    def memory_nodes(self) -> dict[str, int]:
        """What is held: the global tree's nodes (~100 bytes each) and the live requests'
        indexed tokens (one int each) (for tests and /server_info-style reporting)."""
        return {"global": self.global_tree.num_nodes,
                "requests": sum(len(q.tree) for q in self.reqs.values()),
                "cached_requests": len(self.outputs), "live_requests": len(self.reqs)}
