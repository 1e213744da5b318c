from __future__ import annotations

import math

import pytest

from specserve.runtime.errors import InvalidRequestError
from specserve.runtime.sampling import MAX_STOP_STRINGS, SamplingParams

VOCAB = 100


@pytest.mark.parametrize(
    ("kwargs", "field"),
    [
        ({"temperature": -0.1}, "temperature"),
        ({"temperature": math.inf}, "temperature"),
        ({"temperature": math.nan}, "temperature"),
        ({"temperature": "0.7"}, "temperature"),
        ({"temperature": True}, "temperature"),
        ({"top_p": 0.0}, "top_p"),
        ({"top_p": 1.01}, "top_p"),
        ({"top_p": math.nan}, "top_p"),
        ({"top_k": 0}, "top_k"),
        ({"top_k": -2}, "top_k"),
        ({"top_k": VOCAB + 1}, "top_k"),
        ({"top_k": 5.0}, "top_k"),
        ({"top_k": True}, "top_k"),
        ({"min_p": -0.01}, "min_p"),
        ({"min_p": 1.5}, "min_p"),
        ({"repetition_penalty": 0.0}, "repetition_penalty"),
        ({"repetition_penalty": -1.0}, "repetition_penalty"),
        ({"repetition_penalty": math.inf}, "repetition_penalty"),
        # float32 makes 5e-324 a 0 (-inf logits times it are NaN) and 1e31 overflows
        ({"repetition_penalty": 5e-324}, "repetition_penalty"),
        ({"repetition_penalty": 1e31}, "repetition_penalty"),
        ({"temperature": 1e39}, "temperature"),
        ({"frequency_penalty": 2.5}, "frequency_penalty"),
        ({"frequency_penalty": -2.01}, "frequency_penalty"),
        ({"presence_penalty": 3}, "presence_penalty"),
        ({"presence_penalty": -2.5}, "presence_penalty"),
        ({"max_new_tokens": 0}, "max_new_tokens"),
        ({"max_new_tokens": -5}, "max_new_tokens"),
        ({"max_new_tokens": 10.0}, "max_new_tokens"),
        ({"max_new_tokens": "10"}, "max_new_tokens"),
        ({"stop": [""]}, "stop"),
        ({"stop": ""}, "stop"),
        ({"stop": ["x"] * (MAX_STOP_STRINGS + 1)}, "stop"),
        ({"stop": [1, 2]}, "stop"),
        ({"stop_token_ids": [VOCAB]}, "stop_token_ids"),
        ({"stop_token_ids": [-1]}, "stop_token_ids"),
        ({"stop_token_ids": [True]}, "stop_token_ids"),
        ({"stop_token_ids": "1"}, "stop_token_ids"),
        ({"ignore_eos": 1}, "ignore_eos"),
        ({"seed": -1}, "seed"),
        ({"seed": 2**64}, "seed"),
        ({"seed": 1.5}, "seed"),
        ({"seed": False}, "seed"),
    ],
)
def test_validate_names_the_bad_field(kwargs: dict, field: str) -> None:
    with pytest.raises(InvalidRequestError) as exc:
        SamplingParams(**kwargs).validate(vocab_size=VOCAB)
    assert exc.value.field == field
    assert field in str(exc.value)


@pytest.mark.parametrize(
    "kwargs",
    [
        {},
        {"temperature": 0},
        {"temperature": 0.7, "top_p": 1.0, "top_k": VOCAB, "min_p": 1.0},
        {"top_k": 1, "repetition_penalty": 1.3},
        {"frequency_penalty": -2.0, "presence_penalty": 2.0},
        {"stop": ["a"] * MAX_STOP_STRINGS, "stop_token_ids": [0, VOCAB - 1]},
        {"seed": 0, "ignore_eos": True, "max_new_tokens": 1},
    ],
)
def test_valid_params_pass_validation(kwargs: dict) -> None:
    SamplingParams(**kwargs).validate(vocab_size=VOCAB)


def test_top_k_and_token_ids_unbounded_without_vocab_size() -> None:
    SamplingParams(top_k=10**6, stop_token_ids=[10**6]).validate()


