"""A traced request's steps as the HTTP API returns them (`meta_info.spec_trace`).

The scheduler sends `TraceStep`s (specserve/runtime/messages.py) with the tokens they gave; here
each gets the text of each of its tokens, so a client can show the output token by token and say how
each came: accepted draft at depth k, the bonus token of a verify step, or a plain step.
"""

from __future__ import annotations

from collections.abc import Callable

from specserve.runtime.messages import TraceStep

REPLACEMENT = "\ufffd"


class TokenPieces:
    """Each output token's share of the decoded text: the pieces of a request's tokens, in
    order, concatenate to its text. A token that ends inside a multi-byte character gets ""
    and the one that completes the character gets all of it. Each piece is the difference of
    two decodes with a few tokens of left context (a SentencePiece token's leading space, a
    character split over tokens), so a token costs two short decodes, not a whole one."""

    CONTEXT = 6

    def __init__(self, tokenizer) -> None:
        self.tokenizer = tokenizer
        self.ids: list[int] = []

    def _text(self, ids: list[int]) -> str:
        return self.tokenizer.decode(ids, skip_special_tokens=True).rstrip(REPLACEMENT)

    def extend(self, ids: list[int]) -> list[str]:
        out = []
        for t in ids:
            window = self.ids[max(0, len(self.ids) - self.CONTEXT):]
            before = self._text(window)
            window.append(t)
            after = self._text(window)
            self.ids.append(t)
            out.append(after[len(before):] if after.startswith(before) else "")
        return out


def step_json(step: TraceStep, pieces: list[str], token_text: Callable[[int], str]) -> dict:
    """One step of `meta_info.spec_trace` (docs/playground.md, "The trace")."""
    out = {"start": step.start, "output": step.output, "text": pieces,
           "step_ms": step.step_s * 1e3, "batch_size": step.batch_size, "tree": None}
    tree = step.tree
    if tree is not None:
        out["tree"] = {"tokens": tree.tokens, "parents": tree.parents,
                       "texts": [token_text(t) for t in tree.tokens],
                       "draft_probs": tree.draft_probs, "accepted": tree.accepted,
                       "bonus": tree.bonus, "draft_ms": tree.draft_s * 1e3}
    return out
