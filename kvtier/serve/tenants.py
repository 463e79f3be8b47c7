"""Tenants: who sent a request (decided by its API key), and which cached state it may share.

The engine shares reused state (the device prefix cache, the store's chunks) only between requests
with the same cache salt. A tenant's salt is its name, so no tenant is served, or can time, state
that another's prompts left (they do share capacity); a request's own `cache_salt` partitions
further inside its tenant. The tenant part always comes first and is fixed by the key, and the
separator cannot occur in a tenant name, so no body salt can ever equal another tenant's salt.
"""

from __future__ import annotations

import re
from typing import TYPE_CHECKING

if TYPE_CHECKING:  # the CLI imports this module (through the config) before any server code
    from starlette.requests import Request

# Every request when no keys are configured, and the tenant of a single --api-key. It uses the
# unsalted partition, the one `kvtier generate`/`chat` and earlier servers use, so a store keeps
# its contents when a server starts requiring a key.
DEFAULT_TENANT = "default"
TENANT_NAME = re.compile(r"[A-Za-z0-9_.-]{1,64}")
# ASCII unit separator: not allowed in tenant names, so "tenant SEP anything" is unambiguous.
SEP = "\x1f"


def check_tenant_name(name: str) -> None:
    if not TENANT_NAME.fullmatch(name):
        raise ValueError(f"invalid tenant name {name!r}: use 1 to 64 of A-Z a-z 0-9 _ . -")


def tenant_of(request: Request) -> str:
    """The tenant the auth middleware put in the request's scope. A missing one is a bug (the
    middleware always sets it), and fails the request rather than defaulting to a shared tenant."""
    return request.scope["state"]["tenant"]


def cache_salt(tenant: str, body_salt: str | None, *, shared: bool) -> str | None:
    """The engine's cache salt for a request: None (the unsalted partition) for the default
    tenant or with --shared-cache, else the tenant name; a body `cache_salt` is appended after SEP.

    Distinct (tenant, body salt) pairs give distinct salts: a tenant's salts are its name or start
    with "name SEP"; the shared partition's are None or start with SEP."""
    owner = "" if shared or tenant == DEFAULT_TENANT else tenant
    if body_salt is None:
        return owner or None
    return f"{owner}{SEP}{body_salt}"


def session_id(tenant: str, prompt_cache_key: str | None) -> str | None:
    """Sessions are always per tenant (also with --shared-cache): a tenant reusing another's
    prompt_cache_key must not be able to keep alive or expire the other's session state."""
    return None if prompt_cache_key is None else f"{tenant}{SEP}{prompt_cache_key}"
