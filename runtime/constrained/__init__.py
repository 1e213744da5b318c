"""Constrained decoding: outputs that match a JSON Schema, a regex, an EBNF grammar or a
structural tag (docs/structured_output.md).

- `spec.py`: which grammar a request asks for (`grammar_of`), checked;
- `base.py`: the backend interface (`GrammarBackend`, `Matcher`);
- `xgrammar_backend.py`: the default backend;
- `compiler.py`: compiling in the tokenizer process, off its event loop, with an LRU cache;
- `runner_grammars.py`: loading compiled grammars in the model runner, masking logits rows.
"""

from __future__ import annotations

import os
import threading
from collections.abc import Callable
from concurrent.futures import Future
from typing import Any

from runtime.constrained.base import GrammarBackend, GrammarCompileError, Matcher
from runtime.constrained.spec import GRAMMAR_FIELDS, MAX_GRAMMAR_BYTES, GrammarSpec, grammar_of

# --grammar-backend choices; "none" serves no grammar (such requests are a 400)
GRAMMAR_BACKENDS = ("xgrammar", "none")


def create_backend(name: str, tokenizer: Any, vocab_size: int, stop_token_ids: list[int],
                   any_whitespace: bool = True) -> GrammarBackend:
    """The backend `name` (GRAMMAR_BACKENDS but "none") for a tokenizer and a logits width."""
    if name == "xgrammar":
        from runtime.constrained.xgrammar_backend import XGrammarBackend

        return XGrammarBackend(tokenizer, vocab_size, stop_token_ids, any_whitespace)
    raise ValueError(f"unknown grammar backend {name!r}; choose one of {GRAMMAR_BACKENDS}")


def build_in_background(make: Callable[[], GrammarBackend]) -> Future:
    """`make()` on a thread of its own at the lowest CPU priority (~1.4 s of one core: the
    tokenizer and xgrammar's view of its vocabulary), so a server that just came up serves at
    full speed while it builds; a request with a grammar waits for it, the others do not."""
    fut: Future = Future()

    def run() -> None:
        try:  # Linux: a thread has a nice value of its own
            os.setpriority(os.PRIO_PROCESS, threading.get_native_id(), 19)
        except (AttributeError, OSError):
            pass
        try:
            fut.set_result(make())
        except BaseException as e:  # noqa: BLE001 (the waiting request reports it)
            fut.set_exception(e)

    threading.Thread(target=run, name="grammar-backend", daemon=True).start()
    return fut


__all__ = ["GRAMMAR_BACKENDS", "GRAMMAR_FIELDS", "MAX_GRAMMAR_BYTES", "GrammarBackend",
           "GrammarCompileError", "GrammarSpec", "Matcher", "build_in_background",
           "create_backend", "grammar_of"]
