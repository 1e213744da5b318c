"""EAGLE / EAGLE3 speculation: a one-layer draft head reading the target's hidden states.

Draft extend (`draft_extend`, after every target forward). The head's row t takes (token t+1,
target hidden t) at position t and predicts token t+2 (specserve/speculative/models/base.py). Every
row a target forward commits — each prefill chunk, and after verification the root + accepted path —
is run through the head causally, so the head's KV covers exactly the request's committed positions.
Its output at the last committed row L-1 (logits and hidden) is kept per request: it scores the next
root's children and is their hidden input.

KV layout (mirror). The head's one-layer pool uses the SAME slot indices as the target's: the
head KV of position t lives in the slot holding the target KV of position t, so committed
tokens need no allocation of their own, the scheduler's free/keep decisions cover both, and
radix-cache hits reuse the head KV too. Commit by move is not repeated for the head: the draft
extend after verification writes the head rows of the accepted path straight into the slots
the target's commit moved them to (its tree-node scratch KV is elsewhere, see below). The pool
is sized target capacity + scratch: slots above the target's capacity are head-private scratch
for draft-tree nodes, reused every step (grown when a batch needs more). On a radix hit the
head row of the last cached position was computed with the token that followed it in the
request that cached it; that can only cost acceptance, never correctness. The same holds for
a prompt the scheduler caches while its request still runs (`Scheduler._cache_prompt`): the
head runs lazily (`draft_extend`), so a request that hits such a prompt before its owner next
drafts reads head KV not yet written for it.

Drafting. A tree node u at depth d sits at target position L + d; its head row is at position
L + d - 1, takes (token u, the head output hidden of u's parent; the root's is the kept one),
and attends to the committed head KV plus its ancestors' scratch rows. Each frontier node is
one row of a batched head DECODE whose KV index list is [committed slots, ancestors' scratch
slots, own scratch slot]: the tree mask expressed as index lists (a node sees its prefix and
its ancestors, never its cousins), without an [N, N] mask or re-feeding earlier levels.

Trees per request (specserve/speculative/eagle_tree.py): temperature 0 → `TopKTree` (EAGLE-2),
greedy verification. Temperature > 0 → `SampledTree` (children drawn from q without replacement,
verified with q: `QMode.WITHOUT_REPLACEMENT`), unless `eagle_target_only`, which keeps the top-k
tree and verifies it with q ignored (ONE_HOT, SGLang's target-only sampling) — lossless too, kept
for comparing the acceptance q buys. EAGLE-3's reduced vocabulary: draft ids map to target ids
(`map_to_target`) before they become tree tokens, and q is scattered into the target vocabulary
before processing, so trees and verification only ever see target ids. A token map
(`--speculative-token-map`, EAGLE-1/2 only) gives an EAGLE-1/2 head the same kind of reduced
vocabulary: its logits cover the map's hot ids and `to_target` is those ids.
"""

from __future__ import annotations

import dataclasses
import logging
from dataclasses import dataclass, field
from pathlib import Path

import torch
from torch import Tensor

from specserve.runtime.forward_batch import ForwardBatch, ForwardMode
from specserve.runtime.layers.linear import (
    BLOCK_FORMATS,
    cpu_has_native_bf16,
    onednn_bf16_available,
)
from specserve.runtime.mem_cache.kv_pool import KVPool
from specserve.runtime.models.llama import ModelOutput
from specserve.runtime.sampling.sampler import SamplingBatchInfo, process_logits
from specserve.runtime.sampling.seeded import gumbel_noise
from specserve.speculative.base import Drafter, RunnerReq, TargetRows, register_algorithm
from specserve.speculative.drafters import ASSETS
from specserve.speculative.eagle_tree import SampledTree, TopKTree, level_widths, topk_children
from specserve.speculative.models import Eagle3Head, EagleHead, load_draft_head
from specserve.speculative.models.base import HeadOutput
from specserve.speculative.options import (
    DraftTreeOptions,
    ResolveContext,
    SpecConfig,
    check_tree_shape,
    flag,
    option,
)
from specserve.speculative.token_map import load_token_map
from specserve.speculative.tree import DraftTree
from specserve.speculative.verify import QMode

