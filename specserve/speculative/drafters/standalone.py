"""STANDALONE (SGLang's name): a separate, smaller draft model with the target's tokenizer.

The draft is any model we load as a target (an HF directory or a .gguf of the Llama family),
run by a second `ModelRunner` in the model-runner process on the same engine. Its KV pool has
the target's capacity and is addressed by the SAME slot indices: the draft KV of position t
lives in the slot holding the target KV of position t, so the scheduler's allocator, radix
cache, retraction and aborts cover the draft's KV with no bookkeeping of their own; the draft KV
of a cached prefix is recomputed, not shared (below).

Which committed positions have draft KV (`_valid[rid]`, a prefix of the request's positions):
none after a (re)admission — prefill chunks do not run the draft, and a radix-hit prefix may
hold no draft KV or another request's, so none is trusted. A speculative step's first draft
forward catches up every committed position without draft KV plus the root (one EXTEND), then
feeds the chain's nodes 1 .. S-1 into the request's fresh slots, where the commit keeps the
accepted ones; the last draft, when accepted, and a root that was not drafted from (backed
off) are caught up by the next drafting step. So a request that never drafts (backed off)
never pays for the draft's prefill, and catching up costs no forward of its own.

Checked at start-up, one line each: the draft's tokenizer must name the same token as the
target's at every id both embeddings hold (their sizes may differ), and it must handle the
target's context. A GGUF draft is converted as a GGUF target is (llama.cpp's `-md`).
"""

from __future__ import annotations

import logging
from dataclasses import dataclass
from pathlib import Path

import torch

from specserve.kernels.cpu.packing import FORMAT_NAMES
from specserve.runtime.forward_batch import ForwardBatch, ForwardMode
from specserve.runtime.model_loader.config import ModelConfig
from specserve.runtime.model_runner.model_runner import ModelRunner, RunnerConfig
from specserve.runtime.models.llama import ModelOutput
from specserve.speculative.base import TargetRows, register_algorithm
from specserve.speculative.drafters import ASSETS
from specserve.speculative.drafters.chain import Chain, ChainDrafter, TreeRow
from specserve.speculative.models.vocab_head import ReducedVocabHead, read_draft_vocab
from specserve.speculative.options import DraftTreeOptions, ResolveContext, SpecConfig, flag, option

logger = logging.getLogger(__name__)

# the draft distilled for the default model (python -m specserve.speculative.train --algorithm
# STANDALONE; model card in its README)
DEFAULT_DRAFT_MODEL = ASSETS / "draft-smollm2-135m-instruct"


class DraftModelError(ValueError):
    """A draft model that cannot serve this target."""


def check_draft_compatible(draft_dir: str, target_dir: str, target_context: int,
                           name: str | None = None) -> None:
    """Raise DraftModelError (one line, naming the draft `name`: what the user gave, e.g. a
    .gguf whose conversion is `draft_dir`) if the draft cannot draft for the target.

    The two tokenizers must name the same token at every id both models' embeddings hold;
    the embeddings may differ in size (a family pads its small and large models differently:
    Qwen2.5's 151936 and 152064 rows), the draft's logits are then cut or padded to the
    target's (`StandaloneDrafter._logits`). File names and architectures are not compared.
    """
    from specserve.runtime.model_loader.tokenizer import load_tokenizer

    name = name or draft_dir
    dcfg, tcfg = ModelConfig.from_dir(draft_dir), ModelConfig.from_dir(target_dir)
    limit = min(dcfg.vocab_size, tcfg.vocab_size)
    draft = _tokens_by_id(load_tokenizer(draft_dir).get_vocab(), limit)
    target = _tokens_by_id(load_tokenizer(target_dir).get_vocab(), limit)
    differ = sorted(i for i in draft.keys() & target.keys() if draft[i] != target[i])
    if differ:
        i = differ[0]
        raise DraftModelError(f"draft model {name} is not vocabulary-compatible with the "
                              f"target: its tokenizer names {len(differ)} of the ids below "
                              f"{limit} differently (id {i} is {draft[i]!r} in the draft, "
                              f"{target[i]!r} in the target); a draft needs the target's "
                              f"tokenizer")
    if dcfg.max_position_embeddings < target_context:
        raise DraftModelError(f"draft model {name} handles {dcfg.max_position_embeddings} "
                              f"positions, fewer than the target's context of {target_context}; "
                              "pass --context-length <= that")


def _tokens_by_id(vocab: dict[str, int], limit: int) -> dict[int, str]:
    return {i: token for token, i in vocab.items() if i < limit}


