"""The llguidance backend (PyPI `llguidance`, pinned in setup.py): `--grammar-backend llguidance`.

llguidance builds a grammar's lexer and parser lazily and computes each token mask on the fly
(a JSON Schema "compiles" in ~1 ms and ships as its grammar text), where xgrammar precomputes
masks per grammar state at compile time (~2 s for a schema with a few string `maxLength` of
40-300 on the default model's tokenizer); docs/structured_output.md has both end to end.

The same request surface as xgrammar's: JSON Schemas in xgrammar's strict mode (`strict_schema`:
properties beyond those listed are not generated),
any whitespace unless `--constrained-json-disable-any-whitespace` (then `{"a": 1, "b": 2}`);
`ebnf` in GBNF (xgrammar's, llama.cpp's) or Lark syntax; `regex`; `structural_tag` in the two
shapes our tool calls use (`tag`, `tags_with_separator`, each tag's content a JSON Schema). A
request ends when it accepts a stop token (EOS), as with xgrammar.
"""

from __future__ import annotations

import json
from typing import Any

import torch

from specserve.runtime.constrained.base import GrammarBackend, GrammarCompileError, Matcher
from specserve.runtime.constrained.spec import GrammarSpec

# JSON Schema keywords whose values are schemas / maps or lists of schemas
_SCHEMA_MAPS = ("properties", "patternProperties", "$defs", "definitions", "dependentSchemas")
_SCHEMA_LISTS = ("anyOf", "oneOf", "allOf", "prefixItems")
_SCHEMA_ONE = ("items", "additionalProperties", "not", "if", "then", "else", "contains",
               "propertyNames", "unevaluatedProperties", "additionalItems")


def strict_schema(schema: Any) -> Any:
    """`schema` in xgrammar's strict mode, recursively (the input is not changed): an object
    schema that lists `properties` allows no others unless it says (`additionalProperties`),
    a tuple (`prefixItems`) no items beyond them unless it says (`items`); `{"type":
    "object"}` alone stays any object."""
    if isinstance(schema, list):
        return [strict_schema(s) for s in schema]
    if not isinstance(schema, dict):
        return schema
    out = dict(schema)
    for key in _SCHEMA_MAPS:
        if isinstance(out.get(key), dict):
            out[key] = {k: strict_schema(v) for k, v in out[key].items()}
    for key in _SCHEMA_LISTS:
        if isinstance(out.get(key), list):
            out[key] = [strict_schema(s) for s in out[key]]
    for key in _SCHEMA_ONE:
        if isinstance(out.get(key), (dict, list)):
            out[key] = strict_schema(out[key])
    if "properties" in out and "additionalProperties" not in out:
        out["additionalProperties"] = False
    if "prefixItems" in out and "items" not in out:
        out["items"] = False
    return out


def json_options(any_whitespace: bool) -> dict:
    """llguidance's JSON compile options: any whitespace between tokens, or compact JSON
    (`{"a": 1, "b": 2}`, xgrammar's without any_whitespace)."""
    if any_whitespace:
        return {"whitespace_flexible": True}
    return {"whitespace_flexible": False, "item_separator": ", ", "key_separator": ": "}


class LLGuidanceMatcher(Matcher):
    """One llguidance matcher. The request ends, as with xgrammar, when it accepts a stop token
    (EOS) where the grammar may end; that token is kept here (`_ended`), not in llguidance,
    which accepts nothing after it."""

    def __init__(self, matcher: Any, backend: LLGuidanceBackend, ended: bool = False) -> None:
        self._m = matcher
        self.backend = backend
        self._ended = ended

    def fill_mask(self, masks: torch.Tensor, row: int) -> None:
        v = masks[row]
        self._m.unsafe_compute_mask_ptr(v.data_ptr(), v.numel() * v.element_size())

    def accept(self, token: int) -> bool:
        if self._ended:
            return False
        if int(token) in self.backend.stop_token_ids:
            self._ended = bool(self._m.is_accepting())
            return self._ended
        # try_consume leaves a forbidden token unconsumed (consume_token would end in error)
        return self._m.try_consume_tokens([int(token)]) == 1

    def rollback(self, num_tokens: int) -> None:
        if num_tokens > 0 and self._ended:
            self._ended = False
            num_tokens -= 1
        if num_tokens > 0:
            self._m.rollback(num_tokens)

    def is_terminated(self) -> bool:
        return self._ended

    def forced_tokens(self) -> list[int]:
        if self._ended:
            return []
        # llguidance's fast-forward tokens stop before a token a longer one could still cover
        out = []
        for t in self._m.compute_ff_tokens():
            if int(t) in self.backend.stop_token_ids:
                break
            out.append(int(t))
        return out

    def fork(self) -> LLGuidanceMatcher:
        return LLGuidanceMatcher(self._m.deep_copy(), self.backend, self._ended)


