"""Constrained greedy decoding computed independently of the serving code: the model's own
forwards (a prefill, then one decode step per token, on slots of its own) and the grammar
library's matcher and bitmask used directly (xgrammar's, or llguidance's: `LLGuidanceReference`),
the masked argmax taken with torch."""

from __future__ import annotations

import torch
import xgrammar as xgr

from specserve.runtime.forward_batch import ForwardBatch, ForwardMode


def xgrammar_compiler(tokenizer, vocab_size: int, eos: list[int]) -> xgr.GrammarCompiler:
    info = xgr.TokenizerInfo.from_huggingface(tokenizer, vocab_size=vocab_size,
                                              stop_token_ids=eos)
    return xgr.GrammarCompiler(info, max_threads=1, cache_enabled=False)


def compile_spec(compiler, kind: str, source: str, any_whitespace: bool = True):
    if isinstance(compiler, LLGuidanceReference):
        return compiler.compile(kind, source, any_whitespace)
    if kind == "json_schema":
        return compiler.compile_json_schema(source, any_whitespace=any_whitespace)
    if kind == "regex":
        return compiler.compile_regex(source)
    if kind == "ebnf":
        return compiler.compile_grammar(source)
    return compiler.compile_structural_tag(source)


class LLGuidanceReference:
    """llguidance's tokenizer view and grammars, made with its own API (the JSON Schema made
    strict as the backend does: both libraries' strict mode)."""

    def __init__(self, tokenizer, vocab_size: int, eos: list[int]) -> None:
        import llguidance.hf

        self.tok = llguidance.hf.from_tokenizer(tokenizer, n_vocab=vocab_size, eos_token=eos)
        self.eos = set(eos)

    def compile(self, kind: str, source: str, any_whitespace: bool = True):
        import json

        from llguidance import LLMatcher
        from llguidance.gbnf_to_lark import any_to_lark

        from specserve.runtime.constrained.llguidance_backend import json_options, strict_schema

        if kind == "json_schema":
            g = LLMatcher.grammar_from_json_schema(
                json.dumps(strict_schema(json.loads(source))),
                defaults=json_options(any_whitespace))
        elif kind == "regex":
            g = LLMatcher.grammar_from_regex(source)
        else:
            g = LLMatcher.grammar_from_lark(any_to_lark(source))
        return self, g


def masked_greedy(runner, compiled, prompt: list[int], max_new: int) -> list[int]:
    """Greedy tokens under the grammar until it terminates (its EOS accepted) or `max_new`."""
    vocab = runner.vocab_size
    if isinstance(compiled, tuple):
        return _llguidance_greedy(runner, *compiled, prompt, max_new)
    matcher = xgr.GrammarMatcher(compiled)
    mask = xgr.allocate_token_bitmask(1, vocab)
    slots = torch.arange(1, len(prompt) + max_new + 1)  # (a runner of the test's own)
    batch = ForwardBatch.build(ForwardMode.EXTEND, [prompt], [slots[: len(prompt)]], [0])
    logits = runner.forward(batch).logits[-1:]
    out: list[int] = []
    while True:
        row = logits.clone()
        matcher.fill_next_token_bitmask(mask)
        xgr.apply_token_bitmask_inplace(row, mask)
        token = int(torch.argmax(row[0]))
        assert matcher.accept_token(token)
        out.append(token)
        if matcher.is_terminated() or len(out) == max_new:
            return out
        n = len(prompt) + len(out)
        batch = ForwardBatch.build(ForwardMode.DECODE, [[token]], [slots[:n]], [n - 1])
        logits = runner.forward(batch).logits


def _llguidance_greedy(runner, ref: LLGuidanceReference, grammar: str, prompt: list[int],
                       max_new: int) -> list[int]:
    import llguidance
    import llguidance.torch as llt

    matcher = llguidance.LLMatcher(ref.tok, grammar, log_level=0)
    mask = llt.allocate_token_bitmask(1, runner.vocab_size)
    ids = torch.arange(runner.vocab_size)
    slots = torch.arange(1, len(prompt) + max_new + 1)
    batch = ForwardBatch.build(ForwardMode.EXTEND, [prompt], [slots[: len(prompt)]], [0])
    logits = runner.forward(batch).logits[-1:]
    out: list[int] = []
    while True:
        row = logits.clone()
        llt.fill_next_token_bitmask(matcher, mask, 0)
        # (bit t of the mask: token t allowed; llguidance's own apply runs torch.compile)
        allowed = (mask[0, ids // 32] >> (ids % 32)) & 1
        row[0, allowed == 0] = -torch.inf
        token = int(torch.argmax(row[0]))
        out.append(token)
        if token in ref.eos or len(out) == max_new:
            return out
        assert matcher.consume_token(token), matcher.get_error()
        n = len(prompt) + len(out)
        batch = ForwardBatch.build(ForwardMode.DECODE, [[token]], [slots[:n]], [n - 1])
        logits = runner.forward(batch).logits
