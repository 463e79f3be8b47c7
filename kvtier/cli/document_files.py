"""Documents read from files, for `kvtier precompile` and `--blend-corpus`: a text file is one
document (its final line break not part of it); a `.jsonl` file holds one per line (a JSON string,
or an object with a "text" field)."""

from __future__ import annotations

import json
from pathlib import Path

MAX_DOCUMENT_BYTES = 16 << 20  # a document is read whole: a larger file is refused, not loaded


def read_documents(paths: list[str]) -> list[str]:
    """The documents in `paths` (see the module docstring); a ValueError names a bad file or line."""
    docs: list[str] = []
    for name in paths:
        path = Path(name)
        if path.stat().st_size > MAX_DOCUMENT_BYTES and path.suffix != ".jsonl":
            raise ValueError(f"{name}: larger than {MAX_DOCUMENT_BYTES >> 20} MiB; split it into documents")
        try:
            if path.suffix != ".jsonl":
                # A text file's last line break ends the file, not the document (as it appears in prompts).
                docs.append(path.read_text(encoding="utf-8").removesuffix("\n"))
                continue
            with path.open(encoding="utf-8") as f:
                for n, line in enumerate(f, 1):
                    if not line.strip():
                        continue
                    try:
                        item = json.loads(line)
                    except ValueError as e:
                        raise ValueError(f"{name}:{n}: not JSON ({e})") from None
                    text = item.get("text") if isinstance(item, dict) else item
                    if not isinstance(text, str) or not text:
                        raise ValueError(f"{name}:{n}: a JSON string or an object with a non-empty \"text\" field")
                    docs.append(text)
        except UnicodeDecodeError as e:
            raise ValueError(f"{name}: not UTF-8 text ({e})") from None
    return [d for d in docs if d.strip()]
