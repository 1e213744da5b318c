"""The xgrammar backend (PyPI `xgrammar`, pinned in setup.py).

JSON Schemas compile in xgrammar's strict mode (properties beyond those listed are not
generated), with any whitespace between tokens unless the server was started with
`--constrained-json-disable-any-whitespace` (then `{"a": 1, "b": 2}`): SGLang's and vLLM's
defaults and option. The stop tokens are the model's EOS ids: the grammar allows them exactly
where it may end, and accepting one terminates the matcher.
"""

from __future__ import annotations

import re
from typing import Any

import torch

from specserve.runtime.constrained.base import GrammarBackend, GrammarCompileError, Matcher
from specserve.runtime.constrained.spec import GrammarSpec

_CPP_PREFIX = re.compile(r"^\s*\[[0-9:]+\]\s+\S+:\d+:\s*")  # "[05:40:00] /project/x.cc:83: "


def _clean(exc: Exception) -> str:
    """xgrammar's message without its C++ source location."""
    text = str(exc).strip() or type(exc).__name__
    return _CPP_PREFIX.sub("", text.splitlines()[0] if text else text)


class XGrammarMatcher(Matcher):
    def __init__(self, matcher: Any, backend: XGrammarBackend) -> None:
        self._m = matcher
        self.backend = backend

    def fill_mask(self, masks: torch.Tensor, row: int) -> None:
        self._m.fill_next_token_bitmask(masks, row)

    def accept(self, token: int) -> bool:
        return bool(self._m.accept_token(int(token)))

    def rollback(self, num_tokens: int) -> None:
        self._m.rollback(num_tokens)

    def is_terminated(self) -> bool:
        return bool(self._m.is_terminated())

    def forced_tokens(self) -> list[int]:
        try:
            text = self._m.find_jump_forward_string()
        except UnicodeDecodeError:
            # inside a multi-byte character (a token ended mid-way) xgrammar's forced bytes are
            # no UTF-8 text; the mask still forces them, one token at a time
            return []
        if not text:
            return []
        # the last token of the forced text may merge with what follows it: leave it out
        ids = self.backend.tokenizer.encode(text, add_special_tokens=False)[:-1]
        probe, out = self._m.fork(), []
        for t in ids:
            if not probe.accept_token(t):
                break
            out.append(t)
        return out

    def fork(self) -> XGrammarMatcher:
        return XGrammarMatcher(self._m.fork(), self.backend)


class XGrammarBackend(GrammarBackend):
    """xgrammar over one Hugging Face tokenizer; `vocab_size` is the model's logits width."""

    name = "xgrammar"

    def __init__(self, tokenizer: Any, vocab_size: int, stop_token_ids: list[int],
                 any_whitespace: bool = True) -> None:
        import xgrammar as xgr

        self._xgr = xgr
        self.tokenizer = tokenizer
        self.vocab_size = vocab_size
        self.any_whitespace = any_whitespace
        self.info = xgr.TokenizerInfo.from_huggingface(tokenizer, vocab_size=vocab_size,
                                                       stop_token_ids=list(stop_token_ids))
        # our own LRU caches compiled grammars (with hit/miss counts); one thread per compile
        self._compiler = xgr.GrammarCompiler(self.info, max_threads=1, cache_enabled=False)

    @property
    def compile_options(self) -> str:
        return f"ws={int(self.any_whitespace)}"

    def compile(self, spec: GrammarSpec) -> Any:
        c = self._compiler
        try:
            if spec.kind == "json_schema":
                compiled = c.compile_json_schema(spec.source, any_whitespace=self.any_whitespace,
                                                 strict_mode=True)
            elif spec.kind == "regex":
                compiled = c.compile_regex(spec.source)
            elif spec.kind == "ebnf":
                compiled = c.compile_grammar(spec.source)
            elif spec.kind == "structural_tag":
                compiled = c.compile_structural_tag(spec.source)
            else:
                raise GrammarCompileError(f"unknown grammar kind {spec.kind!r}")
        except GrammarCompileError:
            raise
        except Exception as exc:  # noqa: BLE001 - RuntimeError, ValueError, pydantic's: all input
            raise GrammarCompileError(_clean(exc)) from None
        self._check_nonempty(compiled)
        return compiled

    def _check_nonempty(self, compiled: Any) -> None:
        """A grammar that allows no first token (an empty character class, a contradiction
        xgrammar does not reject) would leave its request nothing to generate."""
        masks = self.allocate_masks(1)
        self._xgr.GrammarMatcher(compiled).fill_next_token_bitmask(masks, 0)
        if not bool(masks.any()):
            raise GrammarCompileError("the grammar matches no output")

    def dump(self, compiled: Any) -> bytes:
        return compiled.serialize_json().encode("utf-8")

    def load(self, data: bytes) -> Any:
        return self._xgr.CompiledGrammar.deserialize_json(data.decode("utf-8"), self.info)

    def matcher(self, compiled: Any) -> XGrammarMatcher:
        return XGrammarMatcher(self._xgr.GrammarMatcher(compiled), self)

    def allocate_masks(self, rows: int) -> torch.Tensor:
        return self._xgr.allocate_token_bitmask(rows, self.vocab_size)
