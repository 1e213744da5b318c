"""The speculative-algorithm interface and its registry.

A drafter proposes one `DraftTree` per request (node 0 = the last verified token); the
`SpeculativeWorker` (speculative/worker.py) verifies every tree in one target forward with tree
masks, commits the accepted path's KV and calls `observe` so the drafter can update its state.
A drafter that reads the target's hidden states (EAGLE heads) declares which (`capture_layers`,
`needs_final_hidden`); every target forward then returns them and `draft_extend` receives the
rows that became committed: each prefill chunk, and after verification the root + accepted path.
Adding an algorithm means one file: a `Drafter` subclass decorated with
`@register_algorithm("NAME")` whose `options` dataclass declares its flags
(speculative/options.py) and whose `resolve_options` fills its "auto" values, plus the file's
import line in `speculative/__init__.py` (or, outside this package, its module named in
`SPECSERVE_PLUGINS`). ServerArgs, argparse, `--help`, `Engine(**kwargs)`, `/server_info` and
`speculative_config` are derived from the registry.
"""

from __future__ import annotations

import dataclasses
from abc import ABC, abstractmethod
from collections.abc import Callable
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any, ClassVar

import torch

from speculative.options import ResolveContext, SpecConfig, SpecOptions, flag
from speculative.tree import DraftTree
from speculative.verify import QMode

if TYPE_CHECKING:
    from runtime.forward_batch import ForwardBatch
    from runtime.models.llama import ModelOutput
    from runtime.sampling.sampling_params import SamplingParams


@dataclass(slots=True)
class SpecReq:
    """What a drafter sees of one request."""

    rid: str
    tokens: list[int]  # prompt + outputs; tokens[-1] is the root (verified, KV not yet cached)
    budget: int  # most nodes its tree may have, root included (1 = no drafting)
    # a seeded request's randomness is a function of (params.seed, position): a drafter that
    # samples draws the children of a depth-d node with the noise of position len(tokens) + d
    # (runtime/sampling/seeded.py); unseeded requests draw from torch's global RNG
    params: SamplingParams | None = None
    prefix_slots: torch.Tensor | None = None  # [len(tokens) - 1] KV slots of the committed tokens
    # drafts kept failing (the worker's backoff): draft only when confident, which only a
    # drafter with `drafts_when_backed_off` is asked to judge (the others get budget 1)
    backed_off: bool = False
    # [>= budget] the request's fresh KV slots: tree node i's target KV is written to slot i by
    # the verify pass (a chain drafter writes node j's draft KV there too)
    fresh_slots: torch.Tensor | None = None


@dataclass(slots=True)
class TargetRows:
    """One request's rows of a target forward that are now committed, for `draft_extend`.

    Row j sits at position prefix_len + j: its token is `tokens[j]`, its hidden state is row
    `hidden_rows[j]` of the forward's `ModelOutput`, its KV is in `slots[prefix_len + j]`, and
    `next_tokens[j]` is the token at position prefix_len + j + 1 (the last one may be the token
    just sampled). After a verify step the rows are the root and the accepted drafts, which
    were tree nodes `tree_nodes` (root 0 first); after a prefill chunk `tree_nodes` is None (so
    also for a decoding request that rode along in a mixed step: one row). `admitted`: these
    rows open the request's slot table in the runner (its first chunk, or its first after a
    retraction): per-request state about its prefix's KV slots no longer holds.
    """

    rid: str
    prefix_len: int
    slots: torch.Tensor  # [prefix_len + n] int64, prefix first
    hidden_rows: torch.Tensor  # [n] int64
    next_tokens: list[int]  # [n]
    tokens: list[int]  # [n]
    tree_nodes: list[int] | None = None  # [n]
    admitted: bool = False


