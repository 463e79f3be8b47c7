"""Incremental detokenization with stop strings, for streaming text as tokens arrive.

Each token costs the decode of a short window, not of the whole output. The window starts a few
tokens back (at `_prefix`): decoding `ids[_prefix:]` and subtracting the text of `ids[_prefix:_read]`
gives what the tokens after `_read` add, with the context a tokenizer needs to place a leading space
(SentencePiece) or to join the bytes of one character split over tokens (byte-level BPE). The
window moves on once its new text is complete (no trailing U+FFFD); until then that text is
tentative and is released, like the rest, only up to the incomplete character.

The text streamed equals `tokenizer.decode(ids, skip_special_tokens=True)` of the tokens so far for
a tokenizer whose decode of a sequence starts with the decode of its prefixes (byte-level BPE and
SentencePiece ones do); should a window's decode not start with its prefix's, that step decodes from
the first token instead.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any


@dataclass
class Detokenizer:
    tokenizer: Any | None
    stop: tuple[str, ...]
    text: str = ""  # text released so far (never contains a stop string)
    stopped: bool = False
    _ids: list[int] = field(default_factory=list)
    _prefix: int = 0  # the window's first token: context for the tokens after _read
    _read: int = 0  # tokens whose text is complete (a stable prefix of the decode)
    _prefix_text: str = ""  # decode of ids[_prefix:_read]
    _pending: str = ""  # complete text not released yet (held back for the stop strings)
    _ahead: int = 0  # characters of the tentative text already released (then _pending is empty)
    _tentative: str = ""  # text of ids[_read:] that may still change (ends in an incomplete character)

    def add(self, token_id: int, check_stop: bool = True) -> str:
        """Append a token; return newly released text. Sets `stopped` when a stop string appears
        (`check_stop` False: not yet, as before min_tokens; text released meanwhile is not searched again)."""
        self._ids.append(token_id)
        if self.tokenizer is None:
            return ""
        self._advance()
        rest = self._pending + self._tentative[self._ahead:]  # the decode from len(self.text) on
        for s in self.stop if check_stop else ():
            # A stop string cannot start in released text: every release holds back len(s) - 1 characters.
            idx = rest.find(s)
            if idx != -1:
                self.stopped = True
                return self._release(rest[:idx])
        # Hold back an incomplete UTF-8 sequence and, before it, anything that could still become a
        # stop string.
        end = len(rest)
        while end > 0 and rest[end - 1] == "\ufffd":
            end -= 1
        end -= max((len(s) - 1 for s in self.stop), default=0)
        return self._release(rest[:end]) if end > 0 else ""

    def flush(self) -> str:
        """Release held-back text at the end of a request that did not stop on a stop string."""
        if self.tokenizer is None or self.stopped:
            return ""
        return self._release(self._pending + self._tentative[self._ahead:])

    def _decode(self, ids: list[int]) -> str:
        return str(self.tokenizer.decode(ids, skip_special_tokens=True))  # type: ignore[union-attr]

    def _advance(self) -> None:
        """Decode the window and take in what the newest tokens add."""
        window = self._decode(self._ids[self._prefix:])
        if self._prefix and not window.startswith(self._prefix_text):  # decode the whole output instead
            self._prefix, self._prefix_text = 0, self._decode(self._ids[: self._read])
            window = self._decode(self._ids)
        new = window[len(self._prefix_text):]
        if new and not new.endswith("\ufffd"):  # complete: the window moves on
            if self._ahead:  # its first characters were released while tentative
                self._pending, self._ahead = new[self._ahead:], 0
            else:
                self._pending += new
            self._tentative = ""
            self._prefix, self._read = self._read, len(self._ids)
            self._prefix_text = self._decode(self._ids[self._prefix:self._read])
        else:
            self._tentative = new

    def _release(self, delta: str) -> str:
        """Release the next len(delta) characters of the decode (pending ones first)."""
        self.text += delta
        taken = min(len(delta), len(self._pending))
        self._pending = self._pending[taken:]
        self._ahead += len(delta) - taken
        return delta
