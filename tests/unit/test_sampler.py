from __future__ import annotations

import pytest
import torch

from specserve.runtime.sampling import (
    SamplingBatchInfo,
    SamplingParams,
    apply_penalties,
    expand,
    process_logits,
    sample,
    sample_from_probs,
)

V = 32


def make_generator(seed: int) -> torch.Generator:
    return torch.Generator().manual_seed(seed)


def _info(params: list[SamplingParams], **kw) -> SamplingBatchInfo:
    return SamplingBatchInfo.from_params(params, vocab_size=V, device="cpu", **kw)


def _log_probs(probs: list[float]) -> torch.Tensor:
    return torch.tensor(probs, dtype=torch.float32).log()[None, :]  # [1, V]


def _random_logits(rows: int, vocab: int = V, seed: int = 0) -> torch.Tensor:
    g = torch.Generator().manual_seed(seed)
    return torch.randn(rows, vocab, generator=g) * 2.0  # [rows, vocab]


def test_all_greedy_batch_only_needs_argmax() -> None:
    info = _info([SamplingParams(temperature=0.0), SamplingParams(top_k=1, temperature=0.8)])
    assert info.all_greedy
    assert not (info.need_top_k or info.need_top_p or info.need_min_p or info.need_penalties)
    logits = _random_logits(2)
    assert torch.equal(sample(logits, info), logits.argmax(-1))
    probs = process_logits(logits, info)
    assert torch.equal(probs, torch.nn.functional.one_hot(logits.argmax(-1), V).float())


def test_flags_ignore_filters_of_greedy_rows_and_disabled_values() -> None:
    info = _info([SamplingParams(temperature=0.0, top_p=0.5, min_p=0.2), SamplingParams(top_k=V)])
    assert not info.all_greedy
    assert not (info.need_top_k or info.need_top_p or info.need_min_p)
    assert info.top_ks.tolist() == [V, V]
    assert _info([SamplingParams()]).top_ks.tolist() == [V]


def test_top_k_one_equals_greedy_with_temperature() -> None:
    logits = _random_logits(4, seed=1)
    greedy = sample(logits, _info([SamplingParams(temperature=0.0)] * 4))
    topk1 = sample(logits, _info([SamplingParams(temperature=1.3, top_k=1, seed=3)] * 4))
    assert torch.equal(greedy, logits.argmax(-1))
    assert torch.equal(topk1, greedy)


def test_greedy_row_in_sampled_batch_gets_argmax() -> None:
    logits = _random_logits(3, seed=2)
    info = _info([SamplingParams(temperature=0.0), SamplingParams(), SamplingParams()])
    for _ in range(5):
        assert sample(logits, info)[0] == logits[0].argmax()


def test_top_k_keeps_exactly_the_k_most_likely() -> None:
    logits = _log_probs([0.1, 0.4, 0.2, 0.3])
    info = SamplingBatchInfo.from_params([SamplingParams(top_k=2)], vocab_size=4)
    probs = process_logits(logits, info)[0]
    torch.testing.assert_close(probs, torch.tensor([0.0, 4 / 7, 0.0, 3 / 7]))


def test_top_p_keeps_smallest_set_reaching_top_p() -> None:
    # Convention: keep the smallest most-likely set whose mass >= top_p. 0.5 + 0.3 reaches 0.8.
    logits = _log_probs([0.5, 0.3, 0.15, 0.05])
    info = SamplingBatchInfo.from_params([SamplingParams(top_p=0.8)], vocab_size=4)
    probs = process_logits(logits, info)[0]
    torch.testing.assert_close(probs, torch.tensor([0.625, 0.375, 0.0, 0.0]))
    # Just above the boundary the third token is needed.
    info = SamplingBatchInfo.from_params([SamplingParams(top_p=0.81)], vocab_size=4)
    probs = process_logits(logits, info)[0]
    torch.testing.assert_close(probs, torch.tensor([0.5, 0.3, 0.15, 0.0]) / 0.95)
    # The most likely token always survives, also below the float64 slack (TOP_P_EPS) and
    # for a top_p that float32 rounds to 0.
    for top_p in (0.01, 1e-10, 5e-324):
        info = SamplingBatchInfo.from_params([SamplingParams(top_p=top_p)], vocab_size=4)
        assert process_logits(logits, info)[0].tolist() == [1.0, 0.0, 0.0, 0.0], top_p


def test_top_p_applies_after_top_k_renormalisation() -> None:
    # After top_k=3 the mass is [0.5, 0.3, 0.15] / 0.95; 0.5/0.95 + 0.3/0.95 = 0.842 >= 0.84.
    logits = _log_probs([0.5, 0.3, 0.15, 0.05])
    info = SamplingBatchInfo.from_params([SamplingParams(top_k=3, top_p=0.84)], vocab_size=4)
    torch.testing.assert_close(process_logits(logits, info)[0], torch.tensor([0.625, 0.375, 0, 0]))


