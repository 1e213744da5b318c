"""What the runtime expects of speculative decoding, without importing it.

The launcher builds a `Speculation` (specserve/speculative/plugin.py) and hands it to the scheduler
and model-runner processes: the scheduler gets a `SpecController` from it (which requests draft this
step and how many tree nodes each gets: specserve/speculative/controller.py), the runner a
`SpecWorker` (draft, verify in one tree-masked forward, commit: specserve/speculative/worker.py).
The runtime only calls the methods below; `runtime` never imports `speculative` (the layering test,
tests/unit/test_layering.py, enforces it).
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any, NamedTuple, Protocol

import torch

if TYPE_CHECKING:
    from specserve.runtime.models.llama import ModelOutput
    from specserve.runtime.verify_cost import VerifyCost


@dataclass(slots=True)
class TargetRows:
    """One request's rows of a target forward that are now committed, for a drafter that reads
    the target's hidden states or keeps KV of its own.

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


class StepPlan(NamedTuple):
    """The controller's decision for one decode step of the scheduler's running requests."""

    sizes: list[int]  # KV slots per request: its tree's nodes at most, root included
    confident: list[bool]  # draft only what the drafter is sure of (it may give 1 node)
    idle: bool  # nobody drafts now or in the next few steps: the step may skip the drafter
    traffic_off: bool  # drafting does not pay on the current traffic (a drafter may defer work)
    # the drafter's nodes per request when fewer than its slots (a constrained request's other
    # slots are for the tokens its grammar forces); None: every slot
    drafts: list[int] | None = None
    # per request: a probe of the verify cost (draft the whole budget, uncut by the drafter's
    # cost estimate); None: none
    explore: list[bool] | None = None


class SpecController(Protocol):
    """Decides, per step, which requests draft and how many nodes each gets (scheduler side).
    Its per-request state lives on the scheduler's request record (`Req.spec`)."""

    base_nodes: int  # tree nodes a request gets per step when it drafts (KV to reserve)

    def new_request(self, constrained: bool = False) -> Any: ...

    def plan(self, states: Sequence[Any]) -> StepPlan: ...

    def observe(self, states: Sequence[Any], infos: Sequence[dict], step_s: float,
                forward: tuple[int, float] | None = None) -> None: ...

    def reset(self) -> None: ...

    def curve_update(self) -> VerifyCost | None:
        """The curve it plans with, when it moved since it was last asked (for the runner's
        drafter)."""

    def remeasure_rows(self) -> list[int] | None:
        """Row counts to time the curve at again while the server is idle (its start-up
        measurement disagrees with what the steps show), or None."""

    def set_prior(self, measured: VerifyCost) -> None: ...

    def cost_info(self) -> dict: ...


class SpecWorker(Protocol):
    """Runs speculative decode steps in the model runner and carries the drafter's view of
    every committed token (runner side)."""

    verify_cost: VerifyCost
    capture_layers: tuple[int, ...]  # layers every target forward captures for the drafter
    needs_final_hidden: bool
    wants_committed_rows: bool  # `draft_extend` must see every committed row

    def step(self, reqs: list, idle: bool = False,
             traffic_off: bool = False) -> tuple[list[list[int]], list[dict]]: ...

    def observe(self, rid: str, history: list[int], num_new: int) -> None: ...

    def draft_extend(self, rows: list[TargetRows], out: ModelOutput) -> None: ...

    def release(self, rid: str) -> None: ...

    def live_requests(self) -> int: ...  # requests it keeps state for

    def reset(self) -> None: ...

    def describe(self) -> str: ...

    def set_verify_cost(self, cost: VerifyCost) -> None: ...


class Speculation(Protocol):
    """The launcher's speculative configuration, picklable (it travels to spawned processes)."""

    algorithm: str

    def create_worker(self, runner, before_measure=None) -> SpecWorker: ...

    def create_controller(self, verify_cost: VerifyCost) -> SpecController: ...

    def server_info(self) -> dict: ...
