"""The server path on the default model with `--attention-backend triton`, the kernel run by
Triton's interpreter on the CPU (slow): greedy output identical to torch_native plain decoding,
with no speculation, NGRAM and EAGLE-3 (the torch engine: the CPU engine has its own
attention), the speculative runs verifying their trees through the Triton tree ops."""

from __future__ import annotations

import pytest

pytest.importorskip("triton")

# one prompt of 27 tokens: its prefill spans two query blocks (BLOCK_M = 16), and NGRAM finds
# the answer's first tokens (a newline, "#") in it to draft from (the test checks that it
# drafts). Six tokens: a prefill and five decode or verify steps through every layer's kernel
# call. Under the interpreter a forward costs
# ~4 s, so each prompt costs ~25 s per server: these tests were 3 of the suite's 20 minutes.
PROMPTS = ["def fibonacci(n):\n    # return the n-th Fibonacci number\n    if n < 2:\n"
           "        return n\n"]
PARAMS = {"max_new_tokens": 6, "temperature": 0}


def _outputs(**kw) -> tuple[list, dict]:
    from specserve.launch import Engine

    with Engine(log_level="warning", weight_format="torch", **kw) as eng:
        outs = [eng.generate(p, sampling_params=PARAMS)["output_ids"] for p in PROMPTS]
        return outs, eng.server_info()


@pytest.fixture(scope="module")
def torch_native_plain():
    return _outputs(attention_backend="torch_native")[0]


@pytest.mark.slow
@pytest.mark.parametrize("algo", [None, "NGRAM", "EAGLE3"])
def test_triton_backend_serves_default_model_like_torch_native(algo, torch_native_plain,
                                                                monkeypatch):
    monkeypatch.setenv("TRITON_INTERPRET", "1")  # the model-runner process inherits it
    kw = {"speculative_algorithm": algo, "speculative_disable_adaptive": True,
          "speculative_tree_ops": "triton"} if algo else {}
    outs, info = _outputs(attention_backend="triton", **kw)
    if algo:
        assert info["spec_decode_num_draft_tokens"] > 0, info
    assert outs == torch_native_plain