class LLGuidanceBackend(GrammarBackend):
    """llguidance over one Hugging Face fast tokenizer; `vocab_size` is the logits width."""

    name = "llguidance"

    def __init__(self, tokenizer: Any, vocab_size: int, stop_token_ids: list[int],
                 any_whitespace: bool = True) -> None:
        import llguidance
        import llguidance.hf

        self._llg = llguidance
        self.tokenizer = tokenizer
        self.vocab_size = vocab_size
        self.any_whitespace = any_whitespace
        self.stop_token_ids = frozenset(int(t) for t in stop_token_ids)
        self.info = llguidance.hf.from_tokenizer(tokenizer, n_vocab=vocab_size,
                                                 eos_token=sorted(self.stop_token_ids))

    @property
    def compile_options(self) -> str:
        return f"llg:ws={int(self.any_whitespace)}"

    def _schema_grammar(self, source: str | dict) -> str:
        schema = json.loads(source) if isinstance(source, str) else source
        if schema is True:
            schema = {}
        return self._llg.LLMatcher.grammar_from_json_schema(
            json.dumps(strict_schema(schema)), defaults=json_options(self.any_whitespace))

    def compile(self, spec: GrammarSpec) -> str:
        llm = self._llg.LLMatcher
        try:
            if spec.kind == "json_schema":
                grammar = self._schema_grammar(spec.source)
            elif spec.kind == "regex":
                grammar = llm.grammar_from_regex(spec.source)
            elif spec.kind == "ebnf":
                from llguidance.gbnf_to_lark import any_to_lark

                grammar = llm.grammar_from_lark(any_to_lark(spec.source))
            elif spec.kind == "structural_tag":
                grammar = llm.grammar_from_lark(self._structural_tag_lark(spec.source))
            else:
                raise GrammarCompileError(f"unknown grammar kind {spec.kind!r}")
        except GrammarCompileError:
            raise
        except Exception as exc:  # noqa: BLE001 - ValueError and the GBNF converter's: all input
            raise GrammarCompileError(_first_line(exc)) from None
        error = llm.validate_grammar(grammar, self.info)
        if error and not error.startswith("WARNING"):
            raise GrammarCompileError(_first_line(error))
        self._check_nonempty(grammar)
        return grammar

    def _structural_tag_lark(self, source: str) -> str:
        """A structural tag (xgrammar's JSON format) as Lark: a `tag` is its begin text, its
        content's JSON Schema, its end text; `tags_with_separator` one or more tags with the
        separator between (one with `stop_after_first`)."""
        fmt = json.loads(source).get("format")
        if not isinstance(fmt, dict):
            raise GrammarCompileError("structural_tag: expected an object \"format\"")
        rules: list[str] = []

        def tag(t: Any) -> str:
            if not isinstance(t, dict) or t.get("type", "tag") != "tag":
                raise GrammarCompileError("structural_tag: the llguidance backend serves tags "
                                          "of type \"tag\" only")
            content = t.get("content") or {}
            if content.get("type") != "json_schema":
                raise GrammarCompileError("structural_tag: the llguidance backend serves "
                                          "tag content of type \"json_schema\" only")
            name = f"tag{len(rules)}"
            schema = strict_schema(content.get("json_schema", {}))
            schema = {**(schema if isinstance(schema, dict) else {}),
                      "x-guidance": json_options(self.any_whitespace)}
            parts = [json.dumps(str(t.get("begin", ""))), f"%json {json.dumps(schema)}"]
            if t.get("end"):
                parts.append(json.dumps(str(t["end"])))
            rules.append(f"{name}: " + " ".join(p for p in parts if p != '""'))
            return name

        kind = fmt.get("type")
        if kind == "tag":
            start = tag(fmt)
        elif kind == "tags_with_separator":
            names = [tag(t) for t in fmt.get("tags") or []]
            if not names:
                raise GrammarCompileError("structural_tag: no tags")
            one = "(" + " | ".join(names) + ")"
            if fmt.get("stop_after_first"):
                start = one
            else:
                sep = json.dumps(str(fmt.get("separator", "")))
                sep = "" if sep == '""' else sep + " "
                start = f"{one} ({sep}{one})*"
            if not fmt.get("at_least_one", False):
                start = f"({start})?"
        else:
            raise GrammarCompileError(f"structural_tag: the llguidance backend serves formats "
                                      f"\"tag\" and \"tags_with_separator\", not {kind!r}")
        return "\n".join([f"start: {start}", *rules]) + "\n"

    def _check_nonempty(self, grammar: str) -> None:
        """A grammar that allows no first token would leave its request nothing to generate."""
        m = self.matcher(grammar)
        if m._m.is_error():
            raise GrammarCompileError(_first_line(m._m.get_error()))
        masks = self.allocate_masks(1)
        m.fill_mask(masks, 0)
        if m._m.is_error() or not bool(masks.any()):
            raise GrammarCompileError("the grammar matches no output")

    def dump(self, compiled: str) -> bytes:
        return compiled.encode("utf-8")

    def load(self, data: bytes) -> str:
        return data.decode("utf-8")

    def matcher(self, compiled: str) -> LLGuidanceMatcher:
        return LLGuidanceMatcher(self._llg.LLMatcher(self.info, compiled, log_level=0), self)

    def allocate_masks(self, rows: int) -> torch.Tensor:
        from llguidance.torch import allocate_token_bitmask

        return allocate_token_bitmask(rows, self.vocab_size)


def _first_line(exc: Exception | str) -> str:
    text = str(exc).strip() or type(exc).__name__
    return text.splitlines()[0]
