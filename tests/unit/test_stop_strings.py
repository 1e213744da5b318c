"""Stop strings: the scheduler's `StopChecker` (matched on decoded text, across token
boundaries, one token or a whole speculative step at a time) and the detokenizer's hold-back and
final cut (`IncrementalText`)."""

from __future__ import annotations

import pytest

from specserve.runtime.model_loader.tokenizer import load_tokenizer
from specserve.runtime.sampling.sampling_params import SamplingParams
from specserve.runtime.scheduler.req import Req
from specserve.runtime.scheduler.stop import StopChecker
from specserve.runtime.tokenizer.detokenizer import IncrementalText
from tests.helpers.tiny_models import write_tiny_tokenizer_files


@pytest.fixture(scope="module")
def tok(tmp_path_factory):
    d = tmp_path_factory.mktemp("tok")
    write_tiny_tokenizer_files(d)
    return load_tokenizer(d)


def byte_level_alphabet() -> dict[int, str]:
    """GPT-2's byte → character map (the byte-level BPE alphabet): printable bytes stand for
    themselves, the n-th other byte for chr(256 + n)."""
    printable = {*range(ord("!"), ord("~") + 1), *range(ord("¡"), ord("¬") + 1),
                 *range(ord("®"), ord("ÿ") + 1)}
    out, n = {}, 0
    for b in range(256):
        if b in printable:
            out[b] = chr(b)
        else:
            out[b] = chr(256 + n)
            n += 1
    return out


def byte_tokens(tok, text: str) -> list[int]:
    """`text` as one token per UTF-8 byte: the worst case for a stop-string window."""
    alphabet = byte_level_alphabet()
    ids = [tok.convert_tokens_to_ids(alphabet[b]) for b in text.encode("utf-8")]
    assert tok.decode(ids) == text
    return ids


def first_stop(checker: StopChecker, stop: list[str], ids: list[int], step: int
               ) -> dict | None:
    """Feed `ids` `step` tokens at a time (a speculative step gains several); the first stop."""
    req = Req("r", [5], SamplingParams(stop=stop, max_new_tokens=1000))
    for i in range(0, len(ids), step):
        new = ids[i : i + step]
        req.output_ids.extend(new)
        reason = checker.check(req, len(new))
        if reason is not None:
            return reason
    return None


@pytest.mark.parametrize("step", [1, 3, 100])
@pytest.mark.parametrize("stop,keep_text", [
    ("日本語", "ok 日本語"),  # 3 characters, 9 byte tokens: the window counts bytes
    ("本語 d", "ok 日本語 d"),
    ("k 日", "ok 日"),
    ("one", "ok 日本語 done"),
])
def test_stop_string_across_byte_tokens_is_found_at_the_token_completing_it(
        tok, stop, keep_text, step):
    ids = byte_tokens(tok, "ok 日本語 done, and more text after it")
    reason = first_stop(StopChecker(tok, [2], 1000), [stop], ids, step)
    assert reason == {"type": "stop", "matched": stop, "keep": len(keep_text.encode())}


def test_stop_string_in_multi_byte_merged_tokens_and_only_new_matches_count(tok):
    ids = tok.encode("the quick brown fox jumps over the lazy dog")
    checker = StopChecker(tok, [2], 1000)
    reason = first_stop(checker, ["fox j", "lazy"], ids, 4)
    text_to_keep = tok.decode(ids[: reason["keep"]])
    assert reason["matched"] == "fox j" and "fox j" in text_to_keep
    assert "fox j" not in tok.decode(ids[: reason["keep"] - 1])
    # a match already in the output before this step is not re-reported by later tokens
    req = Req("r", [5], SamplingParams(stop=["fox"], max_new_tokens=1000))
    req.output_ids = ids[:-1]
    assert checker.check(req, 1) is None


def test_incremental_text_holds_back_a_possible_stop_string_and_cuts_at_finish(tok):
    ids = byte_tokens(tok, "ok 日本語 do")  # the last byte token completes the stop string
    detok = IncrementalText(tok, ["語 do"])
    shown = []
    for t in ids[:-1]:  # the tokenizer side shows text after each step until the finish
        detok.extend([t])
        shown.append(detok.visible())
    detok.extend(ids[-1:])  # the finishing step
    final = detok.finalize({"type": "stop", "matched": "語 do"})
    assert final == "ok 日本"
    for s in shown:  # never a partial character, never past the final cut
        assert "\ufffd" not in s and final.startswith(s)
    assert shown[-1] == "ok 日本"  # "語 d" held back: it could have been (and was) the stop
    # without a stop string nothing is held back: every complete character is shown
    plain = IncrementalText(tok, [])
    plain.extend(ids[:-2])
    assert plain.visible() == "ok 日本語 "
