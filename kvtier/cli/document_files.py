"""Documents read from files, for `kvtier precompile` and `--blend-corpus`: a text file is one
document (its final line break not part of it); a `.jsonl` file holds one per line (a JSON string,
or an object with a "text" field). Only regular files are read (a device, a FIFO or a directory is
refused, never read without end), and at most MAX_DOCUMENT_BYTES a document or a line."""

from __future__ import annotations

import io
import itertools
import json
import os
import stat
from pathlib import Path
from typing import BinaryIO

MAX_DOCUMENT_BYTES = 16 << 20  # a document is read whole: a larger file (or .jsonl line) is refused, not loaded


def read_documents(paths: list[str]) -> list[str]:
    """The documents in `paths` (see the module docstring); a ValueError names a bad file or line."""
    docs: list[str] = []
    for name in paths:
        with _open_regular(name) as raw:
            try:
                if Path(name).suffix != ".jsonl":
                    data = raw.read(MAX_DOCUMENT_BYTES + 1)
                    if len(data) > MAX_DOCUMENT_BYTES:
                        raise ValueError(f"{name}: larger than {MAX_DOCUMENT_BYTES >> 20} MiB; split it into documents")
                    # Line breaks read as Python reads text ("\r\n" and "\r" are "\n"); a text file's last
                    # one ends the file, not the document (as it appears in prompts).
                    docs.append(_lines(data.decode("utf-8")).removesuffix("\n"))
                    continue
                docs += _jsonl(name, io.TextIOWrapper(raw, encoding="utf-8", newline=None))
            except UnicodeDecodeError as e:
                raise ValueError(f"{name}: not UTF-8 text ({e})") from None
    return [d for d in docs if d.strip()]


def _lines(text: str) -> str:
    return text.replace("\r\n", "\n").replace("\r", "\n")


def _open_regular(name: str) -> BinaryIO:
    """`name` opened for reading if it is a regular file (after links); else an OSError naming it.
    Checked before it is opened (opening a device may act on it), and again once opened, without
    blocking (a FIFO put in its place would wait for a writer)."""
    if not stat.S_ISREG(os.stat(name).st_mode):
        raise OSError(f"{name}: not a regular file")
    fd = os.open(name, os.O_RDONLY | os.O_NONBLOCK)
    try:
        if not stat.S_ISREG(os.fstat(fd).st_mode):
            raise OSError(f"{name}: not a regular file")
        os.set_blocking(fd, True)
        return io.open(fd, "rb", closefd=True)
    except BaseException:
        os.close(fd)
        raise


def _jsonl(name: str, lines: io.TextIOWrapper) -> list[str]:
    """A .jsonl file's documents (lines as Python reads text: "\r\n" and "\r" end one too)."""
    docs: list[str] = []
    for n in itertools.count(1):
        line = lines.readline(MAX_DOCUMENT_BYTES + 1)  # characters: at most 4 bytes each
        if not line:
            return docs
        if len(line) > MAX_DOCUMENT_BYTES:
            raise ValueError(f"{name}:{n}: a line longer than {MAX_DOCUMENT_BYTES >> 20} Mi characters")
        if not line.strip():
            continue
        try:
            item = json.loads(line)
        except (ValueError, RecursionError) as e:
            raise ValueError(f"{name}:{n}: not JSON ({type(e).__name__}: {str(e)[:100]})") from None
        text = item.get("text") if isinstance(item, dict) else item
        if not isinstance(text, str) or not text:
            raise ValueError(f"{name}:{n}: a JSON string or an object with a non-empty \"text\" field")
        docs.append(text)
    raise AssertionError("unreachable")
