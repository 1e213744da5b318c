"""Repeated-output prompts built from ShareGPT text: many requests that fill the same structure
(a JSON record with fixed keys, a SQL query over one table, a support ticket with fixed fields)
for a different user message each: the agentic / structured workload where answers repeat
across requests, which suffix decoding's global tree is for.

Each prompt is a few-shot completion prompt (raw text, no chat template, so a small model keeps
to the structure): the task's instruction, two worked examples (the same for every request of a
task), then the message — the first user turn of a ShareGPT conversation, 8-200 tokens, on one
line — and the answer's lead-in ("JSON:", "SQL:", "Ticket:"). The answers share their skeleton
(keys, field names, SQL keywords, quoting) and differ in the values. Train / held-out follow the
conversation's split (`datasets.split_of`).
"""

from __future__ import annotations

import random
from typing import TYPE_CHECKING, NamedTuple

if TYPE_CHECKING:
    from specserve.corpora.datasets import Conversation, Tokenizer

MIN_MESSAGE_TOKENS, MAX_MESSAGE_TOKENS = 8, 200
_MAX_CHARS = 1600


class SchemaTask(NamedTuple):
    name: str
    instruction: str
    label: str  # the answer's lead-in ("JSON:", ...)
    examples: tuple[str, str]  # the two worked examples' answers
    expected_output_len: int  # tokens: about one answer


EXAMPLE_MESSAGES = ("How do I sort a list of dictionaries by a key in Python?",
                    "What is the capital of Australia and why was it chosen?")

TASKS = (
    SchemaTask(
        "json_record",
        "Describe each user message as a JSON object with exactly these keys, in this order: "
        "language, topic, intent, keywords, needs_code, summary.",
        "JSON:",
        ('{"language": "English", "topic": "programming", "intent": "question", "keywords": '
         '["python", "sort", "dictionary"], "needs_code": true, "summary": "The user asks how '
         'to sort dictionaries in a list by one of their keys."}',
         '{"language": "English", "topic": "geography", "intent": "question", "keywords": '
         '["australia", "capital", "canberra"], "needs_code": false, "summary": "The user asks '
         'which city is the capital of Australia and why it was chosen."}'),
        80),
    SchemaTask(
        "sql_query",
        "The table messages(id INTEGER, language TEXT, topic TEXT, intent TEXT, length INTEGER, "
        "has_code BOOLEAN) stores user messages. For each user message, write one SQL query "
        "that selects the messages with the same language, topic and intent.",
        "SQL:",
        ("SELECT id, topic, intent FROM messages WHERE language = 'English' AND topic = "
         "'programming' AND intent = 'question' ORDER BY length DESC LIMIT 10;",
         "SELECT id, topic, intent FROM messages WHERE language = 'English' AND topic = "
         "'geography' AND intent = 'question' ORDER BY length DESC LIMIT 10;"),
        50),
    SchemaTask(
        "ticket",
        "Turn each user message into a ticket with exactly these fields, one per line: Title, "
        "Category, Priority (low, medium or high), Summary, Next step.",
        "Ticket:",
        ("\nTitle: Sort a list of dictionaries by key\nCategory: Programming\nPriority: low\n"
         "Summary: The user wants to sort dictionaries in a list by the value of one key.\n"
         "Next step: Explain sorted() with a key function and give a short example.",
         "\nTitle: Capital of Australia\nCategory: Geography\nPriority: low\nSummary: The user "
         "wants to know the capital of Australia and the reason it was chosen.\nNext step: "
         "Name Canberra and explain the compromise between Sydney and Melbourne."),
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
            text = " ".join(turn.text.split())  # one line: the examples' layout
            return text if 0 < len(text) <= _MAX_CHARS else None
    return None


def make_prompt(task: SchemaTask, message: str) -> str:
    """A few-shot completion prompt (no chat template): the instruction, two worked examples,
    then the message and the answer's lead-in, so even a small model answers in the structure."""
    shots = "".join(f"Message: {m}\n{task.label} {a}\n\n"
                    for m, a in zip(EXAMPLE_MESSAGES, task.examples))
    return f"{task.instruction}\n\n{shots}Message: {message}\n{task.label}"


def build(
    conversations: list[Conversation], num: int, tokenizer: Tokenizer, rng: random.Random,
    tasks: tuple[SchemaTask, ...] = TASKS,
) -> list[SchemaPrompt]:
    """At most one prompt per conversation, `num` in all, the tasks in turn (so every task's
    structure recurs), deterministic for `rng`'s seed."""
    from specserve.corpora.rewrite_prompts import distinct_in_random_order

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