logger = logging.getLogger(__name__)


def draft_matmul_dtype(name: str, device: torch.device) -> torch.dtype | str:
    """How a head's CPU matmuls multiply, for --speculative-draft-matmul-dtype: "auto" is q8_0
    blocks on the CPU engine's kernels where the extension is built (a quarter of the fp32
    weight bytes a draft step streams; docs/benchmarks.md, "Draft models and heads on the
    default model"), else bfloat16 where the
    CPU multiplies bf16 natively, else float32. Off the CPU nothing is prepacked, so it does
    not apply. Drafts only: verification is the target's, so output is unchanged."""
    if name == "float32" or device.type != "cpu":
        return torch.float32
    if name in BLOCK_FORMATS:
        return name
    if name == "auto":
        from specserve.kernels import cpu

        if cpu.available()[0]:
            return "q8_0"
    if name == "bfloat16" and not onednn_bf16_available():
        logger.warning("--speculative-draft-matmul-dtype bfloat16: this CPU has no bf16 path "
                       "(oneDNN needs AVX-512 or AVX-NE-CONVERT); the draft multiplies in "
                       "float32")
        return torch.float32
    if name == "bfloat16" or cpu_has_native_bf16():
        return torch.bfloat16
    return torch.float32


TOKEN_MAP_EAGLE3_ERROR = ("--speculative-token-map applies to EAGLE-1/2 heads; EAGLE-3 heads carry "
                          "their own draft vocabulary (d2t)")

# the EAGLE-3 head trained for the default model (specserve/speculative/train, model card in its
# README)
DEFAULT_EAGLE3_HEAD = ASSETS / "eagle3-smollm2-135m-instruct"
# (num_steps, topk, num_draft_tokens) when unset, by device type. CPU: every draft step costs a
# head layer plus an LM-head matmul, and a verify node ~1 ms (~5% of a decode step), so a
# shallow, narrow tree pays off: with the shipped head (acceptance at depth 3 ~0.05), 2 steps of
# top-2 and 4 nodes beat 3 steps of top-4 and 8 nodes (1.29x against 1.14x) on train-split
# ShareGPT prompts (docs/benchmarks.md, "Draft models and heads on the default model"). CUDA:
# SGLang's Llama default.
EAGLE_TREE_DEFAULTS = {"cpu": (2, 2, 4), "cuda": (5, 4, 8)}


@dataclass(frozen=True)
class EagleOptions(DraftTreeOptions):
    token_map: str | None = option(
        None, "EAGLE-1/2: draft only over these target token ids (SGLang's hot token map: .pt "
        "read with weights_only, .safetensors, .json or .npy); lossless, EAGLE-3 heads carry "
        "their own draft vocabulary")


@dataclass(slots=True)
class HeadState:
    """The head's output at a request's last committed row."""

    logits: Tensor  # [V_head]: scores the root's children
    hidden: Tensor  # [H]: the hidden input of the root's children
    top: tuple[Tensor, Tensor] | None = None  # its top-k (log q [k], head ids [k]), if known


@dataclass(slots=True)
class _Pending:
    """Committed rows of one request the head has not run over yet: positions [start, end),
    their target features and the tokens that follow them."""

    start: int
    end: int
    features: list[Tensor]  # chunks of [n, F] (F = H, or 3H for EAGLE-3's fused features)
    next_tokens: list[int]
    slots: Tensor  # the request's slots, covering [0, end)


@dataclass(slots=True)
class _HeadReq:
    """What the drafter keeps of one request (its one entry in `EagleDrafter.reqs`)."""

    state: HeadState | None = None  # the head's output at its last committed row
    pending: _Pending | None = None  # rows the head has not run over yet
    # earlier runs of its rows that wait behind a gap of skipped steps (see `draft_extend`),
    # in position order
    waited: list[_Pending] = field(default_factory=list)
    idle: int = 0  # steps since it last drafted


