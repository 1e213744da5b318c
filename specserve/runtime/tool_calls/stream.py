"""Reading tool calls out of a model's output as it grows.

`ToolCallReader.feed(text)` takes the cumulative text of a choice and returns what is new: the
content (text outside call blocks) and the calls whose blocks closed. Content that could be
the start of a `<tool_call>` tag is held back until it is decided; a block is parsed when its
end tag arrives (a call is sent whole, in one delta, as soon as it is complete). `finish(text)`
settles the rest: a last block without its end tag still counts when its body is complete
JSON (the model may stop right after it), else it is content, as is a block that holds no valid
call. A whole response is the same reader fed once, so streamed and whole responses agree.
"""

from __future__ import annotations

from specserve.runtime.tool_calls.formats import ToolCall, ToolFormat


class ToolCallReader:
    def __init__(self, fmt: ToolFormat, names: set[str]) -> None:
        self.fmt = fmt
        self.names = names
        self.pos = 0  # characters of the text settled: sent as content or read as calls
        self.calls: list[ToolCall] = []
        self.content = ""

    def feed(self, text: str) -> tuple[str, list[ToolCall]]:
        """(new content, new calls) of the cumulative `text`."""
        return self._read(text, final=False)

    def finish(self, text: str) -> tuple[str, list[ToolCall]]:
        """(new content, new calls) of the final `text`, nothing held back."""
        return self._read(text, final=True)

    def _read(self, text: str, final: bool) -> tuple[str, list[ToolCall]]:
        content, calls = [], []
        begin, end = self.fmt.begin, self.fmt.end
        while True:
            i = text.find(begin, self.pos)
            if i < 0:
                stop = len(text) if final else len(text) - _partial(text, begin, self.pos)
                content.append(text[self.pos : stop])
                self.pos = stop
                break
            content.append(text[self.pos : i])
            self.pos = i
            j = text.find(end, i + len(begin))
            if j < 0 and not final:
                break  # an open block: wait for its end
            body = text[i + len(begin) : len(text) if j < 0 else j]
            stop = len(text) if j < 0 else j + len(end)
            found = self.fmt.parse_body(body, self.names)
            if found is None:
                content.append(text[i:stop])
            else:
                calls += found
            self.pos = stop
            if j < 0:
                break
        new = "".join(content)
        self.content += new
        self.calls += calls
        return new, calls


def _partial(text: str, tag: str, start: int) -> int:
    """How many characters at the end of text[start:] could begin `tag`."""
    for n in range(min(len(tag) - 1, len(text) - start), 0, -1):
        if text.endswith(tag[:n]):
            return n
    return 0


def read_all(fmt: ToolFormat, names: set[str], text: str) -> tuple[str | None, list[ToolCall]]:
    """A whole output's content (None when calls were made and nothing else but whitespace was
    said) and calls."""
    reader = ToolCallReader(fmt, names)
    reader.finish(text)
    content = reader.content
    if reader.calls and not content.strip():
        return None, reader.calls
    return content, reader.calls
