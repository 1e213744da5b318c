"""Grammars in the model runner: loading compiled grammars, matchers, masking logits rows.

The runner never compiles. A request's first batch entry brings its compiled grammar as bytes
(`GrammarPayload`, zlib-compressed); `RunnerGrammars.load` looks its key up in an LRU of loaded
grammars and otherwise inflates and deserializes it on a background thread, which runs while
the step's forward does (xgrammar releases the GIL; ~20 ms per shipped MiB, capped by the
tokenizer process at 32 MiB). The request's matcher is made when its first token is sampled,
after that forward. Matchers are plain objects owned by the runner's per-request state:
releasing the request drops them (`live` counts them, for tests).

`mask_output` applies matchers to a forward's logits rows: forbidden tokens become -inf, the
rows' argmax is recomputed (the CPU engine found the raw one inside the forward), and their
logprob statistics are marked unusable (NaN log-sum-exp), so logprobs of those rows are taken
from the masked logits (what SGLang and vLLM return for constrained requests).
"""

from __future__ import annotations

import logging
import math
import weakref
import zlib
from collections import OrderedDict
from collections.abc import Callable, Sequence
from concurrent.futures import Future, ThreadPoolExecutor

import numpy as np
import torch

from specserve.runtime.constrained.base import GrammarBackend, Matcher
from specserve.runtime.messages import GRAMMAR_END, GRAMMAR_REJECTED, GrammarPayload
from specserve.runtime.models.llama import ModelOutput
from specserve.runtime.sampling.argmax import argmax_rows

logger = logging.getLogger(__name__)

LOADED_ENTRIES = 64


class RunnerGrammars:
    """The runner's loaded grammars (by key, LRU) and the matchers made from them."""

    def __init__(self, make_backend: Callable[[], GrammarBackend]) -> None:
        self._pool = ThreadPoolExecutor(1, thread_name_prefix="grammar-load")
        self._backend: Future = self._pool.submit(make_backend)  # (the vocabulary: ~0.2 s)
        self._loaded: OrderedDict[str, Future] = OrderedDict()
        self.live: weakref.WeakSet[Matcher] = weakref.WeakSet()

    def load(self, payload: GrammarPayload) -> Future:
        """The compiled grammar of `payload`, loaded or loading (a future)."""
        fut = self._loaded.get(payload.key)
        if fut is not None:
            self._loaded.move_to_end(payload.key)
            return fut
        fut = self._pool.submit(self._load, payload.data)
        self._loaded[payload.key] = fut
        while len(self._loaded) > LOADED_ENTRIES:
            self._loaded.popitem(last=False)
        return fut

    def _load(self, data: bytes):
        return self._backend.result().load(zlib.decompress(data))

    def matcher(self, loading: Future) -> Matcher:
        """A new matcher of a grammar `load` returned (waiting for it if still loading); a
        grammar that failed to load raises, and is forgotten (the next request loads it anew)."""
        try:
            compiled = loading.result()
        except Exception:
            for key in [k for k, f in self._loaded.items() if f is loading]:
                del self._loaded[key]
            raise
        m = self._backend.result().matcher(compiled)
        self.live.add(m)
        return m

    def shutdown(self) -> None:
        self._pool.shutdown(wait=False, cancel_futures=True)


def mask_output(out: ModelOutput, rows: Sequence[int], matchers: Sequence[Matcher]) -> ModelOutput:
    """`out` with logits rows `rows` [R] masked in place by `matchers` [R] (the tokens each
    grammar allows next), their argmax taken over the masked rows and their logit statistics
    marked unusable; the other rows untouched."""
    if not rows:
        return out
    backend = matchers[0].backend
    masks = backend.allocate_masks(len(rows))  # [R, ceil(V / 32)]
    for j, m in enumerate(matchers):
        m.fill_mask(masks, j)
    return apply_masks(out, rows, masks, backend)


def apply_masks(out: ModelOutput, rows: Sequence[int], masks: torch.Tensor,
                backend: GrammarBackend) -> ModelOutput:
    """`out` with logits rows `rows` [R] masked in place by bit masks `masks` [R, words] (one
    per row), their argmax taken over the masked rows and their logit statistics marked
    unusable; the other rows untouched."""
    if not rows:
        return out
    forbidden = backend.forbidden(masks, out.logits.shape[-1])  # [R, V] bool
    masked = _mask_rows(out.logits, list(rows), forbidden)  # [R] argmax of the masked rows
    argmax = out.argmax
    if argmax is not None:
        argmax = argmax.clone()
        argmax[rows] = masked.to(argmax.device)
    stats = out.logit_stats
    if stats is not None:
        lse = stats.lse.clone()
        lse[rows] = math.nan  # (logprob_rows then takes these rows' logits)
        stats = stats._replace(lse=lse)
    return out._replace(argmax=argmax, logit_stats=stats)


def _mask_rows(logits: torch.Tensor, rows: list[int], forbidden: np.ndarray) -> torch.Tensor:
    """-inf into logits[rows[j]] where forbidden[j]; the masked rows' argmax [R]. On the CPU in
    numpy, on one thread: torch's intra-op pool, woken for a 49k-element op, waited ~8 ms for a
    busy second core (2 torch threads on a shared 2-core machine), numpy takes ~0.15 ms a row."""
    if logits.device.type == "cpu":
        lg = logits.detach().numpy()  # [N, V], the same memory
        for j, r in enumerate(rows):
            np.putmask(lg[r], forbidden[j], -np.inf)
        return torch.from_numpy(np.asarray(lg[rows].argmax(axis=-1), dtype=np.int64))
    with torch.inference_mode():  # (the forward's logits are inference tensors)
        mask = torch.from_numpy(forbidden).to(logits.device)
        for j, r in enumerate(rows):
            logits[r].masked_fill_(mask[j], -math.inf)
        return argmax_rows(logits[rows])


def advance(matcher: Matcher, tokens: Sequence[int]) -> tuple[int, str]:
    """Accept committed `tokens` in order: how many the request keeps (all, or those up to the
    one that completes the grammar: a speculative step's tokens may run past its end) and its
    grammar state after them ("" while it runs, GRAMMAR_END once complete, GRAMMAR_REJECTED
    at a token it cannot match, which masking prevents: it means a bug, and the request is
    ended rather than left stuck)."""
    for k, t in enumerate(tokens):
        if not matcher.accept(t):
            logger.error("the grammar rejected token %d, which its mask allowed", t)
            return k, GRAMMAR_REJECTED
        if matcher.is_terminated():
            return k + 1, GRAMMAR_END
    return len(tokens), ""


# what vLLM reports for a token its grammar forbids (JSON has no -Infinity)
FORBIDDEN_LOGPROB = -9999.0


def finite_logprobs(payload: dict | None) -> dict | None:
    """A constrained request's logprob payload with the -inf of tokens its grammar forbade
    (they can only appear among the top alternatives) as FORBIDDEN_LOGPROB, in place."""
    if payload is None:
        return None
    for key, rows in payload.items():
        if key.endswith("top_lp"):
            for row in rows:
                row[:] = [FORBIDDEN_LOGPROB if v == -math.inf else v for v in row]
    return payload
