"""Constrained decoding: outputs that match a JSON Schema, a regex, an EBNF grammar or a
structural tag (docs/structured_output.md).

- `spec.py`: which grammar a request asks for (`grammar_of`), checked;
- `base.py`: the backend interface (`GrammarBackend`, `Matcher`);
- `xgrammar_backend.py`: the default backend; `llguidance_backend.py`: the lazy one (no
  per-grammar precompute: new schemas start at once);
- `compiler.py`: compiling in the tokenizer process, off its event loop, with an LRU cache;
- `runner_grammars.py`: loading compiled grammars in the model runner, masking logits rows.
"""

from __future__ import annotations

from typing import Any

from specserve.runtime.constrained.base import GrammarBackend, GrammarCompileError, Matcher
from specserve.runtime.constrained.spec import (
    GRAMMAR_FIELDS,
    MAX_GRAMMAR_BYTES,
    GrammarSpec,
    grammar_of,
)

# --grammar-backend choices; "none" serves no grammar (such requests are a 400)
GRAMMAR_BACKENDS = ("xgrammar", "llguidance", "none")


def create_backend(name: str, tokenizer: Any, vocab_size: int, stop_token_ids: list[int],
                   any_whitespace: bool = True) -> GrammarBackend:
    """The backend `name` (GRAMMAR_BACKENDS but "none") for a tokenizer and a logits width."""
    if name == "xgrammar":
        from specserve.runtime.constrained.xgrammar_backend import XGrammarBackend

        return XGrammarBackend(tokenizer, vocab_size, stop_token_ids, any_whitespace)
    if name == "llguidance":
        from specserve.runtime.constrained.llguidance_backend import LLGuidanceBackend

        return LLGuidanceBackend(tokenizer, vocab_size, stop_token_ids, any_whitespace)
    raise ValueError(f"unknown grammar backend {name!r}; choose one of {GRAMMAR_BACKENDS}")


__all__ = ["GRAMMAR_BACKENDS", "GRAMMAR_FIELDS", "MAX_GRAMMAR_BYTES", "GrammarBackend",
           "GrammarCompileError", "GrammarSpec", "Matcher", "create_backend", "grammar_of"]
