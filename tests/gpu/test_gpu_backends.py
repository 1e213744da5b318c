"""On CUDA: the triton and flashinfer backends equal torch_native on random extend / decode / verify
batches, and greedy output through the server path is identical across attention backends."""

from __future__ import annotations

import pytest
import torch

from specserve.runtime.forward_batch import ForwardMode
from specserve.runtime.layers.attention import TorchNativeBackend
from tests.unit.test_attention_torch_native import make_case


def _to_cuda(pool, batch, *tensors):
    pool.k = [t.cuda() for t in pool.k]
    pool.v = [t.cuda() for t in pool.v]
    pool.device = torch.device("cuda")
    return pool, batch.to(torch.device("cuda")), [t.cuda() for t in tensors]


def _backend_class(name):
    if name == "flashinfer":
        pytest.importorskip("flashinfer")
        from specserve.runtime.layers.attention.flashinfer_backend import FlashInferAttentionBackend

        return FlashInferAttentionBackend
    pytest.importorskip("triton")
    from specserve.runtime.layers.attention.triton_backend import TritonAttentionBackend

    return TritonAttentionBackend


@pytest.mark.parametrize("backend", ["triton", "flashinfer"])
@pytest.mark.parametrize("dtype,atol", [(torch.float16, 2e-3), (torch.bfloat16, 2e-2)])
@pytest.mark.parametrize("mode", [ForwardMode.EXTEND, ForwardMode.DECODE,
                                  ForwardMode.TARGET_VERIFY])
@pytest.mark.parametrize("bsz,seed", [(1, 0), (4, 1), (8, 2)])
def test_cuda_backend_equals_torch_native(backend, mode, bsz, seed, dtype, atol):
    outs = []
    for cls in (TorchNativeBackend, _backend_class(backend)):
        pool, batch, q, k, v, _ = make_case(mode, bsz, seed, head_dim=64)
        pool, batch, (q, k, v) = _to_cuda(pool, batch, q, k, v)
        pool.k = [t.to(dtype) for t in pool.k]
        pool.v = [t.to(dtype) for t in pool.v]
        pool.dtype = dtype
        backend = cls(pool, 4, 64**-0.5)
        backend.init_forward_metadata(batch)
        outs.append(backend.forward(q.to(dtype), k.to(dtype), v.to(dtype), 0, batch).float())
    torch.testing.assert_close(outs[1], outs[0], atol=atol, rtol=atol)


@pytest.mark.parametrize("backend", ["triton", "flashinfer"])
@pytest.mark.parametrize("algo", [None, "NGRAM", "EAGLE3"])
def test_greedy_output_identical_across_backends(algo, backend):
    _backend_class(backend)
    from specserve.launch import Engine

    prompts = ["The capital of France is", "def fib(n):", "List three colors:"]
    params = {"max_new_tokens": 32, "temperature": 0}
    outs = {}
    for name in ("torch_native", backend):
        kw = {"speculative_algorithm": algo} if algo else {}
        with Engine(log_level="warning", device="cuda", weight_format="torch",
                    attention_backend=name, **kw) as eng:
            outs[name] = [eng.generate(p, sampling_params=params)["output_ids"]
                          for p in prompts]
    assert outs[backend] == outs["torch_native"]
