"""The --api-keys file: one `TENANT KEY` pair per line; blank lines and lines starting with `#` are
ignored. Comments are whole lines only, so a key may contain `#` (an inline comment is an error,
never a silently shortened key).

Every problem is a ValueError naming the file and line (the CLI prints it as one line, exit 2),
and no message ever contains a key.
"""

from __future__ import annotations

from pathlib import Path

from kvtier.serve.tenants import check_tenant_name


def parse_api_keys(text: str, source: str = "<api keys>") -> dict[str, str]:
    """`text` -> {key: tenant}. One key per tenant, each key used once."""
    keys: dict[str, str] = {}
    lines_of: dict[str, int] = {}  # tenant -> line, for the duplicate message
    for n, raw in enumerate(text.splitlines(), start=1):
        line = raw.strip()
        if not line or line.startswith("#"):
            continue
        where = f"{source}:{n}"
        parts = line.split()
        if len(parts) != 2:
            raise ValueError(f"{where}: expected 'TENANT KEY' (two fields separated by whitespace), "
                             f"got {len(parts)} field{'s' if len(parts) != 1 else ''}")
        tenant, key = parts
        try:
            check_tenant_name(tenant)
        except ValueError as e:
            raise ValueError(f"{where}: {e}") from None
        # A key must travel in an HTTP header: printable ASCII (no whitespace, split() saw to that).
        if not (key.isascii() and key.isprintable()):
            raise ValueError(f"{where}: the key of tenant {tenant!r} must be printable ASCII")
        if key in keys:
            raise ValueError(f"{where}: this key is already the key of tenant {keys[key]!r}; keys must be unique")
        if tenant in lines_of:
            raise ValueError(f"{where}: tenant {tenant!r} already has a key (line {lines_of[tenant]})")
        keys[key] = tenant
        lines_of[tenant] = n
    if not keys:
        raise ValueError(f"{source}: no 'TENANT KEY' lines; an empty keys file would leave the server open")
    return keys


def load_api_keys(path: str | Path) -> dict[str, str]:
    """Read and parse an --api-keys file; a missing or unreadable file is a ValueError too."""
    try:
        text = Path(path).read_text(encoding="utf-8")
    except OSError as e:
        raise ValueError(f"cannot read the API keys file {path}: {e.strerror or e}") from None
    except UnicodeDecodeError:
        raise ValueError(f"the API keys file {path} is not UTF-8 text") from None
    return parse_api_keys(text, str(path))
