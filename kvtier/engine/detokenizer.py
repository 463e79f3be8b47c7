"""Incremental detokenization with stop strings, for streaming text as tokens arrive."""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any


@dataclass
class Detokenizer:
    tokenizer: Any | None
    stop: tuple[str, ...]
    text: str = ""  # text released so far (never contains a stop string)
    _ids: list[int] = field(default_factory=list)
    stopped: bool = False

    def add(self, token_id: int) -> str:
        """Append a token; return newly released text. Sets `stopped` when a stop string appears."""
        self._ids.append(token_id)
        if self.tokenizer is None:
            return ""
        full = self.tokenizer.decode(self._ids, skip_special_tokens=True)
        for s in self.stop:
            idx = full.find(s, max(0, len(self.text) - len(s)))
            if idx != -1:
                self.stopped = True
                return self._release(full[:idx])
        # Hold back an incomplete UTF-8 sequence and anything that could still become a stop string.
        hold = max((len(s) - 1 for s in self.stop), default=0)
        end = len(full) - hold
        while end > len(self.text) and full[end - 1] == "\ufffd":
            end -= 1
        return self._release(full[:end]) if end > len(self.text) else ""

    def flush(self) -> str:
        """Release held-back text at the end of a request that did not stop on a stop string."""
        if self.tokenizer is None or self.stopped:
            return ""
        return self._release(self.tokenizer.decode(self._ids, skip_special_tokens=True))

    def _release(self, upto: str) -> str:
        delta = upto[len(self.text) :]
        self.text = upto
        return delta
