"""The speculative-algorithm interface and its registry.

A drafter proposes one `DraftTree` per request (node 0 = the last verified token); the
`SpeculativeWorker` (speculative/worker.py) verifies every tree in one target forward with tree
masks, commits the accepted path's KV and calls `observe` so the drafter can update its state.
A drafter that reads the target's hidden states (EAGLE heads) declares which (`capture_layers`,
`needs_final_hidden`); every target forward then returns them and `draft_extend` receives the
rows that became committed: each prefill chunk, and after verification the root + accepted path.
Adding an algorithm means one file with a `Drafter` subclass decorated with
`@register_algorithm("NAME")`, plus its import line in `speculative/__init__.py`.
"""

from __future__ import annotations

from abc import ABC, abstractmethod
from collections.abc import Callable
from dataclasses import dataclass
from typing import TYPE_CHECKING

import torch

from speculative.tree import DraftTree
from speculative.verify import QMode

if TYPE_CHECKING:
    from runtime.models.llama import ModelOutput
    from runtime.sampling.sampling_params import SamplingParams


@dataclass(frozen=True)
class SpecConfig:
    algorithm: str
    num_draft_tokens: int  # tree nodes per request INCLUDING the root
    # NGRAM
    ngram_capacity: int = 1_000_000
    ngram_max_trie_depth: int = 18
    ngram_min_match_window: int = 1
    ngram_max_bfs_breadth: int = 10
    ngram_min_bfs_breadth: int = 1
    ngram_match_type: str = "BFS"
    ngram_external_corpus_path: str | None = None
    ngram_match_sizing: bool = True  # tree size grows with the context match length
    # short matches draft from the request's own prompt and output first (ngram_context.py)
    ngram_own_context: bool = True
    # EAGLE / EAGLE3 (speculative/eagle.py): head checkpoint, tree depth S and branching k
    draft_model_path: str | None = None
    num_steps: int = 3
    eagle_topk: int = 4
    # EAGLE-1/2: a reduced draft vocabulary (speculative/token_map.py), None = the whole one
    token_map: str | None = None
    # sampling: verify top-k trees with q ignored (SGLang's target-only) instead of drafting
    # children from q without replacement and verifying with q
    eagle_target_only: bool = False
    # CPU: the head's matmuls in "float32" / "bfloat16" / "auto" (bf16 where the CPU has bf16
    # dot products); drafts only, so lossless either way
    draft_matmul_dtype: str = "auto"
    # LOSSY when below 1.0 (SGLang's --speculative-accept-threshold-single / -acc)
    accept_threshold_single: float = 1.0
    accept_threshold_acc: float = 1.0
    # shrink a request's draft budget after consecutive fully rejected drafts
    adaptive: bool = True


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


@dataclass(slots=True)
class TargetRows:
    """One request's rows of a target forward that are now committed, for `draft_extend`.

    Row j sits at position prefix_len + j: its hidden state is row `hidden_rows[j]` of the
    forward's `ModelOutput`, its KV is in `slots[prefix_len + j]`, and `next_tokens[j]` is the
    token at position prefix_len + j + 1 (the last one may be the token just sampled).
    """

    rid: str
    prefix_len: int
    slots: torch.Tensor  # [prefix_len + n] int64, prefix first
    hidden_rows: torch.Tensor  # [n] int64
    next_tokens: list[int]  # [n]


class Drafter(ABC):
    # how verification treats the drafter's distribution (speculative/verify.py) for trees that
    # carry `draft_probs`; a tree without them is verified ONE_HOT
    q_mode: QMode = QMode.ONE_HOT
    # what every target forward must also return for `draft_extend` (nothing by default)
    capture_layers: tuple[int, ...] = ()
    needs_final_hidden: bool = False
    # whether `propose` judges a backed-off request's draft itself (`SpecReq.backed_off`); if
    # not, a backed-off request gets budget 1 (no draft) except on the worker's probe steps
    drafts_when_backed_off: bool = False

    def __init__(self, cfg: SpecConfig, runner) -> None:
        self.cfg = cfg
        self.runner = runner

    @abstractmethod
    def propose(self, reqs: list[SpecReq]) -> list[DraftTree]:
        """One tree per request, at most `budget` nodes, root token = tokens[-1]."""

    @property
    def reads_target_hidden(self) -> bool:
        return self.needs_final_hidden or bool(self.capture_layers)

    def draft_extend(self, rows: list[TargetRows], out: ModelOutput) -> None:  # noqa: B027
        """Committed rows of a target forward run with this drafter's `capture_layers` /
        `needs_final_hidden`; called only when `reads_target_hidden`."""

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
        ALGORITHMS[name] = cls
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
