"""Benchmark datasets: the tolerant ShareGPT parser, the train/held-out split, and the samplers."""

from __future__ import annotations

import json
import random
from pathlib import Path
from typing import Any

import pytest

from specserve.corpora import extraction_prompts, rewrite_prompts, schema_prompts
from specserve.corpora.datasets import (
    DatasetError,
    load_sharegpt,
    sample_requests,
    split_of,
)


class WordTokenizer:
    """One token per whitespace-separated word; ids 0-2 are special."""

    all_special_ids = [0, 1, 2]

    def __init__(self) -> None:
        self.ids: dict[str, int] = {}
        self.words: dict[int, str] = {}

    def __len__(self) -> int:
        return 500

    def encode(self, text: str, add_special_tokens: bool = True) -> list[int]:
        return [self.ids.setdefault(w, 3 + len(self.ids)) for w in text.split()]

    def decode(self, ids: list[int]) -> str:
        return " ".join(f"w{i}" for i in ids)

    def apply_chat_template(self, messages: list[dict[str, str]], tokenize: bool = True,
                            add_generation_prompt: bool = True, **_: Any) -> Any:
        text = " ".join(f"<{m['role']}> {m['content']}" for m in messages) + " <assistant>"
        return self.encode(text) if tokenize else text


def record(rid: str, *turns: tuple[str, str]) -> dict[str, Any]:
    return {"id": rid, "conversations": [{"from": f, "value": v} for f, v in turns]}


RECORDS = [
    record("a_0", ("human", "hi there"), ("gpt", "hello, \"quoted\" and é")),
    record("b_0", ("gpt", "continued answer")),
    record("c_0", ("human", "q"), ("gpt", "a"), ("human", "q2"), ("gpt", "a2")),
]


def write_sharegpt(path: Path, records: list[dict[str, Any]]) -> Path:
    path.write_text(json.dumps(records, indent=2, ensure_ascii=False), encoding="utf-8")
    return path


def test_complete_file_keeps_every_record_and_maps_roles(tmp_path: Path) -> None:
    convs = load_sharegpt(write_sharegpt(tmp_path / "s.json", RECORDS), min_turns=0)
    assert [c.id for c in convs] == ["a_0", "b_0", "c_0"]
    assert convs[0].turns[1].role == "assistant" and convs[0].turns[0].role == "user"
    assert convs[0].turns[1].text == "hello, \"quoted\" and é"
    assert [c.id for c in load_sharegpt(tmp_path / "s.json", min_turns=2)] == ["a_0", "c_0"]


def test_every_truncation_point_keeps_exactly_the_complete_records(tmp_path: Path) -> None:
    data = json.dumps(RECORDS, indent=2, ensure_ascii=False).encode()
    # byte offsets just past each record's closing brace (multi-byte UTF-8 never looks like ASCII)
    ends, depth, in_str, esc = [], 0, False, False
    for i, c in enumerate(data.decode("latin-1")):
        if in_str:
            esc, in_str = (not esc and c == "\\"), (esc or c != '"')
        elif c == '"':
            in_str = True
        elif c in "{}":
            depth += 1 if c == "{" else -1
            if depth == 0:
                ends.append(i + 1)
    assert len(ends) == 3
    path = tmp_path / "cut.json"
    for cut in range(len(data) + 1):
        path.write_bytes(data[:cut])
        expected = sum(e <= cut for e in ends)
        assert len(load_sharegpt(path, min_turns=0)) == expected, f"cut at byte {cut}"


def test_truncated_mid_string_and_mid_utf8_character(tmp_path: Path) -> None:
    data = json.dumps(RECORDS, ensure_ascii=False).encode()
    cut_in_string = data.index(b"continued") + 4
    (tmp_path / "s.json").write_bytes(data[:cut_in_string])
    assert [c.id for c in load_sharegpt(tmp_path / "s.json", min_turns=0)] == ["a_0"]
    e_acute = data.index("é".encode())
    (tmp_path / "u.json").write_bytes(data[: e_acute + 1])  # half of a two-byte character
    assert load_sharegpt(tmp_path / "u.json", min_turns=0) == []


