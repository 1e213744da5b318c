"""Per-request sampling parameters (SGLang names and defaults) and their validation."""

from __future__ import annotations

import dataclasses
import math
from dataclasses import dataclass, field
from typing import Any

from specserve.runtime.constrained.spec import GRAMMAR_FIELDS, GrammarSpec, grammar_of
from specserve.runtime.errors import InvalidRequestError

MAX_STOP_STRINGS = 16
# Temperatures below this are treated as greedy: dividing logits by them overflows float32.
GREEDY_TEMPERATURE_EPS = 1e-5
MAX_SEED = 2**64  # torch.Generator.manual_seed accepts [0, 2**64)
# The sampler scales float32 logits by a temperature and a repetition penalty; within these
# bounds a finite logit stays finite and a nonzero one nonzero (float32 reaches 3.4e38, and
# 5e-324 is 0 in it: -inf logits times 0 are NaN).
MIN_SCALE, MAX_SCALE = 1e-30, 1e30

_INT_FIELDS = ("max_new_tokens", "top_k")
_INT_KEYS = (*_INT_FIELDS, "seed")  # integers in a request's sampling dict
_FLOAT_FIELDS = (
    "temperature",
    "top_p",
    "min_p",
    "repetition_penalty",
    "frequency_penalty",
    "presence_penalty",
)


def _is_int(x: Any) -> bool:
    # bool is an int subclass in Python; `"top_k": true` is a client bug, not a 1.
    return isinstance(x, int) and not isinstance(x, bool)


def integral(x: Any) -> Any:
    """A JSON number with no fractional part as an int (`2.0` -> 2): JSON has one number type,
    JSON Schema's "integer" includes 2.0, and SGLang's and vLLM's parsers take it. Anything
    else is returned as it is, for the type checks to judge (`2.5`, `true`, `"2"` stay
    errors)."""
    if type(x) is float and x.is_integer():
        return int(x)
    return x


def _is_number(x: Any) -> bool:
    return _is_int(x) or isinstance(x, float)


