"""Chat templates `--chat-template` knows by name, for models whose files ship none (a base model
such as Gemma 3 270M): the model's own template always wins unless the flag is given."""

from __future__ import annotations

from pathlib import Path

CHATML = (
    "{% for message in messages %}{{ '<|im_start|>' + message['role'] + '\\n' + "
    "message['content'] + '<|im_end|>' + '\\n' }}{% endfor %}"
    "{% if add_generation_prompt %}{{ '<|im_start|>assistant\\n' }}{% endif %}"
)
# Gemma's turn format (its instruction-tuned models': a system message joins the first user
# turn); the tokenizer adds <bos> itself only where a template does not
GEMMA = (
    "{{ bos_token }}{% set ns = namespace(system='') %}"
    "{% for message in messages %}"
    "{% if message['role'] == 'system' %}{% set ns.system = message['content'] + '\\n\\n' %}"
    "{% else %}{% set role = 'model' if message['role'] == 'assistant' else message['role'] %}"
    "{{ '<start_of_turn>' + role + '\\n' + ns.system + message['content'] | trim + "
    "'<end_of_turn>\\n' }}{% set ns.system = '' %}{% endif %}{% endfor %}"
    "{% if add_generation_prompt %}{{ '<start_of_turn>model\\n' }}{% endif %}"
)
NAMED = {"chatml": CHATML, "gemma": GEMMA}


def read_template(value: str | None) -> str | None:
    """--chat-template's value: a known name, a file, or the template itself."""
    if value is None:
        return None
    if value in NAMED:
        return NAMED[value]
    path = Path(value)
    return path.read_text() if path.is_file() else value
