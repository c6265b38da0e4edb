"""Tenants' names and settings (service.tenants, service.settings): name=key entries, bare keys
named by their sha256, weights, the queue share, and the start-up errors that name the rule
without printing a key."""

from __future__ import annotations

import hashlib
from typing import Any

import pytest

from service.settings import Settings
from service.tenants import bare_key_name, parse_weights, split_key_entry


def test_key_entries_name_their_tenants() -> None:
    assert split_key_entry("team-a=s3cret") == ("team-a", "s3cret")
    bare = "abcdEFGH1234"
    assert split_key_entry(bare) == (hashlib.sha256(bare.encode()).hexdigest()[:8], bare)
    # A part before '=' that is no name leaves a bare key holding '='.
    assert split_key_entry("x y=z") == (bare_key_name("x y=z"), "x y=z")
    assert split_key_entry("a=b=c") == ("a", "b=c")
    # Base64 padding is no name: the whole entry is one bare key (a review found
    # 'dGVzdA==' read as the tenant 'dGVzdA' with the key '=').
    assert split_key_entry("dGVzdA==") == (bare_key_name("dGVzdA=="), "dGVzdA==")


def test_settings_resolve_tenants_weights_and_the_queue_share() -> None:
    one = Settings(api_keys="solo=k1")  # type: ignore[arg-type]
    assert one.tenant_names() == {"solo"}
    assert one.queue_share() == 1.0
    assert Settings().tenant_names() == {"anonymous"}
    assert Settings().queue_share() == 1.0
    two = Settings(api_keys="a=k1,b=k2,a=k3", tenant_weights="b=3")  # type: ignore[arg-type]
    assert two.tenant_keys() == {"k1": "a", "k2": "b", "k3": "a"}
    assert two.resolved_api_keys() == {"k1", "k2", "k3"}
    assert two.queue_share() == 0.5
    assert two.tenant_weights == {"b": 3.0}
    assert parse_weights("a=1, b=2.5") == {"a": 1.0, "b": 2.5}


@pytest.mark.parametrize(
    ("env", "message"),
    [
        ({"api_keys": "a=k1,b=k1"}, "configured for tenants 'a' and 'b'"),
        ({"api_keys": "a=k1", "tenant_weights": "zz=2"}, "'zz', not a configured tenant"),
        ({"tenant_weights": "a=0"}, r"within \[0.001, 1000\]"),
        ({"tenant_weights": "a=1e200"}, r"within \[0.001, 1000\]"),
        ({"api_keys": "anonymous=k1"}, "names the requests without a key"),
        ({"api_keys": "team= k1"}, "begins or ends with a space"),
        ({"tenant_weights": "a"}, "name=weight"),
        ({"default_priority": 4}, "past SDPA_PRIORITY_LEVELS 3"),
    ],
)
def test_bad_tenant_settings_fail_start_up_with_a_clear_message(
    env: dict[str, Any], message: str
) -> None:
    with pytest.raises(ValueError, match=message) as raised:
        Settings(**env)
    assert "k1" not in str(raised.value)  # a key is never printed back
