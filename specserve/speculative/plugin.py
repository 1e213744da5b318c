"""`Speculation`: what the launcher hands the runtime's processes for speculative decoding
(specserve/runtime/speculation.py states what they expect of it). It travels to spawned processes by
pickle at their start (never over a socket), so it holds only the resolved `SpecConfig`."""

from __future__ import annotations

from dataclasses import dataclass

from specserve.runtime.verify_cost import VerifyCost
from specserve.speculative.controller import SpecController
from specserve.speculative.options import PREFIX, SpecConfig
from specserve.speculative.registry import ALGORITHMS
from specserve.speculative.worker import SpeculativeWorker


@dataclass(frozen=True)
class Speculation:
    config: SpecConfig

    @property
    def algorithm(self) -> str:
        return self.config.algorithm

    def create_worker(self, runner, before_measure=None) -> SpeculativeWorker:
        """The model runner's speculative worker (its drafter, the verify-cost curve)."""
        return SpeculativeWorker.create(self.config, runner, before_measure)

    def create_controller(self, verify_cost: VerifyCost) -> SpecController:
        """The scheduler's speculation controller, planning with the runner's curve."""
        drafter = ALGORITHMS[self.config.algorithm]
        return SpecController(drafter.tree_sizes(self.config), verify_cost,
                              adaptive=not self.config.disable_adaptive)

    def server_info(self) -> dict:
        return {PREFIX + k: v for k, v in self.config.as_dict().items()}


def speculative_engine(algorithm: str, options: dict, **server_args):
    """An in-process `Engine` (specserve/runtime/engine.py) drafting with `algorithm` and its
    options by name (with or without the `speculative_` prefix): the trainer's evaluation runs on
    it."""
    from specserve.runtime.engine import Engine
    from specserve.runtime.model_runner.model_runner import resolve_device
    from specserve.runtime.server_args import BaseServerArgs
    from specserve.speculative.options import ResolveContext, resolve_spec_options

    default_model = server_args.get("model_path", "default") in ("default", None)
    args = BaseServerArgs(**server_args).resolve()
    ctx = ResolveContext(args.engine(), resolve_device(args.device).type, default_model)
    given = {k.removeprefix(PREFIX): v for k, v in options.items()}
    return Engine(args, Speculation(resolve_spec_options(algorithm, given, ctx)))