@dataclass(slots=True)
class _Growing:
    req: RunnerReq
    builder: TopKTree | SampledTree
    frontier: list[int]
    hidden: dict[int, Tensor]  # node → its head output hidden [H] (root: HeadState.hidden)
    slot: dict[int, int] = field(default_factory=dict)  # node → its scratch KV slot


@register_algorithm("EAGLE")
class EagleDrafter(Drafter):
    q_mode = QMode.WITHOUT_REPLACEMENT  # for the sampled trees; top-k trees carry no q
    head_kind = "eagle"
    options = EagleOptions
    vllm_methods = ("eagle",)
    shipped_head: Path | None = None

    @classmethod
    def resolve_options(cls, opts: EagleOptions, ctx: ResolveContext) -> EagleOptions:
        """The head checkpoint (the shipped one with the default model) and the tree shape:
        unset values from the device's default; top-k 1 is a chain."""
        draft = opts.draft_model_path
        if not draft:
            shipped = cls.shipped_head is not None and (cls.shipped_head / "config.json").exists()
            if not (ctx.default_model and shipped):
                raise ValueError(f"--speculative-algorithm {cls.algorithm_name()} needs "
                                 f"{flag('draft_model_path')} (an EAGLE head checkpoint); only "
                                 "the default model with EAGLE3 has a shipped head")
            draft = str(cls.shipped_head)
        if opts.token_map is not None:
            if cls.head_kind == "eagle3":
                raise ValueError(TOKEN_MAP_EAGLE3_ERROR)
            from specserve.speculative.token_map import check_token_map_path

            check_token_map_path(opts.token_map)
        auto = EAGLE_TREE_DEFAULTS.get(ctx.device, EAGLE_TREE_DEFAULTS["cpu"])
        steps, topk, n = check_tree_shape(opts.num_steps, opts.eagle_topk, opts.num_draft_tokens,
                                          auto)
        opts = dataclasses.replace(opts, num_steps=steps, eagle_topk=topk, num_draft_tokens=n,
                                   draft_model_path=draft)
        return super().resolve_options(opts, ctx)

    @classmethod
    def chain_options(cls, k: int) -> dict:
        return {"num_steps": k, "eagle_topk": 1, "num_draft_tokens": k + 1}

    def describe(self) -> str:
        cfg = self.cfg
        tree = (cfg.num_steps, cfg.eagle_topk, cfg.num_draft_tokens)
        auto = tree == EAGLE_TREE_DEFAULTS.get(self.runner.device.type)
        return (f"tree of {tree[0]} steps, top-k {tree[1]}, {tree[2]} nodes"
                f"{f' (the {self.runner.device.type} default)' if auto else ''}; sampling: "
                + ("top-k trees, q ignored (target-only)" if cfg.eagle_target_only
                   else "children drawn from q, verified with q"))

    def __init__(self, cfg: SpecConfig, runner) -> None:
        super().__init__(cfg, runner)
        assert cfg.num_steps >= 1 and cfg.eagle_topk >= 1, "num_steps and eagle_topk must be >= 1"
        if cfg.token_map and self.head_kind != "eagle":
            raise ValueError(TOKEN_MAP_EAGLE3_ERROR)
        self.target_capacity = runner.kv_capacity
        self.scratch = max(64, 16 * (cfg.num_steps - 1) * cfg.eagle_topk)
        self.head = self._load_head(cfg, runner, self.target_capacity + self.scratch)
        if self.head.config.kind != self.head_kind:
            raise ValueError(f"--speculative-algorithm {cfg.algorithm} needs a "
                             f"{self.head_kind} head; {cfg.draft_model_path} holds a "
                             f"{self.head.config.kind} head")
        self.vocab_size = runner.model_config.vocab_size
        # [V_draft] target id of each draft id (EAGLE-3's d2t, or a token map's hot ids), None
        # when the head scores the whole target vocabulary
        self.to_target = None
        if cfg.token_map:
            if not isinstance(self.head, EagleHead):
                raise ValueError(TOKEN_MAP_EAGLE3_ERROR)
            hot = load_token_map(cfg.token_map, self.vocab_size)
            model = runner.model
            tied = model.embed_tokens if runner.model_config.tie_word_embeddings else None
            self.head.restrict_vocab(hot, model.lm_head, tied)
            self.to_target = self.head.hot_ids
            logger.info("EAGLE drafts over %d of %d tokens (%s)", hot.numel(), self.vocab_size,
                        cfg.token_map)
        self.matmul_dtype = draft_matmul_dtype(cfg.draft_matmul_dtype, self.head.kv_pool.device)
        threads = getattr(runner, "kernel_threads", None)
        if (isinstance(self.head, Eagle3Head) and self.matmul_dtype in BLOCK_FORMATS
                and self.head.run_in_cpu_engine(self.matmul_dtype,
                                                threads or torch.get_num_threads())):
            logger.info("EAGLE-3 head runs in the CPU engine, weights in %s", self.matmul_dtype)
        elif self.head.pack_weights(self.matmul_dtype, threads):
            logger.info("EAGLE head linears prepacked, multiplying in %s",
                        str(self.matmul_dtype).removeprefix("torch."))
        self.backend = self.head.create_backend()
        self.capture_layers = tuple(self.head.capture_layers)
        self.needs_final_hidden = self.head.needs_final_hidden
        self.device = self.head.kv_pool.device
        if isinstance(self.head, Eagle3Head):
            self.to_target = self.head.map_to_target(
                torch.arange(self.head.config.draft_vocab_size, device=self.device))
        self.reqs: dict[str, _HeadReq] = {}  # per request: its head state and waiting rows
        self.dropped_rows = 0  # pending rows of idle requests that never went through the head
        self._draft_ids: Tensor | None = None  # [V_head] target id per head id (coupling)

    def _load_head(self, cfg: SpecConfig, runner, kv_capacity: int):
        """The draft head (a public EAGLE / EAGLE-3 checkpoint directory)."""
        assert cfg.draft_model_path, f"{cfg.algorithm} needs --speculative-draft-model-path"
        return load_draft_head(cfg.draft_model_path, runner.model_config, runner.model,
                               kv_capacity=kv_capacity)

    # ---- head forwards --------------------------------------------------------------------
    def _run_head(self, batch: ForwardBatch, hidden: Tensor, fused: bool) -> HeadOutput:
        """One head forward; `fused`: `hidden` is the target's (draft extend), else the head's
        own output (draft steps). Tests steer drafts by overriding this."""
        batch = batch.to(self.device)
        if isinstance(self.head, Eagle3Head):
            return self.head(batch, self.backend, hidden, hidden_is_fused=fused,
                             topk=self.cfg.eagle_topk)
        return self.head(batch, self.backend, hidden)

    # The head runs over committed rows lazily (see `draft_extend`): a request's rows wait until
    # it drafts, or until this many are pending, then go through the head in one batched
    # forward. 128 rows of EAGLE-3 features are ~0.9 MB per request.
    MAX_PENDING_ROWS = 128
    # A request that has not drafted for this many steps (the controller keeps it plain) is idle:
    # when MAX_PENDING_ROWS wait, or when it finishes, its rows are dropped instead of run
    # through the head, all but the last (so the head state is current when it drafts again).
    # Its head KV keeps a stale stretch there: that costs acceptance if it drafts again (or a
    # later request reuses its prefix), never exactness (every draft is verified). A
    # never-drafting EAGLE-3 server that ran its head over every row cost 9-15% at every
    # concurrency (`python -m benchmark.sweep_serving ... --config EAGLE3=...`).
    IDLE_STEPS = 64
    # While the drafter does not pay on the current traffic (`traffic_off`, set by the worker),
    # rows wait past MAX_PENDING_ROWS, up to this many over all requests (~57 MB of EAGLE-3
    # features), and a request that finishes drops its rows: a prompt does not go through
    # the head at prefill on a server that is not drafting (a never-drafting EAGLE-3 server at
    # batch 1 spent a third of its extra time per step there, `benchmark.profile_spec_step`),
    # and a request chosen for a server-wide probe runs the head over its whole history then.
    MAX_WAITING_ROWS = 8192

    @torch.inference_mode()
    def draft_extend(self, rows: list[TargetRows], out: ModelOutput) -> None:
        """Keep the committed rows' target features; the head runs over them when the request
        next drafts (`propose`), when MAX_PENDING_ROWS are waiting, or when it finishes
        (`release`, so a radix-cache hit on its prefix finds the head KV). A request the
        controller keeps from drafting then costs no head forward per step: its rows go through
        the head in batches, where a row costs a small fraction of a one-row forward. The head
        KV and state that result are the eager ones (same rows, same positions, same slots)."""
        # rows that waited (`traffic_off`) before a gap of steps run without the drafter
        # (`skipped`) are still valid where their slots are unchanged: they keep waiting as a
        # closed run (the gap's positions stay stale) and go through the head with the newer
        # rows, in one batch, when the request drafts; a run whose slots changed (retracted
        # and re-admitted) is dropped
        for r in rows:
            q = self._req(r.rid)
            p = q.pending
            if p is not None and p.end < r.prefix_len and self._valid(p, r.slots):
                q.waited.append(p)
                q.pending = None
            kept = []
            for w in q.waited:
                if w.end <= r.prefix_len and self._valid(w, r.slots):
                    kept.append(w)
                else:
                    self.dropped_rows += w.end - w.start
            q.waited = kept
        hidden = self.head.target_hidden(out)  # [T, H] or [T, 3H] (EAGLE-3 fused features)
        index = torch.cat([r.hidden_rows for r in rows]).to(hidden.device)
        feats = hidden[index]  # [sum n, F]: a copy, the forward's buffers can go
        full, off = [], 0
        for r in rows:
            n = len(r.next_tokens)
            q = self.reqs[r.rid]
            p = q.pending
            if p is not None and (p.end != r.prefix_len or not self._valid(p, r.slots)):
                p = None  # retracted and re-admitted: its old rows' slots are gone
            if p is None:
                p = q.pending = _Pending(r.prefix_len, r.prefix_len, [], [], r.slots)
            p.features.append(feats[off : off + n])
            p.next_tokens += r.next_tokens
            p.end += n
            p.slots = r.slots
            off += n
            waiting = p.end - p.start + sum(w.end - w.start for w in q.waited)
            if waiting >= self.MAX_PENDING_ROWS and not self._may_wait():
                if q.idle >= self.IDLE_STEPS:
                    self._drop_pending(r.rid)
                else:
                    full.append(r.rid)
        self._catch_up(full)

    def _req(self, rid: str) -> _HeadReq:
        q = self.reqs.get(rid)
        if q is None:
            q = self.reqs[rid] = _HeadReq()
        return q

    @staticmethod
    def _valid(p: _Pending, slots: Tensor) -> bool:
        """The request's slots still hold run p's positions (not retracted since)."""
        return torch.equal(slots[p.start : p.end], p.slots[p.start : p.end])

    def _waiting_rows(self) -> int:
        return sum((q.pending.end - q.pending.start if q.pending is not None else 0)
                   + sum(w.end - w.start for w in q.waited) for q in self.reqs.values())

    def _may_wait(self) -> bool:
        """Rows may wait past MAX_PENDING_ROWS (see MAX_WAITING_ROWS)."""
        return self.traffic_off and self._waiting_rows() < self.MAX_WAITING_ROWS

    def _drop_pending(self, rid: str) -> None:
        """Forget an idle request's pending rows but the last (see IDLE_STEPS)."""
        q = self.reqs[rid]
        self.dropped_rows += sum(w.end - w.start for w in q.waited)
        q.waited = []
        p = q.pending
        if p is None or p.end - p.start <= 1:
            return
        self.dropped_rows += p.end - p.start - 1
        last = p.features[-1][-1:]
        p.features, p.next_tokens, p.start = [last], p.next_tokens[-1:], p.end - 1

    def _catch_up(self, rids: list[str]) -> None:
        """Run the head over these requests' pending rows, one batched DRAFT_EXTEND: head row
        t at position t, its KV into the target's slot of position t (mirror); keep the last
        row's output per request. A request's waited runs are entries of their own before its
        open run, in position order: every backend writes a layer's KV for the whole batch
        before any entry attends, so a later run sees the earlier runs' head KV as if they
        had gone through the head one after another."""
        items = []
        for rid in rids:
            q = self.reqs.get(rid)
            if q is None:
                continue
            items += [(rid, w) for w in q.waited]
            if q.pending is not None:
                items.append((rid, q.pending))
            q.waited, q.pending = [], None
        if not items:
            return
        batch = ForwardBatch.build(
            ForwardMode.DRAFT_EXTEND, [p.next_tokens for _, p in items],
            [p.slots[: p.end] for _, p in items], [p.start for _, p in items])
        feats = torch.cat([f for _, p in items for f in p.features])
        res = self._run_head(batch, feats, fused=True)
        last = (torch.tensor([p.end - p.start for _, p in items]).cumsum(0) - 1).tolist()
        for b, (rid, _) in enumerate(items):
            top = None if res.top_ids is None else (res.top_logq[b], res.top_ids[b])
            self.reqs[rid].state = HeadState(res.logits[b], res.hidden[last[b]], top)

    # ---- drafting --------------------------------------------------------------------------
    def _sampled(self, r: RunnerReq) -> bool:
        return r.params is not None and not r.params.is_greedy and not self.cfg.eagle_target_only

    @torch.inference_mode()
    def propose(self, reqs: list[RunnerReq]) -> list[DraftTree]:
        trees: list[DraftTree | None] = [None] * len(reqs)
        work: list[tuple[int, _Growing]] = []
        for r in reqs:
            q = self._req(r.rid)
            q.idle = 0 if r.budget > 1 else q.idle + 1
        self._catch_up([r.rid for r in reqs if r.budget > 1])
        for i, r in enumerate(reqs):
            if r.budget <= 1:
                trees[i] = DraftTree.root(r.tokens[-1])
                continue
            st = self.reqs[r.rid].state
            assert st is not None, f"{r.rid}: no draft extend ran before its first decode step"
            assert r.prefix_slots is not None and r.prefix_slots.numel() == len(r.tokens) - 1, (
                f"{r.rid}: prefix slots must cover the committed tokens")
            depth = min(self.cfg.num_steps, r.budget - 1)
            if self._sampled(r):
                widths = level_widths(r.budget - 1, depth, self.cfg.eagle_topk)
                builder = SampledTree(r.tokens[-1], widths, self.vocab_size, self.to_target)
            else:
                builder = TopKTree(r.tokens[-1], self.cfg.eagle_topk, depth)
            work.append((i, _Growing(r, builder, [0], {0: st.hidden})))
        if work:
            self._grow([g for _, g in work])
        for i, g in work:
            b = g.builder
            trees[i] = b.finalize(g.req.budget) if isinstance(b, TopKTree) else b.finalize()
        return trees

    def _grow(self, items: list[_Growing]) -> None:
        # level 1 comes from the kept output of the last committed row: no forward needed
        states = [self.reqs[g.req.rid].state for g in items]
        logits = torch.stack([s.logits for s in states])  # [B, V_head]
        top = None
        if all(s.top is not None for s in states):
            top = (torch.stack([s.top[0] for s in states]), torch.stack([s.top[1] for s in states]))
        self._expand(items, [[0] for _ in items], logits, top)
        need = sum(len(g.builder.widths) if isinstance(g.builder, SampledTree)
                   else g.builder.max_depth for g in items) * self.cfg.eagle_topk
        self._ensure_scratch(need)
        next_slot = self.target_capacity + 1  # scratch slots, reused every step
        while True:
            rows = [(g, u) for g in items for u in g.frontier]
            if not rows:
                return
            tokens, kv, prefix_lens, hidden = [], [], [], []
            for g, u in rows:
                g.slot[u] = next_slot
                next_slot += 1
                path = self._ancestors(g, u)  # depth 1 .. d of u, root excluded
                tokens.append([g.builder.tokens[u]])
                kv.append(torch.cat([g.req.prefix_slots,
                                     torch.tensor([g.slot[a] for a in path])]))
                prefix_lens.append(kv[-1].numel() - 1)  # = L + depth - 1: the row's position
                hidden.append(g.hidden[g.builder.parents[u]])
            batch = ForwardBatch.build(ForwardMode.DECODE, tokens, kv, prefix_lens)
            res = self._run_head(batch, torch.stack(hidden), fused=False)
            for j, (g, u) in enumerate(rows):
                g.hidden[u] = res.hidden[j]
            top = None if res.top_ids is None else (res.top_logq, res.top_ids)
            self._expand(items, [g.frontier for g in items], res.logits, top)

    @staticmethod
    def _ancestors(g: _Growing, u: int) -> list[int]:
        path = []
        while u > 0:
            path.append(u)
            u = g.builder.parents[u]
        return path[::-1]

    def _expand(self, items: list[_Growing], nodes: list[list[int]], logits: Tensor,
                top: tuple[Tensor, Tensor] | None = None) -> None:
        """Feed head logits [sum len(nodes), V_head] (rows in item order) to the builders;
        `top`: the rows' top-k (log q, head ids) [rows, k] where the head computed them."""
        offsets = torch.tensor([0] + [len(n) for n in nodes]).cumsum(0).tolist()
        greedy = [b for b, g in enumerate(items) if nodes[b] and isinstance(g.builder, TopKTree)]
        sampled = [b for b, g in enumerate(items)
                   if nodes[b] and isinstance(g.builder, SampledTree)]
        if greedy:
            sel = torch.cat([torch.arange(offsets[b], offsets[b + 1]) for b in greedy])
            if top is not None and top[1].shape[-1] >= self.cfg.eagle_topk:
                every = len(greedy) == len(items) and sel.numel() == top[1].shape[0]
                logq, ids = (top if every else (top[0][sel], top[1][sel]))
                k = self.cfg.eagle_topk
                logq, ids = logq[:, :k], ids[:, :k]
                toks = ids if self.to_target is None else self.to_target[ids]
            else:
                logq, toks = topk_children(logits[sel.to(logits.device)], self.cfg.eagle_topk,
                                           self.to_target)  # [M, k] each
            logq, toks, off = logq.cpu(), toks.cpu(), 0
            for b in greedy:
                n = len(nodes[b])
                items[b].frontier = items[b].builder.expand(
                    nodes[b], logq[off : off + n], toks[off : off + n])
                off += n
        if sampled:
            sel = torch.cat([torch.arange(offsets[b], offsets[b + 1]) for b in sampled])
            params = [items[b].req.params for b in sampled for _ in nodes[b]]
            q = self._draft_q(logits[sel.to(logits.device)], params)  # [M, V]
            off = 0
            for b in sampled:
                n, g = len(nodes[b]), items[b]
                g.frontier = g.builder.expand(nodes[b], q[off : off + n],
                                              gumbel=self._coupled_noise(g, nodes[b]))
                off += n
        for b, g in enumerate(items):
            if not nodes[b]:
                g.frontier = []

    def _coupled_noise(self, g: _Growing, nodes: list[int]) -> Tensor | None:
        """A seeded request's Gumbel noise [V_head] for the children of `nodes` (one level, so
        one position: len(tokens) + depth), over the target ids the head's vocabulary stands
        for; None for unseeded requests (fresh noise from the global RNG)."""
        seed = g.req.params.seed if g.req.params is not None else None
        if seed is None:
            return None
        if self._draft_ids is None:
            self._draft_ids = (torch.arange(self.vocab_size, device=self.device)
                               if self.to_target is None else self.to_target.to(self.device))
        position = len(g.req.tokens) + g.builder.depths[nodes[0]]
        return gumbel_noise(seed, position, self._draft_ids)

    def _draft_q(self, logits: Tensor, params: list) -> Tensor:
        """Head logits [M, V_head] → q [M, V_head], processed with each request's temperature /
        top-k / top-p / min-p like its target distribution. Over a reduced draft vocabulary
        this equals processing the target-vocabulary row with -inf outside it (softmax, the
        top-k / top-p order and min-p's maximum only see the finite entries); `SampledTree`
        maps the drawn ids with `to_target`."""
        info = SamplingBatchInfo.from_params(params, logits.shape[-1], logits.device)
        return process_logits(logits.float(), info)

    def _ensure_scratch(self, need: int) -> None:
        """Grow the head pool's scratch region (slots above the target's capacity) to `need`."""
        if need <= self.scratch:
            return
        old = self.head.kv_pool
        self.scratch = max(need, 2 * self.scratch)
        pool = KVPool(self.target_capacity + self.scratch, 1, old.num_kv_heads, old.head_dim,
                      old.dtype, old.device)
        rows = old.capacity + 1
        pool.k[0][:rows] = old.k[0]
        pool.v[0][:rows] = old.v[0]
        self.head.set_kv_pool(pool)
        self.backend = self.head.create_backend()
        logger.info("EAGLE head scratch KV grown to %d slots", self.scratch)

    def skipped(self, rids: list[str]) -> None:
        for rid in rids:
            self._req(rid).idle += 1

    def live_requests(self) -> int:
        return len(self.reqs)

    def release(self, rid: str) -> None:
        q = self.reqs.get(rid)
        if q is None:
            return
        if q.idle >= self.IDLE_STEPS or self.traffic_off:
            # idle, or nobody drafts: its head KV stays stale (IDLE_STEPS, MAX_WAITING_ROWS)
            runs = q.waited + ([q.pending] if q.pending is not None else [])
            self.dropped_rows += sum(w.end - w.start for w in runs)
            q.waited, q.pending = [], None
        with torch.inference_mode():
            self._catch_up([rid])  # its prefix may stay in the radix cache: complete its head KV
        del self.reqs[rid]

    def reset(self) -> None:
        self.reqs.clear()


