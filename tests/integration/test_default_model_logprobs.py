"""Logprobs on the default model through `Engine`: against HF transformers' log_softmax, the
prompt's against the output's (one forward's rows against decode steps'), across prefill
chunks and past the radix cache, and cut where a stop cuts the tokens. Speculative requests
return plain decoding's logprobs exactly: tests/integration/test_spec_lossless*.py."""

from __future__ import annotations

import pytest
import torch

from specserve.corpora.datasets import sample_requests
from specserve.runtime.model_loader.default_model import resolve_model_path
from specserve.runtime.model_loader.tokenizer import load_tokenizer
from tests.helpers.engine_runs import run_concurrent

pytestmark = pytest.mark.slow

CHUNK = 64  # prefill chunk size: the long prompts span several chunks
GREEDY = {"max_new_tokens": 24, "temperature": 0, "ignore_eos": True}


@pytest.fixture(scope="module")
def run():
    """(prompts, first outputs with output logprobs and 3 alternatives, the same prompts
    extended by their outputs and scored from where the output began, stop-cut outputs)."""
    from specserve.launch import Engine

    tok = load_tokenizer(resolve_model_path(None))
    reqs = sample_requests("rewrite", 3, tok, seed=11, max_new_tokens=24, split="heldout")
    reqs += sample_requests("sharegpt", 3, tok, seed=11, max_new_tokens=24, split="heldout")
    with Engine(log_level="warning", chunked_prefill_size=CHUNK) as engine:
        prompts = [r.input_ids or (engine.tm.chat_ids(r.messages) if r.messages
                                   else engine.tm.tokenize(r.prompt)) for r in reqs]
        first = run_concurrent(engine, prompts, [GREEDY] * len(prompts), 3,
                               [{"return_logprob": True, "top_logprobs_num": 3}] * len(prompts))
        # prompt + output as a new prompt, scored from the output's first token: its KV is in
        # the radix cache now, so this also checks that those rows are computed, not reused
        extended = [p + o["output_ids"] for p, o in zip(prompts, first)]
        second = run_concurrent(
            engine, extended, [{"max_new_tokens": 1, "temperature": 0}] * len(prompts), 3,
            [{"return_logprob": True, "logprob_start_len": len(p), "top_logprobs_num": 3}
             for p in prompts])
        whole = engine.generate(input_ids=extended[0], sampling_params={"max_new_tokens": 1},
                                return_logprob=True, logprob_start_len=0)
        stops = [engine.generate(input_ids=p, sampling_params={
            "max_new_tokens": 24, "temperature": 0, "stop": [" the", "."]},
            return_logprob=True) for p in prompts]
        stream = list(engine.generate(input_ids=prompts[0], sampling_params=GREEDY, stream=True,
                                      return_logprob=True))
        # a one-token prompt scored from 0: one entry, without a logprob
        one = engine.generate(input_ids=prompts[0][:1], sampling_params={"max_new_tokens": 2},
                              return_logprob=True, logprob_start_len=0, top_logprobs_num=1)
        assert one["meta_info"]["input_token_logprobs"] == [[None, prompts[0][0], None]]
        assert one["meta_info"]["input_top_logprobs"] == [None]
        info = engine.server_info()
    return prompts, first, second, whole, stops, stream, info


def test_prompt_logprobs_equal_the_decode_steps_logprobs_across_chunks(run):
    prompts, first, second, whole, _, _, _ = run
    assert max(len(p) for p in prompts) > 2 * CHUNK  # several prefill chunks
    for p, a, b in zip(prompts, first, second):
        # the radix cache gave the prompt's KV but the last token's, whose row scores the
        # first output token: from there on the rows were computed
        assert b["meta_info"]["cached_tokens"] == len(p) - 1
        out = a["meta_info"]["output_token_logprobs"]
        inp = b["meta_info"]["input_token_logprobs"]
        assert [e[1] for e in inp] == a["output_ids"]
        # a prefill row and a decode step's row over the same prefix: the same bits
        assert inp == out
        assert b["meta_info"]["input_top_logprobs"] == a["meta_info"]["output_top_logprobs"]
    # from position 0 over the whole prompt: one entry per prompt token, the first None
    entries = whole["meta_info"]["input_token_logprobs"]
    assert len(entries) == len(prompts[0]) + 24 and entries[0][0] is None
    assert whole["meta_info"]["cached_tokens"] == 0
    assert entries[len(prompts[0]):] == first[0]["meta_info"]["output_token_logprobs"]


def test_logprobs_match_hf_log_softmax(run):
    from transformers import AutoModelForCausalLM

    prompts, first, _, _, _, _, _ = run
    hf = AutoModelForCausalLM.from_pretrained(str(resolve_model_path(None)),
                                              torch_dtype=torch.float32).eval()
    for p, a in zip(prompts, first):
        ids = a["output_ids"]
        with torch.no_grad():
            logits = hf(torch.tensor([p + ids])).logits[0, len(p) - 1 : len(p) + len(ids) - 1]
        ref = torch.log_softmax(logits, dim=-1)
        ours = torch.tensor([e[0] for e in a["meta_info"]["output_token_logprobs"]])
        assert (ours - ref[torch.arange(len(ids)), torch.tensor(ids)]).abs().max() < 2e-3
        for k, top in enumerate(a["meta_info"]["output_top_logprobs"]):
            lps = [e[0] for e in top]
            assert lps == sorted(lps, reverse=True) and len(top) == 3
            # greedy: the chosen token is the first alternative, with the same logprob
            assert top[0][1] == ids[k] and top[0][0] == ours[k].item()
            hf_top = ref[k].topk(3)
            assert (torch.tensor(lps) - hf_top.values).abs().max() < 2e-3


def test_logprobs_follow_the_tokens_a_stop_keeps_and_a_stream_sends(run):
    prompts, first, _, _, stops, stream, _ = run
    assert any(o["meta_info"]["finish_reason"]["type"] == "stop" for o in stops)
    for a, s in zip(first, stops):
        entries = s["meta_info"]["output_token_logprobs"]
        assert [e[1] for e in entries] == s["output_ids"]
        n = len(s["output_ids"])
        assert entries == a["meta_info"]["output_token_logprobs"][:n]
    for chunk in stream:
        assert [e[1] for e in chunk["meta_info"]["output_token_logprobs"]] == \
            chunk["output_ids"]
    assert stream[-1]["meta_info"]["output_token_logprobs"] == \
        first[0]["meta_info"]["output_token_logprobs"]