class Drafter(ABC):
    # the algorithm's options (a frozen dataclass of `option(...)` fields, speculative/options.py)
    options: ClassVar[type] = SpecOptions
    # tree nodes per step, root included, when --speculative-num-draft-tokens is unset, by
    # engine ("cpu": the C++ engine, "torch": the reference engine)
    default_num_draft_tokens: ClassVar[dict[str, int] | None] = None
    # vLLM `speculative_config` method names that mean this algorithm
    vllm_methods: ClassVar[tuple[str, ...]] = ()
    algorithm: ClassVar[str] = ""  # set by `register_algorithm`
    # how verification treats the drafter's distribution (speculative/verify.py) for trees that
    # carry `draft_probs`; a tree without them is verified ONE_HOT
    q_mode: QMode = QMode.ONE_HOT
    # what every target forward must also return for `draft_extend` (nothing by default)
    capture_layers: tuple[int, ...] = ()
    needs_final_hidden: bool = False
    # the drafter keeps KV of its own at the target's slot indices (a draft model): it gets
    # `draft_extend` for every committed chunk even without reading target hidden states
    mirrors_kv: bool = False
    # backoff (speculative/worker.py): a request whose drafts are accepted less than this many
    # tokens per drafting step on average stops drafting, except one probe every
    # `probe_every` steps. Break-even grows with the draft's cost per step.
    min_accept_per_step: ClassVar[float] = 0.2
    probe_every: ClassVar[int] = 8
    # the drafter reads the target's own choice (argmax of the raw logits) at every tree node
    # after each verify forward (`after_verify`): Lookahead's Jacobi iteration runs on it
    wants_node_argmax: bool = False
    # whether `propose` judges a backed-off request's draft itself (`SpecReq.backed_off`); if
    # not, a backed-off request gets budget 1 (no draft) except on the worker's probe steps
    drafts_when_backed_off: bool = False
    # while the drafter as a whole does not pay (speculative/worker.py: `_off_step`), steps in
    # which nobody drafts may skip it entirely (no `propose`, no capture, no `draft_extend`);
    # it hears of them through `skipped`. For drafters whose per-step work only serves drafting
    skips_when_off: ClassVar[bool] = False
    # a step in which no request may draft (every budget 1) is plain decoding for this drafter
    # (`_plain_step`, whatever the traffic): its `propose` would return bare roots and none of
    # its state depends on the step (NGRAM: the trie counts a request's tokens when it drafts;
    # LOOKAHEAD: a window advances only when its columns were drafted)
    plain_without_budget: ClassVar[bool] = False
    # set by the worker every step: the drafter as a whole does not pay on the current traffic
    # (the server-wide regime of `_off_step`); a drafter may defer work that only serves
    # drafting while it holds (EAGLE heads: the head pass over committed rows)
    traffic_off: bool = False
    @classmethod
    def cuts_own_trees(cls, cfg: SpecConfig) -> bool:
        """Whether, with these options, the drafter cuts each tree itself where another node
        would cost more verify time than it is expected to bring, from its own per-node
        probabilities and the verify-cost curve at the step's batch size (SUFFIX:
        `worth_drafting`); the scheduler then hands out the size caps instead of planning
        sizes from each request's running acceptance rate (runtime/scheduler/spec_budget.py),
        which knows less than the drafter's probabilities."""
        return False

    def __init__(self, cfg: SpecConfig, runner) -> None:
        self.cfg = cfg
        self.runner = runner
        # T(n)/T(1) of the target's forward on this machine (runtime/verify_cost.py); set by
        # the speculative worker, None until then (and without a runner)
        self.verify_cost = None

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
    def scheduler_sizes(cls, cfg: SpecConfig) -> tuple[int, int, bool]:
        """(num_draft_tokens, max_draft_tokens, deep_for_all) for the scheduler: tree nodes per
        request per step, the most a request may get while the step's total stays within it
        (a request decoding alone), and whether any request may get them (a drafter that sizes
        its trees by how confident it is) or only one that accepted a whole draft last step."""
        return cfg.num_draft_tokens, cfg.num_draft_tokens, False

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
    def propose(self, reqs: list[SpecReq]) -> list[DraftTree]:
        """One tree per request, at most `budget` nodes, root token = tokens[-1]."""

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
        """These requests decoded one token in a step the worker ran without the drafter
        (only for `skips_when_off` and `plain_without_budget` drafters): no rows reached
        `draft_extend`."""

    def observe(self, rid: str, tokens: list[int], num_new: int) -> None:  # noqa: B027
        """The request's history grew by its last `num_new` tokens (prompt first time)."""

    def release(self, rid: str) -> None:  # noqa: B027
        """The request finished; drop per-request state."""

    def reset(self) -> None:  # noqa: B027
        """Drop all learned state (flush_cache)."""


ALGORITHMS: dict[str, type[Drafter]] = {}


def register_algorithm(name: str) -> Callable[[type[Drafter]], type[Drafter]]:
    def deco(cls: type[Drafter]) -> type[Drafter]:
        assert name not in ALGORITHMS, f"speculative algorithm {name} registered twice"
        assert name == name.upper(), f"algorithm names are upper case: {name}"
        ALGORITHMS[name] = cls
        cls.algorithm = name
        return cls

    return deco


def check_algorithm(name: str) -> str:
    import speculative  # noqa: F401 - importing the package registers the algorithms

    key = name.upper()
    if key not in ALGORITHMS:
        raise ValueError(
            f"unknown --speculative-algorithm {name!r}; available: {sorted(ALGORITHMS)}"
        )
    return key


def create_drafter(cfg: SpecConfig, runner) -> Drafter:
    return ALGORITHMS[check_algorithm(cfg.algorithm)](cfg, runner)
