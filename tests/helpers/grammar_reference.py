"""Constrained greedy decoding computed independently of the serving code: the model's own
forwards (a prefill, then one decode step per token, on slots of its own) and xgrammar's
matcher and bitmask used directly, the masked argmax taken with torch."""

from __future__ import annotations

import torch
import xgrammar as xgr

from runtime.forward_batch import ForwardBatch, ForwardMode


def xgrammar_compiler(tokenizer, vocab_size: int, eos: list[int]) -> xgr.GrammarCompiler:
    info = xgr.TokenizerInfo.from_huggingface(tokenizer, vocab_size=vocab_size,
                                              stop_token_ids=eos)
    return xgr.GrammarCompiler(info, max_threads=1, cache_enabled=False)


def compile_spec(compiler: xgr.GrammarCompiler, kind: str, source: str,
                 any_whitespace: bool = True):
    if kind == "json_schema":
        return compiler.compile_json_schema(source, any_whitespace=any_whitespace)
    if kind == "regex":
        return compiler.compile_regex(source)
    if kind == "ebnf":
        return compiler.compile_grammar(source)
    return compiler.compile_structural_tag(source)


def masked_greedy(runner, compiled, prompt: list[int], max_new: int) -> list[int]:
    """Greedy tokens under the grammar until it terminates (its EOS accepted) or `max_new`."""
    vocab = runner.vocab_size
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