def test_min_p_drops_tokens_below_fraction_of_max() -> None:
    logits = _log_probs([0.5, 0.3, 0.15, 0.05])
    info = SamplingBatchInfo.from_params([SamplingParams(min_p=0.25)], vocab_size=4)
    # threshold 0.125: 0.15 stays, 0.05 goes
    probs = process_logits(logits, info)[0]
    torch.testing.assert_close(probs, torch.tensor([0.5, 0.3, 0.15, 0.0]) / 0.95)


def test_temperature_scales_logits_before_softmax() -> None:
    logits = _random_logits(1, seed=4)
    info = _info([SamplingParams(temperature=0.5)])
    torch.testing.assert_close(process_logits(logits, info), torch.softmax(logits / 0.5, -1))


def test_mixed_batch_rows_match_rows_alone() -> None:
    params = [
        SamplingParams(temperature=0.0),
        SamplingParams(temperature=0.7, seed=11),
        SamplingParams(temperature=0.9, top_k=3, seed=12),
        SamplingParams(temperature=1.2, top_p=0.6, min_p=0.05, seed=13),
        SamplingParams(temperature=1.0, top_k=5),  # unseeded
    ]
    logits = _random_logits(len(params), seed=5)
    positions = [7, 8, 9, 10, 11]
    batch_probs = process_logits(logits, _info(params))
    batch_tokens = sample(logits, _info(params), positions=positions)
    for i, p in enumerate(params):
        alone = _info([p])
        assert torch.equal(batch_probs[i], process_logits(logits[i:i + 1], alone)[0])
        if p.is_greedy or p.seed is not None:
            alone_token = sample(logits[i:i + 1], alone, positions=positions[i:i + 1])[0]
            assert batch_tokens[i] == alone_token
        assert batch_probs[i, batch_tokens[i]] > 0
    assert int((batch_probs[2] > 0).sum()) == 3
    assert int((batch_probs[4] > 0).sum()) == 5


def _filter_by_definition(logits: torch.Tensor, params: list[SamplingParams]) -> torch.Tensor:
    """process_logits' top-k / top-p written from its definition with a full stable sort per
    row (no candidates), then its min-p and renormalisation."""
    rows = []
    for x, p in zip(logits, params):
        V_ = x.shape[-1]
        probs = torch.softmax(x[None].float() / p.temperature, dim=-1)[0]
        vals, idx = probs.sort(descending=True, stable=True)  # ties: lower token id first
        k = V_ if p.top_k == -1 else min(p.top_k, V_)
        vals = torch.where(torch.arange(V_) < k, vals, 0.0)
        keep = k
        if p.top_p < 1.0:
            total = torch.zeros(V_).scatter_(0, idx, vals).cumsum(0, dtype=torch.float64)[-1]
            cum = vals.cumsum(0, dtype=torch.float64)
            target = torch.tensor(p.top_p, dtype=torch.float32).double() * total - 1e-6
            over = torch.nonzero(cum - vals >= target).flatten()
            keep = min(keep, int(over[0]) if over.numel() else V_)
        vals = torch.where(torch.arange(V_) < keep, vals, 0.0)
        out = torch.zeros(V_).scatter_(0, idx, vals)
        if p.min_p > 0:
            out = out.masked_fill(out < torch.tensor(p.min_p) * out.max(), 0.0)
        rows.append(out / out.cumsum(0, dtype=torch.float64)[-1].float())
    return torch.stack(rows)


def _filter_cases(seed: int, rows: int, vocab: int) -> tuple[torch.Tensor, list[SamplingParams]]:
    """Peaked, middling and flat rows, some with tied probabilities, and every filter mix."""
    g = torch.Generator().manual_seed(seed)
    scales = torch.tensor([8.0, 3.0, 1.0, 0.2])[torch.randint(0, 4, (rows,), generator=g)]
    logits = torch.randn(rows, vocab, generator=g) * scales[:, None]
    ties = torch.rand(rows, generator=g) < 0.3
    logits[ties] = (logits[ties] * 2).round() / 2  # many exactly equal probabilities
    rng = torch.Generator().manual_seed(seed + 1)

    def pick(options):
        return options[int(torch.randint(0, len(options), (1,), generator=rng))]

    params = [SamplingParams(temperature=pick([0.5, 0.7, 1.0, 1.5]),
                             top_k=pick([-1, -1, 1, 3, 40, 300, 2000]),
                             top_p=pick([1.0, 0.5, 0.9, 0.95, 0.999]),
                             min_p=pick([0.0, 0.0, 0.05]), seed=pick([None, 3]))
              for _ in range(rows)]
    return logits, params


