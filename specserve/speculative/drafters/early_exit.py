"""EARLY_EXIT: self-speculative decoding. The draft is the target's own first E layers, then
its final norm and LM head (no extra weights, no extra KV) — or, with an exit adapter
(`--speculative-draft-model-path`, trained by `python -m specserve.speculative.train --algorithm
EARLY_EXIT`; the default model's ships in assets/), a small residual MLP on layer E's output
and the target's LM-head rows of a reduced draft vocabulary
(`specserve/speculative/models/exit_adapter.py`): better drafts, and a cheaper output head.

Drafting (specserve/speculative/drafters/chain.py): step j runs chain node j through layers [0, E)
of the target (`ModelRunner.forward(layers=(0, E))`), writing their KV into the request's fresh slot
j of the target's own pool, and takes the draft token from the early exit's logits. The first E
layers' KV of every committed token is the target's own (the verify pass writes all layers of every
node), so drafting needs no state between steps.

Verify (LayerSkip-style reuse). On the CPU engine every layer's output is batch-invariant, so
node j's hidden state after layer E in the draft pass is bit for bit the one the full verify
pass computes. The verify pass then runs layers [0, E) only for the nodes the draft never fed
(the last draft, or the root when nothing was drafted: one token per request) and resumes every
node at layer E from the draft's hidden states; the first E layers' KV of the fed nodes is
already in place. Output is exactly the plain forward's (tested). On the torch engine, whose
layers are not batch-invariant, the verify pass recomputes all layers.
"""

from __future__ import annotations

import dataclasses
import logging
from dataclasses import dataclass
from pathlib import Path

import torch

from specserve.runtime.forward_batch import ForwardBatch, ForwardMode
from specserve.runtime.models.llama import ModelOutput
from specserve.speculative.base import register_algorithm
from specserve.speculative.drafters import ASSETS
from specserve.speculative.drafters.chain import Chain, ChainDrafter
from specserve.speculative.options import DraftTreeOptions, ResolveContext, SpecConfig, flag, option
from specserve.speculative.tree import DraftTree

logger = logging.getLogger(__name__)

# the exit adapter trained for the default model (model card in its README)
DEFAULT_EXIT_ADAPTER = ASSETS / "early-exit-adapter-smollm2-135m-instruct"


@dataclass(frozen=True)
class EarlyExitOptions(DraftTreeOptions):
    early_exit_layer: int | None = option(
        None, "EARLY_EXIT: the draft is the target's first E layers + final norm + LM head "
        "(unset: a quarter of the target's layers, at least 1; logged at start-up)")
    early_exit_disable_verify_resume: bool = option(
        False, "EARLY_EXIT: the verify pass recomputes the first E layers instead of resuming "
        "at layer E from the draft pass's hidden states (resuming is used on the CPU engine "
        "only, where it equals the full pass bit for bit)")


