"""Incremental detokenization with stop strings.

Text is decoded from all output tokens each time (byte-level BPE pieces only
make sense together), held back while it ends in an incomplete UTF-8 character,
and held back by one character less than the longest stop string so a stop
string is never streamed in part.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Protocol, cast


class Decoder(Protocol):
    """What the engines use of a tokenizer (as transformers' tokenizers type it)."""

    def decode(self, token_ids: list[int], skip_special_tokens: bool = ...) -> str | list[str]: ...


class TextStream:
    """Output text of one request, released piece by piece."""

    def __init__(self, tokenizer: Decoder, stop: Sequence[str] = ()) -> None:
        self.tokenizer = tokenizer
        self.stop = tuple(s for s in stop if s)
        self.hold = max((len(s) for s in self.stop), default=1) - 1
        self.token_ids: list[int] = []
        self.released = 0
        self.stopped = False

    def push(self, token_ids: Sequence[int], final: bool = False) -> str:
        """Add tokens; return the text that may be released now. After a stop
        string is found, ``stopped`` is True and the text ends before it."""
        self.token_ids.extend(token_ids)
        text = cast(str, self.tokenizer.decode(self.token_ids, skip_special_tokens=True))  # one sequence: one text
        search_from = max(0, self.released - self.hold)
        hits = [i for i in (text.find(s, search_from) for s in self.stop) if i >= 0]
        if hits:
            self.stopped = True
            end = min(hits)
        elif final:
            end = len(text)
        else:
            end = len(text) - self.hold
            while end > self.released and text[end - 1] == "\ufffd":  # incomplete UTF-8 sequence
                end -= 1
        if end <= self.released:
            return ""
        piece, self.released = text[self.released : end], end
        return piece
