"""The speculative-algorithm interface: what a drafter is.

A drafter proposes one `DraftTree` per request (node 0 = the last verified token); the
`SpeculativeWorker` (specserve/speculative/worker.py) verifies every tree in one target forward with
tree masks, commits the accepted path's KV and calls `observe` so the drafter can update its state.
A drafter that reads the target's hidden states (EAGLE heads) declares which (`capture_layers`,
`needs_final_hidden`); every target forward then returns them and `draft_extend` receives the rows
that became committed: each prefill chunk, and after verification the root + accepted path. How much
to draft is not the drafter's call: the controller (specserve/speculative/controller.py) decides
from what the drafter is (`tree_sizes`), each request's acceptance and the measured costs.

Adding an algorithm means one file: a `Drafter` subclass decorated with
`@register_algorithm("NAME")` (specserve/speculative/registry.py) whose `options` dataclass declares
its flags (specserve/speculative/options.py) and whose `resolve_options` fills its "auto" values,
plus the file's import line in `specserve/speculative/__init__.py` (or, outside this package, its
module named in `SPECSERVE_PLUGINS`). ServerArgs, argparse, `--help`, `Engine(**kwargs)`,
`/server_info` and `speculative_config` are derived from the registry.
"""

from __future__ import annotations

import dataclasses
from abc import ABC, abstractmethod
from typing import TYPE_CHECKING, Any, ClassVar

from specserve.runtime.model_runner.req import RunnerReq
from specserve.runtime.speculation import TargetRows
from specserve.speculative.options import ResolveContext, SpecConfig, SpecOptions, flag
from specserve.speculative.planning import TreeSizes
from specserve.speculative.registry import (
    ALGORITHMS,
    check_algorithm,
    create_drafter,
    register_algorithm,
)
from specserve.speculative.tree import DraftTree
from specserve.speculative.verify import QMode

if TYPE_CHECKING:
    from specserve.runtime.forward_batch import ForwardBatch
    from specserve.runtime.models.llama import ModelOutput

__all__ = ["ALGORITHMS", "Drafter", "RunnerReq", "SpecConfig", "TargetRows", "check_algorithm",
           "create_drafter", "register_algorithm"]


