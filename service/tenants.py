"""Tenants: who a request belongs to, by the API key it came with.

A tenant is the name of an API key. SDPA_API_KEYS entries (and SDPA_API_KEYS_FILE lines) are
`key` or `name=key`, name [A-Za-z0-9_.-]{1,32}; a bare key is named by the first 8 hex digits of
its sha256, so the name never reveals the key. Several keys may share a name (a team rotating
its key keeps its share). Without keys, every request belongs to the tenant "anonymous". The
names are the only values of the metrics' `tenant` label, so its cardinality is what the
operator configured, whatever clients send.

This module owns the naming rules and the parsing of SDPA_TENANT_WEIGHTS; the queue
(service.runtime.queue) serves tenants by their weights.
"""

from __future__ import annotations

import hashlib
import hmac
import re
from collections.abc import Iterable, Mapping, Sequence
from typing import Final

from service.errors import Unauthorized

ANONYMOUS: Final = "anonymous"
# A weight's bounds: a million to one at most between two tenants, so that no share underflows.
MIN_WEIGHT: Final = 1e-3
MAX_WEIGHT: Final = 1e3
TENANT_NAME: Final = re.compile(r"[A-Za-z0-9_.-]{1,32}")
_NAMED_KEY: Final = re.compile(r"([A-Za-z0-9_.-]{1,32})=(.+)", re.DOTALL)


def bare_key_name(key: str) -> str:
    """The name of a key configured without one: the first 8 hex digits of its sha256."""
    return hashlib.sha256(key.encode("utf-8")).hexdigest()[:8]


def split_key_entry(entry: str) -> tuple[str, str]:
    """`name=key` -> (name, key); a bare `key` -> (its hashed name, key). An entry whose part
    before the first '=' is not a valid name, or whose part after it starts with '=' (base64
    padding: `dGVzdA==`), is a bare key. So a bare key that holds '=' after a name-like
    start must be given a name (`team=abc=def`). Raises ValueError for a key part that begins or
    ends with a space (it could never match what a client sends) and for the reserved name
    "anonymous" (the tenant of requests without a key)."""
    match = _NAMED_KEY.fullmatch(entry)
    if match is None or match.group(2).startswith("="):
        return bare_key_name(entry), entry
    name, key = match.group(1), match.group(2)
    if key != key.strip():
        raise ValueError(f"the key of tenant {name!r} begins or ends with a space")
    if name == ANONYMOUS:
        raise ValueError(f"{ANONYMOUS!r} names the requests without a key: pick another name")
    return name, key


def tenants_by_key(entries: Iterable[str], *, source: str) -> dict[str, str]:
    """key -> tenant name for every configured entry. One key under two names fails: which
    tenant would its requests belong to? (The message names the key by position only.)"""
    names: dict[str, str] = {}
    for number, entry in enumerate(entries, start=1):
        try:
            name, key = split_key_entry(entry)
        except ValueError as exc:
            raise ValueError(f"{source}: entry #{number}: {exc}") from None
        if names.setdefault(key, name) != name:
            raise ValueError(
                f"{source}: key #{number} is configured for tenants {names[key]!r} and {name!r}"
            )
    return names


def parse_weights(text: str) -> dict[str, float]:
    """SDPA_TENANT_WEIGHTS, "name=w,..." (w a positive finite number) -> {name: w}."""
    weights: dict[str, float] = {}
    for part in (p.strip() for p in text.split(",")):
        if not part:
            continue
        name, sep, value = part.partition("=")
        name = name.strip()
        if not sep or not TENANT_NAME.fullmatch(name):
            raise ValueError(f"{part!r}: each entry is name=weight, name of [A-Za-z0-9_.-]{{1,32}}")
        try:
            weight = float(value)
        except ValueError:
            raise ValueError(f"{part!r}: the weight must be a number") from None
        if not (MIN_WEIGHT <= weight <= MAX_WEIGHT):
            raise ValueError(
                f"{part!r}: the weight must be within [{MIN_WEIGHT:g}, {MAX_WEIGHT:g}]"
            )
        if name in weights:
            raise ValueError(f"{name!r} is given a weight twice")
        weights[name] = weight
    return weights


def check_weights(weights: Mapping[str, float], names: Iterable[str]) -> None:
    """Every weighted tenant must be one that can exist: a configured name, or "anonymous"
    without keys (a typo would otherwise weigh nobody, silently)."""
    known = set(names)
    unknown = sorted(set(weights) - known)
    if unknown:
        raise ValueError(
            f"SDPA_TENANT_WEIGHTS names {', '.join(map(repr, unknown))}, not a configured "
            f"tenant (the tenants are: {', '.join(map(repr, sorted(known)))})"
        )


# ---- whose key is it -----------------------------------------------------------------------
# Every door (the HTTP middleware service.middleware.auth, the gRPC door service.api.grpc) reads
# a caller's key the same way: `Authorization: Bearer <key>` or `x-api-key: <key>`, exactly one.


def _digest(secret: str) -> bytes:
    return hashlib.sha256(secret.encode("utf-8")).digest()


def presented_keys(headers: Iterable[tuple[str, str]]) -> list[str]:
    """The non-empty keys a request carries (Bearer token and/or x-api-key), from its headers or
    gRPC metadata as (name, value) pairs."""
    keys: list[str] = []
    for raw_name, raw_value in headers:
        name = raw_name.lower()
        if name == "authorization":
            scheme, _, token = raw_value.strip().partition(" ")
            if scheme.lower() == "bearer" and token.strip():
                keys.append(token.strip())
        elif name == "x-api-key":
            value = raw_value.strip()
            if value:
                keys.append(value)
    return keys


class Keyring:
    """The configured keys and their tenants, compared in constant time.

    Comparison is constant time in the key's content and length: both sides are hashed to a
    fixed 32-byte SHA-256 digest and compared with hmac.compare_digest against every configured
    key, accumulating the result without an early exit, so neither timing nor the order of keys
    reveals which key (or which prefix of a key) matched.
    """

    def __init__(self, keys: Mapping[str, str]) -> None:
        if not keys:
            # An empty key set would lock everyone out: a door without keys checks none.
            raise ValueError("a Keyring needs at least one key")
        self._key_digests: tuple[tuple[bytes, str], ...] = tuple(
            (_digest(key), keys[key]) for key in sorted(keys)
        )

    def tenant_of(self, presented: Sequence[str]) -> str | None:
        """The tenant of the one key presented, None when it matches none (or when not exactly
        one key was presented: one request is one guess)."""
        if len(presented) != 1:
            return None
        candidate_digest = _digest(presented[0])
        tenant = None
        for key_digest, name in self._key_digests:
            # Every comparison runs, whatever matched before; the names are no secret.
            if hmac.compare_digest(candidate_digest, key_digest):
                tenant = name
        return tenant


def refusal(presented: Sequence[str]) -> Unauthorized:
    """Why a request with these keys is refused (no key, several, or an unknown one)."""
    if len(presented) > 1:
        detail = f"{len(presented)} API keys presented, none tried: send exactly one"
    else:
        detail = "invalid API key" if presented else "missing API key"
    return Unauthorized(f"{detail}, as 'Authorization: Bearer <key>' or 'X-API-Key: <key>'")