def test_empty_inputs_give_no_records_and_non_arrays_are_errors(tmp_path: Path) -> None:
    for text in ("", "  \n", "[", "[]", "[\n  "):
        (tmp_path / "e.json").write_text(text)
        assert load_sharegpt(tmp_path / "e.json", min_turns=0) == []
    (tmp_path / "o.json").write_text('{"id": "x"}')
    with pytest.raises(DatasetError, match="JSON array"):
        load_sharegpt(tmp_path / "o.json")
    (tmp_path / "r.json").write_text('[{"id": "x", "conversations": 3}]')
    with pytest.raises(DatasetError, match="conversations"):
        load_sharegpt(tmp_path / "r.json")


@pytest.mark.slow
def test_packaged_sharegpt_file_has_17671_records_17400_with_two_turns() -> None:
    assert len(load_sharegpt(min_turns=0)) == 17671
    assert len(load_sharegpt()) == 17400


def test_split_is_pinned_shares_parts_and_holds_out_about_ten_percent() -> None:
    # Pinned values: changing the hash would silently move EAGLE training data into evaluation.
    pinned = {"QWJhYvA_0": "train", "hRPPgZT_11": "train", "VY7cMKG_0": "heldout",
              "CDPvmZz_0": "heldout", "IWkMGRK_0": "train", "U02GBUJ_0": "heldout"}
    assert {i: split_of(i) for i in pinned} == pinned
    assert split_of("abc_0") == split_of("abc_17") == split_of("abc")
    ids = [f"conv{k}_0" for k in range(2000)]
    held = sum(split_of(i) == "heldout" for i in ids)
    assert 0.07 * len(ids) < held < 0.13 * len(ids)



def prose(seed: int, n_words: int) -> str:
    rng = random.Random(seed)
    return " ".join(rng.choice(["alpha", "beta", "gamma", "delta", "teh", "recieve"]) + str(k)
                    for k in range(n_words))


def code_block(seed: int, n_lines: int) -> str:
    return "\n".join(f"x{seed}_{k} = compute({k}, y);" for k in range(n_lines))


def rewrite_corpus(tmp_path: Path, n: int = 200) -> Path:
    recs = []
    for k in range(n):
        answer = (f"Here you go:\n```python\n{code_block(k, 20)}\n```\nDone." if k % 3 == 0
                  else prose(k, 80 + k % 50))
        recs.append(record(f"r{k}_0", ("human", prose(1000 + k, 10)), ("gpt", answer),
                           ("human", "too short"), ("gpt", prose(2000 + k, 700))))
    return write_sharegpt(tmp_path / "rw.json", recs)


def test_rewrite_prompts_quote_their_passage_and_match_code_to_code_tasks(tmp_path: Path) -> None:
    tok = WordTokenizer()
    path = rewrite_corpus(tmp_path)
    reqs = sample_requests("rewrite", 60, tok, seed=1, dataset_path=path, max_new_tokens=100)
    assert len(reqs) == 60 and len({r.id for r in reqs}) == 60
    code_names = {t.name for t in rewrite_prompts.CODE_TASKS}
    for r in reqs:
        text = r.messages[0]["content"]
        assert r.passage and r.passage in text
        n = len(tok.encode(r.passage))
        assert 60 <= n <= 400, "the 700-word and 10-word turns must never be chosen"
        is_code = r.passage.startswith("x")
        assert (r.kind.split(":")[1] in code_names) == is_code
        assert 1 <= r.max_new_tokens <= 100
        assert r.prompt_len == len(tok.apply_chat_template(r.messages))
    assert len({r.kind for r in reqs}) >= 5


def test_rewrite_sampling_is_deterministic_and_splits_are_disjoint(tmp_path: Path) -> None:
    path = rewrite_corpus(tmp_path)

    def sample(split: str, seed: int = 0) -> list[tuple[str, str, str]]:
        reqs = sample_requests("rewrite", 1000, WordTokenizer(), seed, dataset_path=path,
                               split=split)
        return [(r.id.removeprefix("rewrite-"), r.kind, r.messages[0]["content"]) for r in reqs]

    assert sample("all") == sample("all") and sample("all", seed=1) != sample("all")
    train = {cid for cid, _, _ in sample("train")}
    held = {cid for cid, _, _ in sample("heldout")}
    assert train and held and not train & held
    assert train | held == {cid for cid, _, _ in sample("all")}
    assert all(split_of(cid) == "heldout" for cid in held)
    assert all(split_of(cid) == "train" for cid in train)