class Drafter(ABC):
    # the algorithm's options (a frozen dataclass of `option(...)` fields,
    # specserve/speculative/options.py)
    options: ClassVar[type] = SpecOptions
    # tree nodes per step, root included, when --speculative-num-draft-tokens is unset, by
    # engine ("cpu": the C++ engine, "torch": the reference engine)
    default_num_draft_tokens: ClassVar[dict[str, int] | None] = None
    # vLLM `speculative_config` method names that mean this algorithm
    vllm_methods: ClassVar[tuple[str, ...]] = ()
    algorithm: ClassVar[str] = ""  # set by `register_algorithm`
    # how verification treats the drafter's distribution (specserve/speculative/verify.py) for trees
    # that carry `draft_probs`; a tree without them is verified ONE_HOT
    q_mode: QMode = QMode.ONE_HOT
    # what every target forward must also return for `draft_extend` (nothing by default)
    capture_layers: tuple[int, ...] = ()
    needs_final_hidden: bool = False
    # the drafter keeps KV of its own at the target's slot indices (a draft model): it gets
    # `draft_extend` for every committed chunk even without reading target hidden states
    mirrors_kv: bool = False
    # the drafter reads the target's own choice (argmax of the raw logits) at every tree node
    # after each verify forward (`after_verify`): Lookahead's Jacobi iteration runs on it
    wants_node_argmax: bool = False
    # a drafter that can tell a sure draft from a guess (a long context match): a request the
    # controller keeps from drafting may still draft what it is sure of (`confident_only`)
    judges_confidence: ClassVar[bool] = False

    def __init__(self, cfg: SpecConfig, runner) -> None:
        self.cfg = cfg
        self.runner = runner
        # T(n)/T(1) of the target's forward on this machine (specserve/runtime/verify_cost.py); set
        # by the speculative worker, None until then (and without a runner)
        self.verify_cost = None
        # set by the worker every step from the controller's plan: drafting does not pay on
        # the current traffic; a drafter may defer work that only serves drafting
        self.traffic_off = False

    @classmethod
    def resolve_options(cls, opts: Any, ctx: ResolveContext) -> Any:
        """`opts` (an instance of `cls.options`) with "auto" values made concrete and checked;
        raise ValueError with the flag's name on a bad value. The default fills the tree size
        from `default_num_draft_tokens` and checks the options every algorithm shares."""
        n = opts.num_draft_tokens
        if n is None:
            if not cls.default_num_draft_tokens:
                raise ValueError(f"{flag('num_draft_tokens')} is required for this algorithm")
            n = cls.default_num_draft_tokens.get(ctx.engine,
                                                 max(cls.default_num_draft_tokens.values()))
        if n < 1:
            raise ValueError(f"{flag('num_draft_tokens')} must be >= 1")
        for name in ("accept_threshold_single", "accept_threshold_acc"):
            if not 0.0 < getattr(opts, name) <= 1.0:
                raise ValueError(f"{flag(name)} must be in (0, 1]")
        for f in dataclasses.fields(opts):
            allowed = f.metadata.get("choices")
            if allowed and getattr(opts, f.name) not in allowed:
                raise ValueError(f"{flag(f.name)} must be one of {allowed}, got "
                                 f"{getattr(opts, f.name)!r}")
        return dataclasses.replace(opts, num_draft_tokens=n)

    @classmethod
    def tree_sizes(cls, cfg: SpecConfig) -> TreeSizes:
        """Its tree sizes with these options (per request per step, and alone) and what it
        judges itself, for the controller (specserve/speculative/controller.py)."""
        return TreeSizes(cfg.num_draft_tokens, cfg.num_draft_tokens,
                         judges_confidence=cls.judges_confidence)

    @classmethod
    def algorithm_name(cls) -> str:
        return cls.algorithm or cls.__name__

    @classmethod
    def chain_options(cls, k: int) -> dict[str, Any]:
        """The options of a chain of k drafts (vLLM's `num_speculative_tokens`)."""
        return {"num_draft_tokens": k + 1}

    def describe(self) -> str:
        """One line for the start-up log: what this drafter drafts."""
        return f"{self.cfg.num_draft_tokens} draft tokens per step (root included)"

    @abstractmethod
    def propose(self, reqs: list[RunnerReq]) -> list[DraftTree]:
        """One tree per request, at most `r.budget` nodes, root token = `r.tokens[-1]`. A
        request with `confident_only` gets only drafts the drafter is sure of (or a bare root).
        A seeded request's randomness is a function of (params.seed, position): a drafter that
        samples draws the children of a depth-d node with the noise of position
        len(tokens) + d (specserve/runtime/sampling/seeded.py)."""

    @property
    def reads_target_hidden(self) -> bool:
        return self.needs_final_hidden or bool(self.capture_layers)

    @property
    def wants_committed_rows(self) -> bool:
        return self.reads_target_hidden or self.mirrors_kv

    def draft_extend(self, rows: list[TargetRows], out: ModelOutput) -> None:  # noqa: B027
        """Committed rows of a target forward run with this drafter's `capture_layers` /
        `needs_final_hidden`; called only when `wants_committed_rows`."""

    def target_forward(self, batch: ForwardBatch, trees: list[DraftTree],
                       return_final_hidden: bool) -> ModelOutput:
        """The verify (or plain decode) forward of a speculative step. A drafter whose draft
        pass already computed part of it (the target's own early layers) overrides this to
        reuse that work; the result must be bit for bit the plain forward's."""
        return self.runner.forward(batch, return_final_hidden)

    def after_verify(self, rids: list[str], trees: list[DraftTree],  # noqa: B027
                     node_argmax: list[list[int]], accepted: list[list[int]]) -> None:
        """After a verify forward (only when `wants_node_argmax`, and only for a step in which
        some request drafted): per request, the target's argmax of the raw logits at each node
        of its tree and the accepted nodes (root first)."""

    def skipped(self, rids: list[str]) -> None:  # noqa: B027
        """These requests decoded one token in a step the worker ran without the drafter (no
        request could draft): no rows reached `draft_extend`."""

    def observe(self, rid: str, tokens: list[int], num_new: int) -> None:  # noqa: B027
        """The request's history grew by its last `num_new` tokens (prompt first time)."""

    def release(self, rid: str) -> None:  # noqa: B027
        """The request finished; drop per-request state."""

    def live_requests(self) -> int:
        """Requests this drafter keeps state for (0 for a drafter that keeps none; a drafter
        with per-request state counts it, so /server_info shows a release that never came)."""
        return 0

    def reset(self) -> None:  # noqa: B027
        """Drop all learned state (flush_cache)."""
