"""Incremental detokenization: text that never ends in a broken UTF-8 sequence or a partial
stop string."""

from __future__ import annotations


class IncrementalText:
    """Cumulative text of a growing list of output ids.

    `visible` never ends with U+FFFD from an incomplete multi-byte character, and while the
    request runs it holds back the last `len(longest stop) - 1` characters, which could be the
    start of a stop string. At finish, `finalize` cuts the text at the matched stop string.
    """

    def __init__(self, tokenizer, stop: list[str]) -> None:
        self.tokenizer = tokenizer
        self.stop = stop
        self.hold = max((len(s) for s in stop), default=1) - 1
        self.ids: list[int] = []
        self.text = ""
        self.sent = 0  # characters of text already returned by `visible`

    def extend(self, ids: list[int]) -> None:
        if ids:
            self.ids.extend(ids)
            self.text = self.tokenizer.decode(self.ids, skip_special_tokens=True)

    def visible(self) -> str:
        text = self.text
        if text.endswith("\ufffd"):
            text = text.rstrip("\ufffd")
        end = max(len(text) - self.hold, self.sent)
        self.sent = end
        return text[:end]

    def finalize(self, finish_reason: dict | None) -> str:
        text = self.text
        matched = (finish_reason or {}).get("matched")
        if isinstance(matched, str):
            idx = text.find(matched)
            if idx != -1:
                text = text[:idx]
        self.sent = len(text)
        return text
