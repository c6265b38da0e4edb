"""service.grpc_limits' server options against the grpc-core this venv runs: every channel
argument it sets is one grpc-core knows (a misspelt one is ignored by grpc without a word), and
each takes its value from the settings it names."""

from __future__ import annotations

from pathlib import Path

import grpc
import pytest

from service.grpc_limits import (
    CONNECTION_AGE_S,
    IDLE_CONNECTION_S,
    ReadSlots,
    max_concurrent_rpcs,
    server_options,
)
from tests.support.app import small_settings

MiB = 1 << 20


def _core_library() -> bytes:
    (library,) = (Path(grpc.__file__).parent / "_cython").glob("cygrpc*.so")
    return library.read_bytes()


def test_every_option_is_a_channel_argument_grpc_core_knows() -> None:
    library = _core_library()
    for name, _ in server_options(small_settings()):
        assert name.encode() + b"\x00" in library, name


def test_the_options_take_the_settings_values() -> None:
    settings = small_settings(
        max_body_bytes=8 * MiB, max_connections=77, grpc_max_streams=9, read_timeout_s=2.5,
        send_timeout_s=4.0, max_header_bytes=4096,
    )  # fmt: skip
    options = dict(server_options(settings))
    assert options["grpc.max_receive_message_length"] == 8 * MiB
    assert options["grpc.max_allowed_incoming_connections"] == 77
    assert options["grpc.max_concurrent_streams"] == 9
    assert options["grpc.server_handshake_timeout_ms"] == 2500
    assert options["grpc.max_connection_age_grace_ms"] == 4000
    assert options["grpc.max_metadata_size"] == 4096
    assert options["grpc.max_connection_idle_ms"] == IDLE_CONNECTION_S * 1000
    assert options["grpc.max_connection_age_ms"] == CONNECTION_AGE_S * 1000
    assert options["grpc.so_reuseport"] == 0
    assert max_concurrent_rpcs(settings) == 77


@pytest.mark.parametrize(
    ("inflight", "body", "slots"),
    [
        (256 * MiB, 128 * MiB, 1),
        (64 * MiB, 32 * MiB, 1),
        (1024 * MiB, 128 * MiB, 4),
        (MiB, 8 * MiB, 1),
    ],
)
def test_read_slots_hold_each_message_twice_within_the_inflight_bytes(
    inflight: int, body: int, slots: int
) -> None:
    assert ReadSlots(max_inflight_bytes=inflight, max_body_bytes=body).slots == slots
