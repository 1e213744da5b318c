"""Copy-heavy prompts built from ShareGPT text: an instruction followed by a passage the answer
repeats or edits (the workload of prompt-lookup / n-gram drafting).

Passages are 60-400 tokens: code blocks (fenced in a ShareGPT answer) get code instructions,
prose (any turn without code) gets text instructions. The prompt quotes the passage verbatim.
"""

from __future__ import annotations

import random
import re
from collections.abc import Iterator
from typing import TYPE_CHECKING, NamedTuple

if TYPE_CHECKING:
    from specserve.corpora.datasets import Conversation, Tokenizer

MIN_PASSAGE_TOKENS, MAX_PASSAGE_TOKENS = 60, 400
# Character bounds that surely contain every 60-400-token passage, checked before tokenizing.
_MIN_CHARS, _MAX_CHARS = 120, 4000


class Task(NamedTuple):
    name: str
    instruction: str
    output_ratio: float  # expected answer tokens per passage token


TEXT_TASKS = (
    Task("repeat", "Repeat the following passage exactly:", 1.0),
    Task("spelling", "Rewrite the following text, fixing any spelling mistakes:", 1.1),
    Task("grammar", "Correct the grammar of the following text and return the full text:", 1.1),
    Task("formal", "Rewrite the following text in a more formal tone:", 1.2),
    Task("summarize", "Summarize the following text:", 0.4),
)
CODE_TASKS = (
    Task("code_comment", "Here is some code; add comments to it and return the full code:", 1.5),
    Task("code_rename",
         "Here is some code; rename the variables to more descriptive names and return the "
         "full code:", 1.2),
    Task("code_repeat", "Repeat the following code exactly:", 1.0),
    Task("code_types",
         "Here is some code; add type annotations where the language allows and return the "
         "full code:", 1.3),
)

_FENCE = re.compile(r"```[^\n`]*\n(.*?)```", re.DOTALL)
_CODE_LINE = re.compile(
    r"^\s*(def |class |import |from \S+ import|#include|function |const |let |var |public |"
    r"private |return\b|if \(|for \(|while \()|[;{}]\s*$"
)


class RewritePrompt(NamedTuple):
    conversation_id: str
    task: str
    passage: str
    prompt: str
    expected_output_len: int  # tokens, from the passage length and the task


def looks_like_code(text: str) -> bool:
    lines = [ln for ln in text.splitlines() if ln.strip()]
    return len(lines) >= 3 and sum(bool(_CODE_LINE.search(ln)) for ln in lines) >= len(lines) / 3


def candidate_passages(conv: Conversation) -> list[tuple[str, bool]]:
    """(passage, is_code) pairs of a conversation, before any token-length check."""
    out = []
    for turn in conv.turns:
        if turn.role == "system":
            continue
        blocks = [b.rstrip("\n") for b in _FENCE.findall(turn.text)]
        out += [(b, True) for b in blocks if b.strip()]
        text = turn.text.strip()
        if "```" not in text:
            out.append((text, looks_like_code(text)))
    return [(p, code) for p, code in out if _MIN_CHARS <= len(p) <= _MAX_CHARS]


def make_prompt(task: Task, passage: str, is_code: bool) -> str:
    body = f"```\n{passage}\n```" if is_code else passage
    return f"{task.instruction}\n\n{body}"


def distinct_in_random_order(
    conversations: list[Conversation], rng: random.Random
) -> Iterator[Conversation]:
    """Conversations in an order fixed by `rng`, each id once (a few ShareGPT ids occur twice;
    request ids must stay unique). Shared by every ShareGPT-based sampler."""
    order = list(range(len(conversations)))
    rng.shuffle(order)
    seen: set[str] = set()
    for idx in order:
        conv = conversations[idx]
        if conv.id not in seen:
            seen.add(conv.id)
            yield conv


def build(
    conversations: list[Conversation], num: int, tokenizer: Tokenizer, rng: random.Random
) -> list[RewritePrompt]:
    """At most one prompt per conversation, `num` in all, deterministic for `rng`'s seed."""
    out: list[RewritePrompt] = []
    for conv in distinct_in_random_order(conversations, rng):
        if len(out) == num:
            break
        candidates = candidate_passages(conv)
        rng.shuffle(candidates)
        for passage, is_code in candidates:
            n = len(tokenizer.encode(passage, add_special_tokens=False))
            if MIN_PASSAGE_TOKENS <= n <= MAX_PASSAGE_TOKENS:
                task = rng.choice(CODE_TASKS if is_code else TEXT_TASKS)
                out.append(RewritePrompt(
                    conv.id, task.name, passage, make_prompt(task, passage, is_code),
                    int(n * task.output_ratio) + 16,
                ))
                break
    return out
