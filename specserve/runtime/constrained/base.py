"""The grammar backend interface: compile, ship, match.

A backend compiles a `GrammarSpec` for one tokenizer (`compile`), turns the compiled grammar
into bytes and back (`dump` / `load`: it travels from the tokenizer process, where it is
compiled, to the model runner, as msgpack bytes, never pickled), and makes per-request
`Matcher`s that say which tokens may come next and advance on the committed ones. Token masks
are bit masks, `[rows, ceil(vocab / 32)]` int32 (bit t of a row: token t allowed), the layout
xgrammar and llguidance share.

A `Matcher` also offers what masking a tree of drafts along each node's own path needs: `fork`
copies its state, `rollback` undoes accepted tokens, `forced_tokens` gives the tokens the
grammar leaves no choice about.
"""

from __future__ import annotations

import sys
from abc import ABC, abstractmethod
from typing import Any

import numpy as np
import torch

from specserve.runtime.constrained.spec import GrammarSpec


class GrammarCompileError(Exception):
    """The backend cannot compile a grammar (bad syntax, unsupported feature, no output)."""


class Matcher(ABC):
    """One request's position in its grammar. `backend` made it (its masks' layout)."""

    backend: GrammarBackend

    @abstractmethod
    def fill_mask(self, masks: torch.Tensor, row: int) -> None:
        """Write the tokens allowed next into `masks[row]` (a buffer of `allocate_masks`)."""

    @abstractmethod
    def accept(self, token: int) -> bool:
        """Advance on a committed token; False (state unchanged) if the grammar forbids it."""

    @abstractmethod
    def rollback(self, num_tokens: int) -> None:
        """Undo the last `num_tokens` accepted tokens."""

    @abstractmethod
    def is_terminated(self) -> bool:
        """Whether the grammar is complete and its stop token (EOS) accepted: nothing may follow."""

    @abstractmethod
    def forced_tokens(self) -> list[int]:
        """Tokens the grammar forces from here (jump-forward), each accepted in turn by a copy
        of this matcher; the tail of the forced text that a longer token could still cover is
        left out. The matcher itself does not move."""

    @abstractmethod
    def fork(self) -> Matcher:
        """An independent copy of this matcher's state (for one path of a draft tree)."""


class GrammarBackend(ABC):
    """Compiles grammars for one tokenizer and vocabulary width (the model's logits width)."""

    name: str = ""

    @abstractmethod
    def compile(self, spec: GrammarSpec) -> Any:
        """The compiled grammar; raises GrammarCompileError with a message for the client."""

    @abstractmethod
    def dump(self, compiled: Any) -> bytes:
        """The compiled grammar as bytes for `load` in another process of the same model."""

    @abstractmethod
    def load(self, data: bytes) -> Any:
        """A compiled grammar from `dump`'s bytes."""

    @abstractmethod
    def matcher(self, compiled: Any) -> Matcher:
        """A fresh matcher at the start of the grammar."""

    @abstractmethod
    def allocate_masks(self, rows: int) -> torch.Tensor:
        """A bit mask buffer for `rows` rows of logits ([rows, ceil(vocab / 32)] int32)."""

    def forbidden(self, masks: torch.Tensor, vocab_size: int) -> np.ndarray:
        """[rows, vocab_size] bool, True where `masks` forbids the token: the bits unpacked
        (numpy's unpackbits over the int32 words' little-endian bytes)."""
        assert sys.byteorder == "little", "bit masks are read as little-endian words"
        words = masks.cpu().numpy().view(np.uint8)
        return np.unpackbits(words, axis=-1, bitorder="little")[:, :vocab_size] == 0

    @property
    def compile_options(self) -> str:
        """Options that change what `compile` produces (part of the cache key)."""
        return ""
