"""Extraction prompts with a JSON Schema each, built from ShareGPT text: the constrained
workload (structured output, tool arguments) that grammar-forced drafts and speculation serve.

Each request is a chat turn asking to extract fields from a user message (the first user turn
of a ShareGPT conversation, 8-200 tokens) into JSON following one of three schemas (a message
profile, a support ticket, the entities named); the schema travels with the request
(`BenchRequest.extra["json_schema"]`) and the benchmarks send it as `json_schema` /
`response_format`, so the output is constrained to it. Train / held-out follow the
conversation's split (`datasets.split_of`).
"""

from __future__ import annotations

import json
import random
from typing import TYPE_CHECKING, NamedTuple

if TYPE_CHECKING:
    from specserve.corpora.datasets import Conversation, Tokenizer

MIN_MESSAGE_TOKENS, MAX_MESSAGE_TOKENS = 8, 200
_MAX_CHARS = 1600


def _text(n: int) -> dict:
    return {"type": "string", "maxLength": n}


def _list(n: int) -> dict:
    return {"type": "array", "items": _text(40), "maxItems": n}


def _obj(props: dict) -> dict:
    return {"type": "object", "properties": props, "required": list(props),
            "additionalProperties": False}


class ExtractionTask(NamedTuple):
    name: str
    instruction: str
    schema: dict
    expected_output_len: int  # tokens: about one answer


TASKS = (
    ExtractionTask(
        "message_profile",
        "Describe the user message below as JSON: its language, its topic, the user's intent, "
        "up to five keywords, whether answering needs code, and a one-sentence summary.",
        _obj({"language": _text(20), "topic": _text(40),
              "intent": {"enum": ["question", "request", "opinion", "other"]},
              "keywords": _list(5), "needs_code": {"type": "boolean"},
              "summary": _text(200)}),
        200),
    ExtractionTask(
        "support_ticket",
        "File the user message below as a support ticket in JSON: a category, a priority, a "
        "short title and the details.",
        _obj({"category": {"enum": ["technical", "account", "billing", "content", "other"]},
              "priority": {"enum": ["low", "medium", "high"]}, "title": _text(80),
              "details": _text(300)}),
        200),
    ExtractionTask(
        "entities",
        "List the people, places, organizations and dates the user message below names, as "
        "JSON (empty lists where it names none).",
        _obj({"people": _list(5), "places": _list(5), "organizations": _list(5),
              "dates": _list(5)}),
        120),
)


class ExtractionPrompt(NamedTuple):
    conversation_id: str
    task: str
    messages: list[dict[str, str]]
    schema: dict
    expected_output_len: int


def build(conversations: list[Conversation], num: int, tokenizer: Tokenizer,
          rng: random.Random) -> list[ExtractionPrompt]:
    """`num` prompts, the tasks in turn, from conversations whose first user turn fits."""
    order = list(range(len(conversations)))
    rng.shuffle(order)
    out: list[ExtractionPrompt] = []
    for i in order:
        if len(out) >= num:
            break
        conv = conversations[i]
        text = conv.turns[0].text.strip().replace("\n", " ")[:_MAX_CHARS]
        n = len(tokenizer.encode(text, add_special_tokens=False))
        if not MIN_MESSAGE_TOKENS <= n <= MAX_MESSAGE_TOKENS or conv.turns[0].role != "user":
            continue
        task = TASKS[len(out) % len(TASKS)]
        prompt = (f"{task.instruction} Follow this JSON Schema: {json.dumps(task.schema)}\n\n"
                  f"User message: {text}")
        out.append(ExtractionPrompt(conv.id, task.name, [{"role": "user", "content": prompt}],
                                    task.schema, task.expected_output_len))
    return out
