"""OpenAI tool calls: the `tools` a chat request offers, how the model is shown them, how its
output is read back as `tool_calls`, and the grammar that forces a call
(docs/structured_output.md, "Tool calls").

- `formats.py`: a tool-call format per model family (`ToolFormat`: the prompt block for a chat
  template that ignores `tools`, the parser, the forcing grammar), registered by name;
- `request.py`: the request's `tools` / `tool_choice` checked, the messages rendered;
- `stream.py`: reading calls out of a growing text, for streamed and whole responses alike.
"""

from __future__ import annotations

# --tool-call-parser choices (formats.py registers the formats themselves)
TOOL_CALL_PARSERS = ("auto", "smollm2", "hermes")