@dataclass(frozen=True)
class StandaloneOptions(DraftTreeOptions):
    draft_weight_format: str = option(
        "auto", "STANDALONE on the CPU engine: the draft model's weight format (auto: a GGUF's "
        "own blocks; q8_0 for a float checkpoint: a distilled 4-layer draft of the default model "
        "agreed with the target on 10-28%% of answer tokens in f32, bf16 and q8_0 and on 0%% in "
        "q4_1 (docs/benchmarks.md), small drafts do not survive 4-bit rounding). Drafts "
        "only: the target verifies every token, so output is unchanged",
        choices=("auto", *FORMAT_NAMES))
    draft_output_vocab: str = option(
        "auto", "STANDALONE: the draft's output vocabulary. auto: the reduced draft vocabulary "
        "a distilled draft ships (draft_vocab.safetensors beside its weights: the LM-head rows "
        "of its most frequent answer tokens, a fraction of the head's cost per draft token), "
        "else the full one; full: always the full LM head. Drafts only: output is unchanged",
        choices=("auto", "full"))


@dataclass(slots=True)
class _DraftKV:
    """What the draft model's own KV covers for one request."""

    valid: int = 0  # committed positions with draft KV
    fed: int = 0  # chain nodes fed in its last step


@register_algorithm("STANDALONE")
class StandaloneDrafter(ChainDrafter):
    options = StandaloneOptions
    vllm_methods = ("draft_model", "standalone")
    mirrors_kv = True
    supports_trees = True
    default_num_steps = {"cpu": 3, "torch": 4}
    shipped_draft = DEFAULT_DRAFT_MODEL
    # a skipped step leaves `valid` where it was (its position gets draft KV when the request
    # next drafts); `_fed` is written by every propose before the draft_extend that reads it

    @classmethod
    def resolve_options(cls, opts: StandaloneOptions, ctx: ResolveContext) -> StandaloneOptions:
        import dataclasses

        if not opts.draft_model_path:
            shipped = (cls.shipped_draft / "config.json").exists()
            if not (ctx.default_model and shipped):
                raise ValueError(f"--speculative-algorithm STANDALONE needs "
                                 f"{flag('draft_model_path')} (a draft model: HF directory or "
                                 ".gguf); only the default model has a shipped draft")
            opts = dataclasses.replace(opts, draft_model_path=str(cls.shipped_draft))
        return super().resolve_options(opts, ctx)

    def __init__(self, cfg: SpecConfig, runner) -> None:
        super().__init__(cfg, runner)
        from specserve.runtime.model_loader.default_model import resolve_model_path

        if not cfg.draft_model_path:
            raise DraftModelError(f"STANDALONE needs {flag('draft_model_path')}")
        from specserve.speculative.models.draft_asset import is_draft_asset, materialize

        draft_dir = str(materialize(cfg.draft_model_path) if is_draft_asset(cfg.draft_model_path)
                        else resolve_model_path(cfg.draft_model_path))
        check_draft_compatible(draft_dir, runner.model_config.model_dir, runner.context_length,
                               cfg.draft_model_path)
        fmt = "torch"
        if runner.engine == "cpu":
            fmt = cfg.draft_weight_format
            if fmt == "auto":
                fmt = "auto" if (Path(draft_dir) / "gguf_blocks.safetensors").exists() else "q8_0"
        # top-k trees: unverified tree nodes keep their draft KV in scratch slots above the
        # target's capacity, reused by every tree level group
        self.scratch = 0
        if self.grows_trees:
            self.scratch = max(1024, 32 * (1 + cfg.eagle_topk * cfg.num_steps))
        self.target_capacity = runner.kv_capacity
        self.draft = ModelRunner(RunnerConfig(
            draft_dir, runner.device.type, str(runner.dtype).removeprefix("torch."),
            max_total_tokens=runner.kv_capacity + self.scratch,
            context_length=runner.context_length,
            weight_format=fmt, num_threads=getattr(runner, "kernel_threads", None),
        ))
        assert self.draft.kv_capacity == runner.kv_capacity + self.scratch, (
            "the draft KV mirrors the target's")
        self.draft_layers = self.draft.model_config.num_hidden_layers
        self.vocab_head = None
        ids = read_draft_vocab(draft_dir) if cfg.draft_output_vocab == "auto" else None
        if ids is not None:
            from specserve.speculative.drafters.eagle import draft_matmul_dtype

            rows = self.draft.model.lm_head.weight[ids]
            self.vocab_head = ReducedVocabHead(rows, ids, self.draft.vocab_size)
            self.vocab_head.pack_weights(draft_matmul_dtype(cfg.draft_matmul_dtype,
                                                            runner.device),
                                         getattr(runner, "kernel_threads", None))
        self.reqs: dict[str, _DraftKV] = {}  # per request: what its draft KV covers

    def _tree_scratch(self) -> int:
        return self.scratch

    def _tree_scratch_base(self) -> int:
        return self.target_capacity + 1  # slot 0 pads; the target's are 1 .. capacity

    def _tree_step(self, rows: list[TreeRow]) -> torch.Tensor:
        batch = ForwardBatch.build(ForwardMode.DECODE, [[r.token] for r in rows],
                                   [r.kv for r in rows], [r.kv.numel() - 1 for r in rows])
        return self._logits(batch)

    def _logits(self, batch: ForwardBatch) -> torch.Tensor:
        if self.vocab_head is None:
            return self._target_width(self.draft.forward(batch).logits)
        rows = batch.logits_indices
        batch.logits_indices = rows[:0]  # the full LM head is not wanted
        out = self.draft.forward(batch, return_final_hidden=True)
        return self._target_width(self.vocab_head(out.final_hidden[rows]))

    def _embeddable(self, ids: list[int]) -> list[int]:
        # the target's ids past a smaller draft embedding (padding rows a trained model does
        # not emit) are fed to the draft as id 0: its drafts there may miss, output is the same
        n = self.draft.vocab_size
        return ids if n >= self.vocab_size else [i if i < n else 0 for i in ids]

    def _target_width(self, logits: torch.Tensor) -> torch.Tensor:
        # [n, draft vocab] -> at least [n, target vocab]: ids the draft's embedding lacks get
        # -inf (never drafted); the chain cuts a wider draft's extra ids
        missing = self.vocab_size - logits.shape[-1]
        return logits if missing <= 0 else torch.nn.functional.pad(logits, (0, missing),
                                                                   value=float("-inf"))

    def describe(self) -> str:
        shape = (f"top-{self.cfg.eagle_topk} trees of depth {self.cfg.num_steps}, "
                 f"{self.cfg.num_draft_tokens} nodes" if self.grows_trees
                 else f"chains of {self.cfg.num_steps} drafts")
        vocab = (f", output vocabulary {self.vocab_head.ids.numel()}" if self.vocab_head
                 else "")
        return (f"{shape} from {self.cfg.draft_model_path} "
                f"({self.draft_layers} layers, {self.draft.engine} engine{vocab})")

    def _step(self, chains: list[Chain], j: int) -> torch.Tensor:
        tokens, slots, prefix = [], [], []
        mode = ForwardMode.EXTEND if j == 0 else ForwardMode.DECODE
        for c in chains:
            committed = len(c.req.tokens) - 1
            if j == 0:  # catch up the committed positions without draft KV, then the root
                q = self.reqs.get(c.req.rid)
                start = committed if q is None else min(q.valid, committed)
                tokens.append(self._embeddable(c.req.tokens[start:]))
                prefix.append(start)
            else:
                tokens.append([c.tokens[j]])
                prefix.append(committed + j)
            slots.append(torch.cat([c.req.prefix_slots, c.req.fresh_slots[: j + 1]]))
        return self._logits(ForwardBatch.build(mode, tokens, slots, prefix))

    def _end(self, chains: list[Chain]) -> None:
        for c in chains:
            q = self.reqs.setdefault(c.req.rid, _DraftKV())
            q.fed = c.depth
            if c.depth > 0:
                q.valid = len(c.req.tokens) - 1  # caught up to the root

    def draft_extend(self, rows: list[TargetRows], out: ModelOutput) -> None:
        for r in rows:
            if r.tree_nodes is None:
                # a prefill chunk, or a decoding request riding along with one: nothing runs
                # now (a request that never drafts, e.g. backed off, never pays for the draft's
                # prefill); the first draft step catches up. A (re)admission trusts no cached
                # slot: its radix-hit prefix may hold no draft KV or another request's. The next
                # chunk, or a rider, keeps the draft KV it has.
                q = self.reqs.setdefault(r.rid, _DraftKV())
                q.valid = min(0 if r.admitted else q.valid, r.prefix_len)
                continue
            q = self.reqs.get(r.rid)
            if q is not None and q.fed > 0:
                # verified: root + accepted drafts; the fed ones have draft KV in place
                q.valid = r.prefix_len + min(len(r.tree_nodes), q.fed)

    def live_requests(self) -> int:
        return len(self.reqs)

    def release(self, rid: str) -> None:
        self.reqs.pop(rid, None)

    def reset(self) -> None:
        self.reqs.clear()