@pytest.mark.parametrize("seed", range(4))
def test_top_k_top_p_candidates_equal_the_full_sort_bit_for_bit(seed, monkeypatch) -> None:
    """process_logits settles top-k / top-p on each row's most likely tokens when it can: its
    probabilities are the full-sort definition's, bits included, whatever the candidate sizes
    (tiny ones force the tie and escalation paths), alone or in any batch."""
    import specserve.runtime.sampling.sampler as sampler

    vocab = 3000
    logits, params = _filter_cases(seed, 48, vocab)
    want = _filter_by_definition(logits, params)
    info = SamplingBatchInfo.from_params(params, vocab_size=vocab)
    for sizes in (sampler.TOP_CANDIDATES, (2, 16), (1,), ()):
        monkeypatch.setattr(sampler, "TOP_CANDIDATES", sizes)
        got = process_logits(logits, info)
        assert torch.equal(got, want), f"candidates {sizes}"
    for i in range(0, 48, 7):
        alone = SamplingBatchInfo.from_params(params[i:i + 1], vocab_size=vocab)
        assert torch.equal(process_logits(logits[i:i + 1], alone)[0], want[i])


def test_top_p_on_a_flat_row_falls_back_to_the_full_sort() -> None:
    # 3000 nearly equal tokens: top-p 0.9 needs ~2700 of them, beyond every candidate size
    vocab = 3000
    logits = torch.randn(1, vocab, generator=torch.Generator().manual_seed(9)) * 0.01
    p = [SamplingParams(top_p=0.9)]
    got = process_logits(logits, SamplingBatchInfo.from_params(p, vocab_size=vocab))
    assert 2500 < int((got > 0).sum()) < 2800
    assert torch.equal(got, _filter_by_definition(logits, p))


def test_seeded_token_depends_only_on_seed_and_position() -> None:
    seeded = SamplingParams(temperature=1.0, seed=1234)
    logits = _random_logits(6, seed=6) / 4  # flat enough that 16 positions are not all one token
    positions = range(40, 56)

    def run(params: list[SamplingParams], row: int) -> list[int]:
        info = _info(params)  # rebuilt every step, as the runner does: seeded rows keep no state
        batch_logits = logits[: len(params)].clone()
        batch_logits[row] = logits[0]
        out = []
        for pos in positions:
            pos_per_row = [pos if i == row else 3 for i in range(len(params))]
            out.append(int(sample(batch_logits, info, positions=pos_per_row)[row]))
        return out

    alone = run([seeded], 0)
    others = [SamplingParams(), SamplingParams(seed=99), SamplingParams(temperature=0.0),
              SamplingParams(top_p=0.5)]
    assert run(others[:3] + [seeded] + others[3:], 3) == alone
    assert run([seeded] + others, 0) == alone
    assert run([seeded], 0) == alone
    assert len(set(alone)) > 1, "positions draw independent noise"
    other_seed = SamplingParams(temperature=1.0, seed=1235)
    assert run([other_seed], 0) != alone


def test_seeded_rows_need_positions() -> None:
    info = _info([SamplingParams(seed=5)])
    with pytest.raises(AssertionError, match="positions"):
        sample(_random_logits(1), info)


def test_sampling_frequencies_match_processed_distribution() -> None:
    vocab = 6
    logits = torch.tensor([[1.0, 0.5, 0.0, -0.5, 2.0, -3.0]])
    n = 40_000
    for params, kw in [
        (SamplingParams(temperature=0.8, top_k=4, min_p=0.05), {"generator": make_generator(0)}),
        # seeded: n positions of one seed are n independent Gumbel-max draws
        (SamplingParams(temperature=1.3, top_p=0.9, seed=42), {}),
    ]:
        info = SamplingBatchInfo.from_params([params], vocab_size=vocab, **kw)
        probs = process_logits(logits, info)[0].double()  # [vocab]
        many = expand(info, [n])
        tokens = sample(logits.expand(n, vocab), many, positions=torch.arange(n))
        freq = torch.bincount(tokens, minlength=vocab).double() / n
        assert torch.all(freq[probs == 0] == 0), "a filtered token was sampled"
        assert 0.5 * (freq - probs).abs().sum() < 0.01
        support = probs > 0
        expected = probs[support] * n
        chi2 = float((((freq[support] * n) - expected) ** 2 / expected).sum())
        assert chi2 < 20.5, chi2  # df <= 5, p = 0.001


def test_sample_from_probs_never_returns_zero_mass_tokens() -> None:
    probs = torch.tensor([[0.0, 0.0, 1.0, 0.0], [0.0, 0.5, 0.0, 0.5], [0.0, 0.0, 0.0, 2.0]])
    info = SamplingBatchInfo.from_params([SamplingParams()] * 3, vocab_size=4,
                                         generator=make_generator(1))
    many = expand(info, [500, 500, 500])
    tokens = sample_from_probs(probs.repeat_interleave(500, dim=0), many).view(3, 500)
    assert torch.all(tokens[0] == 2)
    assert set(tokens[1].tolist()) == {1, 3}
    assert torch.all(tokens[2] == 3)