@register_algorithm("EAGLE3")
class Eagle3Drafter(EagleDrafter):
    head_kind = "eagle3"
    vllm_methods = ("eagle3",)
    shipped_head = DEFAULT_EAGLE3_HEAD


@register_algorithm("MTP")
class MtpDrafter(EagleDrafter):
    """The MTP module a checkpoint ships (MiMo's `model.mtp_layers.0`, DeepSeek-V3's
    `model.layers.{N}` with `eh_proj`), drafting like an EAGLE-1 head: chains or top-k trees of
    `--speculative-num-steps` steps, the module fed its own output after the first step
    (specserve/speculative/models/mtp_head.py). `--speculative-draft-model-path` defaults to the
    target's own directory."""

    head_kind = "mtp"
    vllm_methods = ("mtp", "nextn", "mimo_mtp", "deepseek_mtp")

    @classmethod
    def resolve_options(cls, opts: EagleOptions, ctx: ResolveContext) -> EagleOptions:
        if opts.token_map is not None:
            raise ValueError(f"{flag('token_map')} applies to EAGLE-1/2 heads, not MTP")
        auto = EAGLE_TREE_DEFAULTS.get(ctx.device, EAGLE_TREE_DEFAULTS["cpu"])
        steps, topk, n = check_tree_shape(opts.num_steps, opts.eagle_topk, opts.num_draft_tokens,
                                          auto)
        opts = dataclasses.replace(opts, num_steps=steps, eagle_topk=topk, num_draft_tokens=n)
        return Drafter.resolve_options(opts, ctx)

    def _load_head(self, cfg: SpecConfig, runner, kv_capacity: int):
        from specserve.speculative.models.mtp_head import load_mtp_head

        path = cfg.draft_model_path or runner.model_config.model_dir
        return load_mtp_head(path, runner.model_config, runner.model, kv_capacity=kv_capacity)