def split_ids(dataset: str, path: Path) -> set[str]:
    """The held-out request ids of a dataset, checked non-empty and disjoint from training's."""
    tok = WordTokenizer()
    held, train = ({r.id for r in sample_requests(dataset, 1000, tok, 0, dataset_path=path,
                                                  split=split)} for split in ("heldout", "train"))
    assert held and train and not held & train
    return held


def test_schema_prompts_cycle_tasks_quote_the_message_and_split_disjointly(tmp_path: Path
                                                                          ) -> None:
    path = rewrite_corpus(tmp_path)
    tok = WordTokenizer()
    reqs = sample_requests("schema", 30, tok, seed=2, dataset_path=path, max_new_tokens=64)
    assert len(reqs) == 30 and len({r.id for r in reqs}) == 30
    names = [t.name for t in schema_prompts.TASKS]
    assert [r.kind for r in reqs[:6]] == [f"schema:{n}" for n in names * 2]
    for r in reqs:
        text = r.prompt
        assert r.messages is None and r.prompt_len == len(tok.encode(text))
        task = next(t for t in schema_prompts.TASKS if r.kind == f"schema:{t.name}")
        assert text.startswith(task.instruction) and text.endswith(f"\n{task.label}")
        message = text.split("\nMessage: ")[-1].removesuffix(f"\n{task.label}")
        assert len(message.split()) == 10  # the conversation's first user turn
        assert all(a in text for a in task.examples)  # both worked examples
        assert 1 <= r.max_new_tokens <= 64
    held = split_ids("schema", path)
    assert all(split_of(i.removeprefix("schema-")) == "heldout" for i in held)


def test_extraction_prompts_carry_their_schema_and_split_disjointly(tmp_path: Path) -> None:
    path = rewrite_corpus(tmp_path)
    tok = WordTokenizer()
    reqs = sample_requests("extraction", 12, tok, seed=2, dataset_path=path, max_new_tokens=64)
    assert len(reqs) == 12 and len({r.id for r in reqs}) == 12
    names = [t.name for t in extraction_prompts.TASKS]
    assert [r.kind for r in reqs[:6]] == [f"extraction:{n}" for n in names * 2]
    for r in reqs:
        task = next(t for t in extraction_prompts.TASKS if r.kind == f"extraction:{t.name}")
        assert r.extra["json_schema"] == task.schema
        text = r.messages[0]["content"]
        assert text.startswith(task.instruction) and json.dumps(task.schema) in text
        assert 1 <= r.max_new_tokens <= 64
    split_ids("extraction", path)


def test_sharegpt_sampling_prunes_lengths_and_caps_output(tmp_path: Path) -> None:
    recs = [
        record("ok_0", ("human", prose(1, 20)), ("gpt", prose(2, 50))),
        record("short_0", ("human", "hi there"), ("gpt", prose(3, 50))),  # 4 tokens: kept
        record("tooshort_0", ("human", "hi"), ("gpt", prose(3, 50))),  # 3 tokens with template
        record("long_0", ("human", prose(4, 1100)), ("gpt", prose(5, 10))),
        record("longpair_0", ("human", prose(4, 1000)), ("gpt", prose(5, 1100))),
        record("oneword_0", ("human", prose(4, 10)), ("gpt", "ok")),  # answer under 2 tokens
        record("gptfirst_0", ("gpt", "x"), ("human", prose(6, 30)), ("gpt", prose(7, 5))),
        record("noanswer_0", ("human", prose(8, 30)), ("human", prose(9, 30))),
    ]
    path = write_sharegpt(tmp_path / "s.json", recs)
    reqs = sample_requests("sharegpt", 10, WordTokenizer(), dataset_path=path, max_new_tokens=30)
    by_id = {r.id: r for r in reqs}
    assert set(by_id) == {"sharegpt-ok_0", "sharegpt-short_0", "sharegpt-gptfirst_0"}
    assert by_id["sharegpt-ok_0"].reference_output_len == 50
    assert by_id["sharegpt-ok_0"].max_new_tokens == 30  # capped
    assert by_id["sharegpt-gptfirst_0"].max_new_tokens == 5
    assert by_id["sharegpt-short_0"].prompt_len == 4
    assert by_id["sharegpt-gptfirst_0"].messages[0]["content"] == prose(6, 30)


