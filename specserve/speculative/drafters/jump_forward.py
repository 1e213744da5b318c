"""JUMP_FORWARD: no drafts of its own; a constrained request's grammar-forced tokens only.

Every speculative algorithm drafts, for a request that follows a grammar, the tokens the grammar
leaves no choice about (JSON punctuation, a schema's key names: specserve/speculative/worker.py,
`_constrain`), which the target then verifies like any draft. This algorithm is that and
nothing else: a plain server with a grammar backend runs with it unless
`--disable-grammar-jump-forward` (specserve/launch/server_args.py), so constrained requests skip
what the grammar already decided while every other request decodes as plainly as without it.
"""

from __future__ import annotations

from specserve.speculative.base import Drafter, RunnerReq, register_algorithm
from specserve.speculative.tree import DraftTree


@register_algorithm("JUMP_FORWARD")
class JumpForwardDrafter(Drafter):
    default_num_draft_tokens = {"cpu": 1, "torch": 1}

    def describe(self) -> str:
        return "no drafts of its own: only the tokens a request's grammar forces"

    def propose(self, reqs: list[RunnerReq]) -> list[DraftTree]:
        return [DraftTree.root(r.tokens[-1]) for r in reqs]
