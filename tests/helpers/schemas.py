"""Schema-constrained prompts for the structured-output and lossless tests: ten questions, each
with the JSON Schema its answer must follow, and their rephrasings (`schema_prompts`)."""

from __future__ import annotations


def _obj(props: dict) -> dict:
    return {"type": "object", "properties": props, "required": list(props)}


def _text(n: int) -> dict:
    return {"type": "string", "maxLength": n}


CASES = [  # (question, schema): ten schema prompts
    ("Describe a person as JSON.", _obj({"name": _text(20), "age": {
        "type": "integer", "minimum": 0, "maximum": 120}})),
    ("Give a book as JSON with its title and year.", _obj({"title": _text(40), "year": {
        "type": "integer", "minimum": 1000, "maximum": 2100}})),
    ("Is the sky blue? Answer in JSON.", _obj({"answer": {"type": "boolean"}})),
    ("Pick a color as JSON.", _obj({"color": {"enum": ["red", "green", "blue"]}})),
    ("List three fruits as JSON.", _obj({"fruits": {"type": "array", "items": _text(15),
                                                    "minItems": 3, "maxItems": 3}})),
    ("Give the capital of France as JSON.", _obj({"country": _text(20), "capital": _text(20)})),
    ("Rate the movie Titanic from 1 to 5 in JSON.", _obj({"movie": _text(30), "stars": {
        "type": "integer", "minimum": 1, "maximum": 5}})),
    ("Give a city and its population as JSON.", _obj({"city": _text(20), "population": {
        "type": "integer", "minimum": 0, "maximum": 10**8}})),
    ("Describe a dog as JSON.", _obj({"breed": {"enum": ["labrador", "poodle", "beagle"]},
                                      "friendly": {"type": "boolean"}})),
    ("Convert 3 kilometers to meters, in JSON.", _obj({"kilometers": {"type": "number"},
                                                       "meters": {"type": "number"}})),
]


PHRASINGS = ("{q}", "Answer with JSON only. {q}", "{q} Keep the values short.")


def schema_prompts(n: int) -> list[tuple[str, dict]]:
    """`n` (question, schema) pairs: the ten cases, then each again rephrased (up to 30)."""
    out = [(p.format(q=q), s) for p in PHRASINGS for q, s in CASES]
    assert n <= len(out), f"at most {len(out)} schema prompts"
    return out[:n]