@dataclass
class SamplingParams:
    """How to pick the next token of one request.

    Construction only normalises (a `stop` string becomes a one-element list, `None` lists become
    empty, ints in float fields become floats); call `validate` (or build with `from_dict`) before
    trusting the values.
    """

    max_new_tokens: int = 128
    temperature: float = 1.0  # 0 means greedy
    top_p: float = 1.0
    top_k: int = -1  # -1 disables top-k
    min_p: float = 0.0
    repetition_penalty: float = 1.0
    frequency_penalty: float = 0.0
    presence_penalty: float = 0.0
    stop: list[str] = field(default_factory=list)
    stop_token_ids: list[int] = field(default_factory=list)
    ignore_eos: bool = False
    seed: int | None = None
    # at most one grammar the output must match (SGLang's names;
    # specserve/runtime/constrained/spec.py): a JSON Schema as a JSON string, a regex, an EBNF
    # grammar, an xgrammar structural tag
    json_schema: str | None = None
    regex: str | None = None
    ebnf: str | None = None
    structural_tag: str | None = None

    def __post_init__(self) -> None:
        if self.stop is None:
            self.stop = []
        elif isinstance(self.stop, str):
            self.stop = [self.stop]
        elif isinstance(self.stop, tuple):
            self.stop = list(self.stop)
        if self.stop_token_ids is None:
            self.stop_token_ids = []
        elif isinstance(self.stop_token_ids, tuple):
            self.stop_token_ids = list(self.stop_token_ids)
        for name in _FLOAT_FIELDS:
            value = getattr(self, name)
            if _is_int(value):
                setattr(self, name, float(value))

    @property
    def is_greedy(self) -> bool:
        return self.temperature < GREEDY_TEMPERATURE_EPS or self.top_k == 1

    @property
    def takes_argmax(self) -> bool:
        """Greedy without penalties: the next token is the target's own argmax."""
        return self.is_greedy and not self.has_penalties

    @property
    def grammar(self) -> GrammarSpec | None:
        """The grammar the output must match (None: unconstrained); `validate` checks it."""
        return grammar_of(self._grammar_fields())

    def _grammar_fields(self) -> dict[str, Any]:
        return {name: getattr(self, name) for name in GRAMMAR_FIELDS}

    @property
    def has_penalties(self) -> bool:
        """Whether the next-token distribution depends on the token history."""
        return (self.repetition_penalty != 1.0 or self.frequency_penalty != 0.0
                or self.presence_penalty != 0.0)

    def validate(self, vocab_size: int | None = None) -> None:
        """Raise `InvalidRequestError` naming the first bad field; `vocab_size` bounds ids/top_k."""
        self._check_types()

        if not 0 <= self.temperature <= MAX_SCALE:
            _fail("temperature", f"must be in [0, {MAX_SCALE:g}], got {self.temperature}")
        if not 0.0 < self.top_p <= 1.0:
            _fail("top_p", f"must be in (0, 1], got {self.top_p}")
        if self.top_k == 0 or self.top_k < -1:
            _fail("top_k", f"must be -1 (disabled) or >= 1, got {self.top_k}")
        if vocab_size is not None and self.top_k > vocab_size:
            _fail("top_k", f"must be <= the vocabulary size {vocab_size}, got {self.top_k}")
        if not 0.0 <= self.min_p <= 1.0:
            _fail("min_p", f"must be in [0, 1], got {self.min_p}")
        rp = self.repetition_penalty
        if not MIN_SCALE <= rp <= MAX_SCALE:
            _fail("repetition_penalty", f"must be in [{MIN_SCALE:g}, {MAX_SCALE:g}], got {rp}")
        for name in ("frequency_penalty", "presence_penalty"):
            value = getattr(self, name)
            if not -2.0 <= value <= 2.0:
                _fail(name, f"must be in [-2, 2], got {value}")
        if self.max_new_tokens < 1:
            _fail("max_new_tokens", f"must be >= 1, got {self.max_new_tokens}")
        if len(self.stop) > MAX_STOP_STRINGS:
            _fail("stop", f"at most {MAX_STOP_STRINGS} stop strings, got {len(self.stop)}")
        if any(len(s) == 0 for s in self.stop):
            _fail("stop", "stop strings must be non-empty")
        upper = vocab_size if vocab_size is not None else math.inf
        for token_id in self.stop_token_ids:
            if not 0 <= token_id < upper:
                bound = f"[0, {vocab_size})" if vocab_size is not None else ">= 0"
                _fail("stop_token_ids", f"token id {token_id} is out of range {bound}")
        if self.seed is not None and not 0 <= self.seed < MAX_SEED:
            _fail("seed", f"must be in [0, 2**64), got {self.seed}")
        grammar_of(self._grammar_fields())  # a string within size, JSON that parses, one

    def _check_types(self) -> None:
        for name in _INT_FIELDS:
            if not _is_int(getattr(self, name)):
                _fail(name, f"must be an integer, got {_type_name(getattr(self, name))}")
        for name in _FLOAT_FIELDS:
            if not _is_number(getattr(self, name)):
                _fail(name, f"must be a number, got {_type_name(getattr(self, name))}")
        if not isinstance(self.stop, list) or not all(isinstance(s, str) for s in self.stop):
            _fail("stop", "must be a string or a list of strings")
        ids = self.stop_token_ids
        if not isinstance(ids, list) or not all(_is_int(t) for t in ids):
            _fail("stop_token_ids", "must be a list of integers")
        if not isinstance(self.ignore_eos, bool):
            _fail("ignore_eos", f"must be a boolean, got {_type_name(self.ignore_eos)}")
        if self.seed is not None and not _is_int(self.seed):
            _fail("seed", f"must be an integer or null, got {_type_name(self.seed)}")

    @classmethod
    def from_dict(cls, d: dict[str, Any], vocab_size: int | None = None) -> SamplingParams:
        """Build from a request's JSON object: unknown keys, bad types and bad values all raise
        `InvalidRequestError` naming the field."""
        if not isinstance(d, dict):
            _fail("sampling_params", f"must be an object, got {_type_name(d)}")
        known = {f.name for f in dataclasses.fields(cls)}
        for key in d:
            if key not in known:
                _fail(str(key), "unknown sampling parameter")
        d = {k: integral(v) if k in _INT_KEYS else v for k, v in d.items()}
        if isinstance(d.get("stop_token_ids"), list):
            d["stop_token_ids"] = [integral(t) for t in d["stop_token_ids"]]
        params = cls(**d)
        params.validate(vocab_size)
        return params

    def to_dict(self) -> dict[str, Any]:
        return dataclasses.asdict(self)  # asdict copies the lists

    def for_sample(self, j: int) -> SamplingParams:
        """Sample j of a prompt asked for n times (OpenAI's and SGLang's `n`): a copy of its own,
        drawing with `seed + j` when seeded, so the samples differ yet each is reproducible."""
        q = dataclasses.replace(self, stop=list(self.stop),
                                stop_token_ids=list(self.stop_token_ids))
        if q.seed is not None:
            q.seed = (q.seed + j) % MAX_SEED
        return q


def _fail(name: str, message: str) -> None:
    raise InvalidRequestError(name, message)


def _type_name(x: Any) -> str:
    return "null" if x is None else type(x).__name__
