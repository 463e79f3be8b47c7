"""The incremental detokenizer (kvtier/engine/detokenizer.py): every step releases the same text as
decoding the whole output each time would (the reference below: the detokenizer's earlier form,
with its hold for stop strings now taken before an unfinished character rather than counting it),
with multi-byte characters split over tokens and stop strings across token boundaries; on a toy
byte-level tokenizer and on the real smollm2 one."""

from __future__ import annotations

import random
from dataclasses import dataclass, field
from typing import Any

import pytest

from kvtier.engine.detokenizer import Detokenizer


@dataclass
class _Reference:
    """Decode the whole output on every token (quadratic, but plainly right)."""

    tokenizer: Any
    stop: tuple[str, ...]
    text: str = ""
    stopped: bool = False
    ids: list[int] = field(default_factory=list)

    def add(self, token_id: int) -> str:
        self.ids.append(token_id)
        full = self.tokenizer.decode(self.ids, skip_special_tokens=True)
        for s in self.stop:
            idx = full.find(s, max(0, len(self.text) - len(s)))
            if idx != -1:
                self.stopped = True
                return self._release(full[:idx])
        end = len(full)
        while end > len(self.text) and full[end - 1] == "\ufffd":
            end -= 1
        end -= max((len(s) - 1 for s in self.stop), default=0)
        return self._release(full[:end]) if end > len(self.text) else ""

    def flush(self) -> str:
        return "" if self.stopped else self._release(self.tokenizer.decode(self.ids, skip_special_tokens=True))

    def _release(self, upto: str) -> str:
        delta = upto[len(self.text):]
        self.text = upto
        return delta


class _Bytes:
    """A toy byte-level tokenizer: token i is a few bytes; ids >= SPECIAL are special tokens."""

    SPECIAL = 1000

    def __init__(self, pieces: list[bytes]):
        self.pieces = pieces

    def decode(self, ids: list[int], skip_special_tokens: bool = False) -> str:
        out = b"".join(self.pieces[i] for i in ids if i < self.SPECIAL)
        return out.decode("utf-8", errors="replace")


def _stream(tok: Any, ids: list[int], stop: tuple[str, ...] = ()) -> tuple[Detokenizer, list[str]]:
    """Feed ids one by one as the engine does (stop early on a stop string, flush otherwise);
    check every step against the reference and return the deltas."""
    d, ref = Detokenizer(tok, stop), _Reference(tok, stop)
    deltas = []
    for i in ids:
        got, want = d.add(i), ref.add(i)
        assert got == want and d.text == ref.text and d.stopped == ref.stopped
        deltas.append(got)
        if d.stopped:
            break
    else:
        got, want = d.flush(), ref.flush()
        assert got == want and d.text == ref.text
        deltas.append(got)
    assert "".join(deltas) == d.text
    return d, deltas


def _tokens(tok: _Bytes, text: str, rng: random.Random) -> list[int]:
    """Split text's bytes at random points into new toy tokens (splitting characters too)."""
    data, ids, at = text.encode(), [], 0
    while at < len(data):
        n = rng.randint(1, 4)
        tok.pieces.append(data[at:at + n])
        ids.append(len(tok.pieces) - 1)
        at += n
        if rng.random() < 0.1:
            ids.append(_Bytes.SPECIAL)
    return ids


TEXTS = ["plain ascii text, nothing more", "emoji 😀👍🏽 and 🇫🇷 flags", "中文字符 mixed with ASCII 和日本語のテキスト",
         "é è ê — ü ñ ß", "stop here: STOP then more"]


def test_toy_tokenizer_matches_the_whole_decode_at_every_step():
    rng = random.Random(0)
    for _ in range(30):
        for text in TEXTS:
            tok = _Bytes([])
            ids = _tokens(tok, text, rng)
            d, _ = _stream(tok, ids)
            assert d.text == text
            for stop in (("STOP",), ("😀👍",), ("字符 m", "never"), ("ü ñ", "e")):
                d, _ = _stream(tok, ids, stop)
                cut = min((text.find(s) for s in stop if s in text), default=-1)
                assert d.stopped == (cut != -1)
                if d.stopped:
                    assert stop[0] not in d.text and text.startswith(d.text)


def test_toy_tokenizer_invalid_and_unfinished_bytes():
    tok = _Bytes([b"a", b"\xe4", b"\xb8", b"\xad", b"\x80", b"b", b"\xf0\x9f"])
    for ids in ([0, 1, 2, 3, 5], [1, 0, 5], [4, 5, 4], [0, 6], [6, 6, 0], [0, 1, 2]):
        d, _ = _stream(tok, ids)
        assert d.text == tok.decode(ids)
        d, _ = _stream(tok, ids, ("b",))


def test_no_tokenizer_releases_nothing():
    d = Detokenizer(None, ("x",))
    assert d.add(5) == "" and d.flush() == "" and d.text == "" and not d.stopped


@pytest.mark.slow
def test_smollm2_streams_the_whole_decode(smollm2_fp32):
    tok = smollm2_fp32.tokenizer
    for text in TEXTS + ["Hello, world! " * 20, "🙂" * 7 + "漢字" * 5 + " naïve café"]:
        ids = tok.encode(text, add_special_tokens=False)
        d, _ = _stream(tok, ids)
        assert d.text == tok.decode(ids, skip_special_tokens=True)


@pytest.mark.slow
def test_smollm2_random_ids_and_special_tokens(smollm2_fp32):
    """Random ids split characters over tokens and produce invalid bytes; special ids are skipped."""
    tok = smollm2_fp32.tokenizer
    rng = random.Random(1)
    special = list(tok.all_special_ids)
    for _ in range(20):
        ids = [rng.choice(special) if rng.random() < 0.05 else rng.randrange(len(tok)) for _ in range(60)]
        d, _ = _stream(tok, ids)
        assert d.text == tok.decode(ids, skip_special_tokens=True)


@pytest.mark.slow
def test_smollm2_stop_strings_across_tokens(smollm2_fp32):
    tok = smollm2_fp32.tokenizer
    text = "The capital of France is Paris. 東京は日本の首都です。 Done 🎉🎉 here."
    ids = tok.encode(text, add_special_tokens=False)
    for stop in ("Paris. 東", "首都で", "🎉 h", "is Par", "ce is"):
        d, _ = _stream(tok, ids, (stop, "unused stop"))
        assert d.stopped and d.text == text[: text.find(stop)]
    # the stop strings do span tokens: no single token's text holds one whole
    assert all(stop not in tok.decode([i]) for i in ids for stop in ("Paris. 東", "🎉 h", "is Par"))