def test_inverse_cdf_edges_skip_zero_mass_tokens() -> None:
    probs = torch.tensor([[0.0, 0.5, 0.0, 0.5, 0.0]] * 3)  # [3, 5]
    info = SamplingBatchInfo.from_params([SamplingParams()] * 3, vocab_size=5)
    u = torch.tensor([0.0, 0.5, 1.0 - 2.0**-53], dtype=torch.float64)
    # u = 0 must not pick token 0; u exactly at a CDF step moves past the zero-mass token 2;
    assert sample_from_probs(probs, info, uniforms=u).tolist() == [1, 3, 3]
    # Defensive: even u = 1 (u * total rounded up to total) gives the last token with mass.
    probs = torch.tensor([[0.1, 0.2, 0.7, 0.0]])
    info = SamplingBatchInfo.from_params([SamplingParams()], vocab_size=4)
    assert sample_from_probs(probs, info, uniforms=torch.tensor([1.0])).tolist() == [2]


def test_expand_repeats_rows_and_seeds() -> None:
    params = [SamplingParams(temperature=0.5, top_k=3, seed=2**64 - 1), SamplingParams(top_p=0.7)]
    info = _info(params)
    big = expand(info, torch.tensor([3, 2]))
    assert big.batch_size == 5
    assert big.temperatures.tolist() == [0.5, 0.5, 0.5, 1.0, 1.0]
    assert big.top_ks.tolist() == [3, 3, 3, V, V]
    assert big.seeded.tolist() == [True, True, True, False, False]
    assert big.seeds.tolist()[:3] == [-1] * 3  # 2**64 - 1 as int64 bits
    logits = _random_logits(2, seed=8)
    probs = process_logits(logits.repeat_interleave(torch.tensor([3, 2]), dim=0), big)
    torch.testing.assert_close(probs[:3], process_logits(logits, info)[0].expand(3, V))


def test_penalties_change_logits_exactly_as_specified() -> None:
    logits = torch.tensor([[2.0, -1.0, 0.5, 3.0], [2.0, -1.0, 0.5, 3.0]])
    params = [
        SamplingParams(repetition_penalty=2.0, frequency_penalty=0.5, presence_penalty=0.25),
        SamplingParams(),
    ]
    info = SamplingBatchInfo.from_params(params, vocab_size=4)
    assert info.need_repetition_penalty and info.need_output_penalties
    original = logits.clone()
    out = apply_penalties(logits, info, prompt_ids=[[0], [0, 1]], output_ids=[[1, 1, 2], [2]])
    # row 0: seen {0, 1, 2}: 2 -> 1, -1 -> -2, 0.5 -> 0.25, token 3 untouched;
    # output counts {1: 2, 2: 1}: token 1 -= 2 * 0.5 + 0.25, token 2 -= 1 * 0.5 + 0.25
    assert out[0].tolist() == [1.0, -3.25, -0.5, 3.0]
    assert out[1].tolist() == original[1].tolist()
    assert torch.equal(logits, original), "input is not modified"


def test_presence_and_frequency_use_output_tokens_only() -> None:
    logits = torch.zeros(1, 4)
    info = SamplingBatchInfo.from_params(
        [SamplingParams(frequency_penalty=1.0, presence_penalty=-0.5)], vocab_size=4)
    assert not info.need_repetition_penalty
    out = apply_penalties(logits, info, prompt_ids=[[0, 0, 3]], output_ids=[[3, 3, 3]])
    assert out[0].tolist() == [0.0, 0.0, 0.0, -2.5]


def test_sample_applies_penalties_before_greedy_argmax() -> None:
    logits = torch.tensor([[3.0, 2.0, 1.0]])
    info = SamplingBatchInfo.from_params(
        [SamplingParams(temperature=0.0, repetition_penalty=2.0)], vocab_size=3)
    assert int(sample(logits, info, prompt_ids=[[0]], output_ids=[[]])[0]) == 1


def test_argmax_rows_is_torch_argmax_first_maximum_included() -> None:
    from specserve.runtime.sampling import argmax_rows

    x = torch.randn(5, 3000, generator=torch.Generator().manual_seed(3))
    x[1, 7] = x[1, 2000] = 50.0  # tie: the first index wins
    x[2, 11] = float("nan")  # NaN counts as the maximum, as in torch
    for t in (x, x.double(), x[:, ::2], x.t().contiguous().t(), x[0], x.bfloat16()):
        got = argmax_rows(t)
        assert got.dtype == torch.int64 and torch.equal(got, t.argmax(dim=-1))
    assert int(argmax_rows(x)[1]) == 7 and int(argmax_rows(x)[2]) == 11
