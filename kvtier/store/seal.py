"""Authenticated chunks: what a store secret adds to the byte format.

Without a secret every segment carries a CRC-32C: it catches torn writes and bit rot, not a writer
who means harm (CRC-32C is linear: anyone can make bytes with a chosen checksum), so an unsigned
store trusts everyone who can write to it. With a secret shared by the servers, a chunk is sealed:

- every segment (and every granule of the importance layout) carries a BLAKE3-128 digest instead,
  which no one can match with other bytes (BLAKE3: a cryptographic hash several times faster than
  BLAKE2b and SHA-256, with the GIL released; `kvtier bench store --sealed` measures what sealing costs);
- the header, which holds those digests and the chunk's key, parent, span and layout, carries an
  HMAC-SHA256 tag under the secret.

A reader with the secret accepts a chunk only if the tag verifies, then checks each segment it
reads against its digest: whoever lacks the secret cannot make a chunk any server will serve, nor
move one under another key (the key is inside what the tag covers). Servers with different secrets
(or none) use different key chains (`key_id` goes into the chain's root), so they never fight
over the same entries.
"""
from __future__ import annotations

import hashlib
import hmac
import os
from dataclasses import dataclass, field

import crc32c
from blake3 import blake3

CRC32C = "crc32c"
BLAKE3 = "blake3-128"
DIGESTS = (CRC32C, BLAKE3)
TAG_BYTES = 32  # HMAC-SHA256
ENV_SECRET = "KVTIER_STORE_SECRET"
MIN_SECRET_BYTES = 16


def digest(alg: str, data) -> int:
    """A segment's digest under `alg`; `data` is any buffer. Both release the GIL on large buffers."""
    if alg == CRC32C:
        return crc32c.crc32c(data, gil_release_mode=1)
    return int.from_bytes(blake3(data).digest(16), "little")


@dataclass(frozen=True)
class Seal:
    """The store secret (None: chunks are checksummed, not sealed)."""

    secret: bytes | None = field(default=None, repr=False)

    def __post_init__(self) -> None:
        if self.secret is not None and len(self.secret) < MIN_SECRET_BYTES:
            raise ValueError(f"the store secret must be at least {MIN_SECRET_BYTES} bytes "
                             "(e.g. `openssl rand -hex 32`)")

    @property
    def sealed(self) -> bool:
        return self.secret is not None

    @property
    def digest_alg(self) -> str:
        """What a writer digests segments with."""
        return BLAKE3 if self.sealed else CRC32C

    def tag(self, header: bytes) -> bytes:
        """HMAC-SHA256 of the header bytes (zeros when unsealed)."""
        if self.secret is None:
            return bytes(TAG_BYTES)
        return hmac.new(self.secret, header, hashlib.sha256).digest()

    def verify(self, header: bytes, tag: bytes) -> bool:
        """True if a sealed reader may trust this header (always, when this store has no secret)."""
        return self.secret is None or hmac.compare_digest(self.tag(header), tag)

    def key_id(self) -> str:
        """A public id of the secret for the key chain's root ("" when unsealed): it names which
        secret sealed a chain without revealing anything about the secret."""
        if self.secret is None:
            return ""
        return hmac.new(self.secret, b"kvtier store key id", hashlib.sha256).hexdigest()[:16]


def load_secret(value: str | None = None, path: str | None = None) -> Seal:
    """The store secret from a value, a file or $KVTIER_STORE_SECRET, in that order; none of them: an
    unsealed store. Surrounding whitespace is stripped from every source alike (a secret file's
    newline, an environment variable's trailing newline), so every server derives the same key."""
    if value and path:
        raise ValueError("give the store secret as a value or as a file, not both")
    if path:
        try:
            with open(path, "rb") as fh:
                raw = fh.read().strip()
        except OSError as e:
            raise ValueError(f"cannot read the store secret file {path}: {e.strerror or e}") from e
        if not raw:
            raise ValueError(f"the store secret file {path} is empty")
        return Seal(raw)
    value = (value or os.environ.get(ENV_SECRET) or "").strip()
    return Seal(value.encode()) if value else Seal()