def test_random_prompts_respect_lengths_and_avoid_special_tokens() -> None:
    tok = WordTokenizer()
    reqs = sample_requests("random", 50, tok, seed=3, random_input_len=40, random_output_len=20,
                           random_range_ratio=0.5, max_new_tokens=15)
    assert all(20 <= r.prompt_len == len(r.input_ids) <= 40 for r in reqs)
    assert all(1 <= r.max_new_tokens <= 15 for r in reqs)
    assert not {i for r in reqs for i in r.input_ids} & set(tok.all_special_ids)
    again = sample_requests("random", 50, tok, seed=3, random_input_len=40, random_output_len=20,
                            random_range_ratio=0.5, max_new_tokens=15)
    assert [r.input_ids for r in again] == [r.input_ids for r in reqs]
    fixed = sample_requests("random", 5, tok, random_input_len=7, random_range_ratio=1.0)
    assert {r.prompt_len for r in fixed} == {7}


def test_shared_prefix_prompts_share_their_groups_system_prompt() -> None:
    tok = WordTokenizer()
    reqs = sample_requests("shared-prefix", 10, tok, seed=2, random_input_len=6,
                           random_output_len=20, max_new_tokens=15, shared_prefix_len=30,
                           shared_prefix_groups=3)
    assert len(reqs) == 10 and all(r.prompt_len == len(r.input_ids) == 36 for r in reqs)
    assert [r.kind for r in reqs] == ["shared-prefix:0"] * 4 + ["shared-prefix:1"] * 4 + \
        ["shared-prefix:2"] * 2  # group after group
    prefixes = [tuple(r.input_ids[:30]) for r in reqs]
    assert len(set(prefixes)) == 3 and prefixes[:4] == [prefixes[0]] * 4
    assert len({tuple(r.input_ids[30:]) for r in reqs}) == 10
    assert {r.max_new_tokens for r in reqs} == {15}
    assert not {i for r in reqs for i in r.input_ids} & set(tok.all_special_ids)
    with pytest.raises(DatasetError):
        sample_requests("shared-prefix", 4, tok, shared_prefix_groups=0)


def test_custom_jsonl_reads_prompts_and_messages(tmp_path: Path) -> None:
    path = tmp_path / "c.jsonl"
    path.write_text(
        '{"prompt": "one two three"}\n\n'
        '{"id": "m", "kind": "code", "max_new_tokens": 7, '
        '"messages": [{"role": "user", "content": "a b"}]}\n'
    )
    reqs = sample_requests("custom", 10, WordTokenizer(), dataset_path=path, max_new_tokens=50)
    assert [(r.id, r.kind, r.prompt_len, r.max_new_tokens) for r in reqs] == [
        ("custom-1", "custom", 3, 50), ("m", "code", 4, 7)]
    assert reqs[0].prompt == "one two three" and reqs[1].messages is not None


@pytest.mark.parametrize("bad, message", [
    ("{not json", "not valid JSON"),
    ('{"text": "x"}', "one of 'prompt' or 'messages'"),
    ('{"prompt": "x", "messages": []}', "one of 'prompt' or 'messages'"),
    ('{"prompt": "x", "max_new_tokens": 0}', "positive integer"),
    ('{"messages": [{"role": "user"}]}', "'messages' must be"),
    ('{"prompt": ""}', "non-empty string"),
])
def test_custom_jsonl_errors_name_the_line(tmp_path: Path, bad: str, message: str) -> None:
    path = tmp_path / "c.jsonl"
    path.write_text('{"prompt": "fine"}\n\n' + bad + "\n")
    with pytest.raises(DatasetError, match=message) as err:
        sample_requests("custom", 5, WordTokenizer(), dataset_path=path)
    assert f"{path}:3:" in str(err.value)


def test_unknown_dataset_and_split_are_errors(tmp_path: Path) -> None:
    with pytest.raises(DatasetError, match="unknown dataset"):
        sample_requests("nope", 1, WordTokenizer())
    path = write_sharegpt(tmp_path / "s.json", RECORDS)
    with pytest.raises(DatasetError, match="unknown split"):
        sample_requests("sharegpt", 1, WordTokenizer(), dataset_path=path, split="test")
