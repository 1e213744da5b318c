"""Stop conditions checked after every step: EOS, stop ids, length, stop strings.

Stop strings may span token boundaries, so they are matched on decoded text: the tail of the
output long enough to hold the longest stop string plus the newest tokens.
"""

from __future__ import annotations

from specserve.runtime.scheduler.req import Req


class StopChecker:
    def __init__(self, tokenizer, eos_token_ids: list[int], context_length: int) -> None:
        self.tokenizer = tokenizer
        self.eos = set(eos_token_ids)
        self.context_length = context_length

    def check(self, req: Req, num_new: int) -> dict | None:
        """Finish reason after `num_new` tokens were appended, or None to continue.

        With several new tokens (speculation) the request is cut at the first that stops it;
        the caller truncates `output_ids` to `req.output_ids[:keep]` via the returned "keep".
        """
        p = req.params
        start = len(req.output_ids) - num_new
        for i in range(start, len(req.output_ids)):
            tok = req.output_ids[i]
            n_out = i + 1
            if tok in p.stop_token_ids:
                return {"type": "stop", "matched": tok, "keep": n_out}
            if tok in self.eos and not p.ignore_eos:
                return {"type": "stop", "matched": tok, "keep": n_out}
            if p.stop:
                matched = self._stop_string(req, n_out)
                if matched is not None:
                    return {"type": "stop", "matched": matched, "keep": n_out}
            if n_out >= p.max_new_tokens:
                return {"type": "length", "length": n_out, "keep": n_out}
            if len(req.prompt_ids) + n_out >= self.context_length:
                return {"type": "length", "length": n_out, "keep": n_out}
        return None

    def _stop_string(self, req: Req, n_out: int) -> str | None:
        # A token may be a single byte of a multi-byte character (byte-level BPE): count the
        # stop strings' UTF-8 bytes, not their characters, plus 3 tokens for a character cut at
        # the window's start. ("日本語" is 3 characters but 9 byte tokens.)
        longest = max(len(s.encode("utf-8")) for s in req.params.stop)
        window = req.output_ids[max(0, n_out - longest - 4) : n_out]
        last = req.output_ids[max(0, n_out - 1) : n_out]
        tail = self.tokenizer.decode(window, skip_special_tokens=False)
        newest = self.tokenizer.decode(last, skip_special_tokens=False)
        for s in req.params.stop:
            # only a match that ends inside the newest token's text is new
            pos = tail.find(s, max(0, len(tail) - len(newest) - len(s) + 1))
            if pos != -1:
                return s
        return None