def test_stop_string_is_normalised_to_a_list_and_ints_to_floats() -> None:
    p = SamplingParams(stop="###", temperature=1, stop_token_ids=None)
    assert p.stop == ["###"]
    assert p.stop_token_ids == []
    assert isinstance(p.temperature, float)


def test_default_lists_are_not_shared_between_instances() -> None:
    a, b = SamplingParams(), SamplingParams()
    a.stop.append("x")
    assert b.stop == []


@pytest.mark.parametrize(
    ("kwargs", "greedy"),
    [
        ({"temperature": 0.0}, True),
        ({"top_k": 1}, True),
        ({"temperature": 1e-7}, True),
        ({"temperature": 0.5}, False),
        ({"temperature": 0.5, "top_k": 2}, False),
    ],
)
def test_is_greedy_for_zero_temperature_or_top_k_one(kwargs: dict, greedy: bool) -> None:
    assert SamplingParams(**kwargs).is_greedy is greedy


def test_from_dict_rejects_unknown_key_naming_it() -> None:
    with pytest.raises(InvalidRequestError) as exc:
        SamplingParams.from_dict({"temperature": 0.5, "top_q": 0.9})
    assert exc.value.field == "top_q"


def test_from_dict_rejects_non_dict() -> None:
    with pytest.raises(InvalidRequestError) as exc:
        SamplingParams.from_dict(["temperature", 0.5])  # type: ignore[arg-type]
    assert exc.value.field == "sampling_params"


def test_from_dict_type_checks_and_validates() -> None:
    with pytest.raises(InvalidRequestError) as exc:
        SamplingParams.from_dict({"top_p": "high"})
    assert exc.value.field == "top_p"
    with pytest.raises(InvalidRequestError) as exc:
        SamplingParams.from_dict({"top_k": 50}, vocab_size=10)
    assert exc.value.field == "top_k"


def test_from_dict_round_trips_through_to_dict() -> None:
    d = {"temperature": 0.3, "top_k": 20, "stop": "END", "seed": 7, "max_new_tokens": 16}
    p = SamplingParams.from_dict(d)
    assert p.stop == ["END"]
    out = p.to_dict()
    assert out["temperature"] == 0.3 and out["top_k"] == 20 and out["seed"] == 7
    assert SamplingParams.from_dict(out) == p
    out["stop"].append("other")
    assert p.stop == ["END"]


def test_for_sample_copies_and_offsets_the_seed():
    base = SamplingParams(seed=2**64 - 1, stop=["x"], stop_token_ids=[5], max_new_tokens=7)
    s1 = base.for_sample(1)
    assert s1.seed == 0 and base.seed == 2**64 - 1  # wraps within [0, 2**64)
    assert s1.max_new_tokens == 7 and s1.stop == ["x"] and s1.stop_token_ids == [5]
    s1.stop.append("y")
    s1.stop_token_ids.append(6)
    assert base.stop == ["x"] and base.stop_token_ids == [5]  # its own lists
    assert SamplingParams().for_sample(3).seed is None


def test_from_dict_takes_a_json_number_without_a_fraction_as_the_integer_it_spells() -> None:
    """JSON has one number type and JSON Schema's "integer" includes 10.0 (SGLang's parser
    takes it too); 10.5, "10" and true stay errors."""
    p = SamplingParams.from_dict({"max_new_tokens": 10.0, "top_k": 5.0, "seed": 7.0,
                                  "stop_token_ids": [3.0, 4]}, vocab_size=VOCAB)
    assert (p.max_new_tokens, p.top_k, p.seed, p.stop_token_ids) == (10, 5, 7, [3, 4])
    assert all(type(v) is int for v in (p.max_new_tokens, p.top_k, p.seed, *p.stop_token_ids))
    for bad in ({"max_new_tokens": 10.5}, {"top_k": "5"}, {"seed": True},
                {"stop_token_ids": [3.5]}, {"max_new_tokens": math.inf}):
        with pytest.raises(InvalidRequestError) as exc:
            SamplingParams.from_dict(bad, vocab_size=VOCAB)
        assert exc.value.field == next(iter(bad))