@register_algorithm("EARLY_EXIT")
class EarlyExitDrafter(ChainDrafter):
    options = EarlyExitOptions
    vllm_methods = ("early_exit", "layer_skip", "self_speculative")
    default_num_steps = {"cpu": 2, "torch": 3}
    # drafting keeps no state between steps (the draft layers' KV is the target's own)

    shipped_adapter = DEFAULT_EXIT_ADAPTER

    @classmethod
    def resolve_options(cls, opts: EarlyExitOptions, ctx: ResolveContext) -> EarlyExitOptions:
        from specserve.speculative.models.exit_adapter import CONFIG_KEY, is_exit_adapter

        if opts.early_exit_layer is not None and opts.early_exit_layer < 1:
            raise ValueError(f"{flag('early_exit_layer')} must be >= 1")
        path = opts.draft_model_path
        if path is None and ctx.default_model and is_exit_adapter(cls.shipped_adapter) \
                and opts.early_exit_layer is None:
            path = str(cls.shipped_adapter)  # the default model's trained adapter
        if path is not None:
            if not is_exit_adapter(path):
                raise ValueError(f"EARLY_EXIT: {flag('draft_model_path')} {path} is not an exit "
                                 f"adapter (a directory whose config.json has {CONFIG_KEY}; "
                                 "python -m specserve.speculative.train --algorithm "
                                 "EARLY_EXIT makes one)")
            import json

            layer = json.loads((Path(path) / "config.json").read_text())[CONFIG_KEY]["exit_layer"]
            if opts.early_exit_layer not in (None, layer):
                raise ValueError(f"EARLY_EXIT: the adapter {path} reads layer {layer}, not "
                                 f"{flag('early_exit_layer')} {opts.early_exit_layer}")
            opts = dataclasses.replace(opts, draft_model_path=path, early_exit_layer=layer)
        return super().resolve_options(opts, ctx)

    def __init__(self, cfg: SpecConfig, runner) -> None:
        super().__init__(cfg, runner)
        num_layers = runner.model_config.num_hidden_layers
        exit_layer = cfg.early_exit_layer or max(1, num_layers // 4)
        if not 1 <= exit_layer < num_layers:
            raise ValueError(f"{flag('early_exit_layer')} must be in [1, {num_layers - 1}] for "
                             f"this {num_layers}-layer target, got {exit_layer}")
        self.exit_layer = exit_layer
        self.num_layers = num_layers
        self.adapter = None
        if cfg.draft_model_path:
            self.adapter = self._load_adapter(cfg, runner)
        self.resume = runner.engine == "cpu" and not cfg.early_exit_disable_verify_resume
        # per request of the last `propose`, in order: hidden after layer E of each fed node
        self._fed: list[list[torch.Tensor]] = []

    def _load_adapter(self, cfg: SpecConfig, runner):
        from specserve.speculative.drafters.eagle import draft_matmul_dtype
        from specserve.speculative.models.exit_adapter import load_exit_adapter

        adapter = load_exit_adapter(cfg.draft_model_path)
        s, mc = adapter.shape, runner.model_config
        if (s.num_target_layers, s.hidden_size, s.target_vocab_size) != (
                mc.num_hidden_layers, mc.hidden_size, mc.vocab_size):
            raise ValueError(
                f"EARLY_EXIT: the adapter {cfg.draft_model_path} was trained for a target of "
                f"{s.num_target_layers} layers, hidden {s.hidden_size}, vocabulary "
                f"{s.target_vocab_size}; this one has {mc.num_hidden_layers}, {mc.hidden_size}, "
                f"{mc.vocab_size}")
        adapter.to(runner.device)
        dtype = draft_matmul_dtype(cfg.draft_matmul_dtype, runner.device)
        adapter.pack_weights(dtype, getattr(runner, "kernel_threads", None))
        logger.info("EARLY_EXIT adapter %s: layer %d, MLP %d, draft vocabulary %d, matmuls in %s",
                    cfg.draft_model_path, s.exit_layer, s.intermediate_size, s.draft_vocab_size,
                    str(dtype).removeprefix("torch."))
        return adapter

    def describe(self) -> str:
        return (f"chains of {self.cfg.num_steps} drafts from layer {self.exit_layer} of "
                f"{self.num_layers}" + (" through an exit adapter" if self.adapter else "")
                + "; verify "
                + ("resumes at that layer from the draft's hidden states" if self.resume
                   else "recomputes every layer"))

    def _begin(self, chains: list[Chain]) -> None:
        self._fed = [[] for _ in chains]

    def _step(self, chains: list[Chain], j: int) -> torch.Tensor:
        tokens, slots, prefix = [], [], []
        for c in chains:
            committed = len(c.req.tokens) - 1
            tokens.append([c.tokens[j]])
            slots.append(torch.cat([c.req.prefix_slots, c.req.fresh_slots[: j + 1]]))
            prefix.append(committed + j)
        capture = (self.exit_layer,) if self.resume or self.adapter else ()
        batch = ForwardBatch.build(ForwardMode.DECODE, tokens, slots, prefix,
                                   capture_layers=capture)
        if self.adapter is not None:  # the target's own LM head is not wanted
            batch.logits_indices = batch.logits_indices[:0]
        out = self.runner.forward(batch, layers=(0, self.exit_layer))
        hidden = out.captured[self.exit_layer] if capture else None  # [B, H]
        if self.resume:
            for b, c in enumerate(chains):
                self._fed[c.index].append(hidden[b])
        if self.adapter is not None:
            return self.adapter.full_logits(hidden)
        return out.logits

    def target_forward(self, batch: ForwardBatch, trees: list[DraftTree],
                       return_final_hidden: bool) -> ModelOutput:
        if not self.resume:
            return self.runner.forward(batch, return_final_hidden)
        fed, self._fed = self._fed, []
        assert len(fed) == len(trees), "target_forward must follow this step's propose"
        if all(t.num_nodes == 1 for t in trees):  # nobody drafted: nothing to resume from
            return self.runner.forward(batch, return_final_hidden)
        # the nodes the draft never fed: the last node of each chain (the root if no draft)
        tokens, slots, prefix = [], [], []
        start = 0
        for b, tree in enumerate(trees):
            n = tree.num_nodes
            assert len(fed[b]) == n - 1, f"request {b}: {len(fed[b])} fed nodes for {n}"
            seq = batch.prefix_lens[b] + batch.extend_lens[b]
            tokens.append([int(tree.tokens[-1])])
            slots.append(batch.kv_indices[start : start + seq])
            prefix.append(seq - 1)
            start += seq
        tail = ForwardBatch.build(ForwardMode.DECODE, tokens, slots, prefix,
                                  capture_layers=(self.exit_layer,))
        tail.logits_indices = tail.logits_indices[:0]  # only the hidden state is wanted
        last = self.runner.forward(tail, layers=(0, self.exit_layer)).captured[self.exit_layer]
        rows = []
        for b in range(len(trees)):
            rows += fed[b]
            rows.append(last[b])
        hidden = torch.stack(rows)  # [sum n, H] in the batch's token order
        return self.runner.forward(batch, return_final_hidden, layers=(self.exit_layer,
                                                                       self.num_layers),
                                   hidden_in=hidden)
