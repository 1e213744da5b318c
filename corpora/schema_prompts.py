"""Repeated-output prompts built from ShareGPT text: many requests that fill the same structure
(a JSON record with fixed keys, a SQL query over one table, a support ticket with fixed fields)
for a different user message each: the agentic / structured workload where answers repeat
across requests, which suffix decoding's global tree is for.

Each prompt names its structure and shows one filled example (the same for every request of a
task), then the message: the first user turn of a ShareGPT conversation, 8-200 tokens. The
answers share their skeleton (keys, field names, SQL keywords, quoting) and differ in the
values. Train / held-out follow the conversation's split (`datasets.split_of`).
"""

from __future__ import annotations

import random
from typing import TYPE_CHECKING, NamedTuple

if TYPE_CHECKING:
    from corpora.datasets import Conversation, Tokenizer

MIN_MESSAGE_TOKENS, MAX_MESSAGE_TOKENS = 8, 200
_MAX_CHARS = 1600


class SchemaTask(NamedTuple):
    name: str
    instruction: str
    expected_output_len: int  # tokens: the example answer's length, roughly


_EXAMPLE_MESSAGE = "How do I sort a list of dictionaries by a key in Python?"

TASKS = (
    SchemaTask(
        "json_record",
        "Describe the user message below as a JSON object with exactly these keys, in this "
        "order: language, topic, intent, keywords, needs_code, summary. Reply with the JSON "
        "only.\n\nExample message: " + _EXAMPLE_MESSAGE + "\nExample answer:\n"
        '{"language": "English", "topic": "programming", "intent": "question", '
        '"keywords": ["python", "sort", "dictionary"], "needs_code": true, '
        '"summary": "The user asks how to sort dictionaries in a list by one of their keys."}',
        80),
    SchemaTask(
        "sql_query",
        "The table messages(id INTEGER, language TEXT, topic TEXT, intent TEXT, length INTEGER, "
        "has_code BOOLEAN) stores user messages. Write one SQL query that selects the messages "
        "similar to the user message below (same language, topic and intent). Reply with the "
        "SQL only.\n\nExample message: " + _EXAMPLE_MESSAGE + "\nExample answer:\n"
        "SELECT id, topic, intent FROM messages WHERE language = 'English' AND topic = "
        "'programming' AND intent = 'question' ORDER BY length DESC LIMIT 10;",
        50),
    SchemaTask(
        "ticket",
        "Turn the user message below into a ticket with exactly these fields, one per line: "
        "Title, Category, Priority (low, medium or high), Summary, Next step. Reply with the "
        "ticket only.\n\nExample message: " + _EXAMPLE_MESSAGE + "\nExample answer:\n"
        "Title: Sort a list of dictionaries by key\nCategory: Programming\nPriority: low\n"
        "Summary: The user wants to sort dictionaries in a list by the value of one key.\n"
        "Next step: Explain sorted() with a key function and give a short example.",
        70),
)


class SchemaPrompt(NamedTuple):
    conversation_id: str
    task: str
    message: str
    prompt: str
    expected_output_len: int


def first_user_message(conv: Conversation) -> str | None:
    for turn in conv.turns:
        if turn.role == "user":
            text = turn.text.strip()
            return text if 0 < len(text) <= _MAX_CHARS else None
    return None


def make_prompt(task: SchemaTask, message: str) -> str:
    return f"{task.instruction}\n\nMessage: {message}\nAnswer:"


def build(
    conversations: list[Conversation], num: int, tokenizer: Tokenizer, rng: random.Random,
    tasks: tuple[SchemaTask, ...] = TASKS,
) -> list[SchemaPrompt]:
    """At most one prompt per conversation, `num` in all, the tasks in turn (so every task's
    structure recurs), deterministic for `rng`'s seed."""
    from corpora.rewrite_prompts import distinct_in_random_order

    out: list[SchemaPrompt] = []
    for conv in distinct_in_random_order(conversations, rng):
        if len(out) == num:
            break
        message = first_user_message(conv)
        if message is None:
            continue
        n = len(tokenizer.encode(message, add_special_tokens=False))
        if not MIN_MESSAGE_TOKENS <= n <= MAX_MESSAGE_TOKENS:
            continue
        task = tasks[len(out) % len(tasks)]
        out.append(SchemaPrompt(conv.id, task.name, message, make_prompt(task, message),
                                task.expected_output_len))
    return out
