"""Content-Encoding as RFC 9110 and RFC 1952 read it, in process: several codings (in one header
or several) are undone in reverse order of application, at most MAX_CODINGS of them; a gzip
body may hold several members; every layer hands on at most CHUNK_BYTES per step, so a bomb
through two layers is refused by the body limit without the inflated body ever being held.

The truth: the same request sent uncompressed, and bodies compressed here with gzip and zlib.
"""

from __future__ import annotations

import gzip
import zlib
from collections.abc import Sequence

import httpx
import pytest

from service.errors import InvalidRequest
from service.middleware.body_limit import BodyTooLarge
from service.middleware.content_encoding import (
    CHUNK_BYTES,
    MAX_CODINGS,
)
from tests.support.inflation import MAX_BODY, V1_BODY, V2_BODY, drive

JSON = ("content-type", "application/json")
V2_URL = "/v2/models/attention/infer"


def post(
    client: httpx.Client, body: bytes, codings: Sequence[str], *, url: str = "/v1/attention"
) -> httpx.Response:
    """POST `body` with one Content-Encoding header per entry of `codings`."""
    headers = [JSON, *(("content-encoding", coding) for coding in codings)]
    return client.post(url, content=body, headers=headers)


@pytest.fixture(scope="module")
def plain(client: httpx.Client) -> dict[str, object]:
    """The uncompressed answers: v1's output and v2's outputs."""
    v1 = client.post("/v1/attention", content=V1_BODY, headers=[JSON])
    v2 = client.post(V2_URL, content=V2_BODY)
    assert v1.status_code == v2.status_code == 200
    return {"v1": v1.json()["output"], "v2": v2.json()["outputs"]}


def test_gzip_members_are_inflated_one_after_the_other(
    client: httpx.Client, plain: dict[str, object]
) -> None:
    """RFC 1952 §2.2: `cat a.gz b.gz` is one gzip body of a's bytes then b's."""
    half = len(V1_BODY) // 2
    members = gzip.compress(V1_BODY[:half]) + gzip.compress(V1_BODY[half:])
    packed = post(client, members, ["gzip"])
    assert packed.status_code == 200, packed.text
    assert packed.json()["output"] == plain["v1"]
    # An empty member between them inflates to nothing.
    three = gzip.compress(V1_BODY[:half]) + gzip.compress(b"") + gzip.compress(V1_BODY[half:])
    assert post(client, three, ["x-gzip"]).json()["output"] == plain["v1"]
    v2_members = gzip.compress(V2_BODY[:10]) + gzip.compress(V2_BODY[10:])
    answered = post(client, v2_members, ["gzip"], url=V2_URL)
    assert answered.status_code == 200, answered.text
    assert answered.json()["outputs"] == plain["v2"]


def test_bytes_after_a_member_must_be_another_member(client: httpx.Client) -> None:
    after_gzip = post(client, gzip.compress(V1_BODY) + b"garbage", ["gzip"])
    assert after_gzip.status_code == 422
    assert after_gzip.json()["errors"][0]["loc"] == ["header", "content-encoding"]
    # zlib ("deflate") has no members: bytes after its stream are refused as such.
    after_zlib = post(client, zlib.compress(V1_BODY) + zlib.compress(b""), ["deflate"])
    assert after_zlib.status_code == 422
    assert "bytes follow the end" in after_zlib.json()["detail"]


@pytest.mark.parametrize(
    "codings",
    [
        ["deflate, gzip"],
        ["deflate", "gzip"],
        ["deflate,gzip", "identity"],
        ["identity, deflate,, gzip"],
    ],
    ids=["one header", "two headers", "with identity", "with empty elements"],
)
def test_several_codings_are_undone_in_reverse_order(
    client: httpx.Client, plain: dict[str, object], codings: list[str]
) -> None:
    """Deflate applied first, then gzip: gzip is undone first. Two Content-Encoding headers
    are one list (RFC 9110 §5.3), the first header's codings applied first."""
    body = gzip.compress(zlib.compress(V1_BODY))
    packed = post(client, body, codings)
    assert packed.status_code == 200, packed.text
    assert packed.json()["output"] == plain["v1"]


def test_codings_in_the_wrong_order_are_refused(client: httpx.Client) -> None:
    """Each layer takes its own format only: gzip data labelled deflate is not valid deflate."""
    body = gzip.compress(zlib.compress(V1_BODY))
    for codings in (["gzip, deflate"], ["gzip", "deflate"], ["deflate"]):
        wrong = post(client, body, codings)
        assert wrong.status_code == 422, codings
        assert "not valid deflate data" in wrong.json()["detail"]


def test_more_codings_than_the_bound_are_a_415_naming_the_header(client: httpx.Client) -> None:
    assert MAX_CODINGS == 2
    body = gzip.compress(gzip.compress(gzip.compress(V1_BODY)))
    for codings in (["gzip, gzip, gzip"], ["gzip", "gzip, gzip"]):
        refused = post(client, body, codings)
        assert refused.status_code == 415
        error = refused.json()["errors"][0]
        assert error["loc"] == ["header", "content-encoding"]
        assert "at most 2" in error["msg"]
        assert "3 codings" in error["msg"]
    v2 = post(client, body, ["gzip, gzip, gzip"], url=V2_URL)
    assert v2.status_code == 400
    assert "at most 2" in v2.json()["error"]


def test_an_unknown_coding_anywhere_in_the_list_is_a_415(client: httpx.Client) -> None:
    for codings in (["gzip, br"], ["br", "gzip"]):
        refused = post(client, gzip.compress(V1_BODY), codings)
        assert refused.status_code == 415
        assert "'br'" in refused.json()["detail"]
    v2 = post(client, V2_BODY, ["zstd"], url=V2_URL)
    assert v2.status_code == 400
    assert "zstd" in v2.json()["error"]


def test_a_bomb_through_two_layers_is_a_413(client: httpx.Client) -> None:
    """32 MiB of spaces, gzip inside gzip, is about 400 bytes: past the 1 MiB body limit."""
    bomb = gzip.compress(gzip.compress(b" " * (32 * MAX_BODY)))
    refused = post(client, bomb, ["gzip", "gzip"])
    assert refused.status_code == 413
    assert "SDPA_MAX_BODY_BYTES" in refused.json()["detail"]
    assert client.get("/healthz").status_code == 200


def test_each_layer_inflates_at_most_a_chunk_per_step() -> None:
    """64 MiB of zeros through two gzip layers: the app sees at most CHUNK_BYTES a message, and
    once it stops reading after two chunks, at most three chunks were inflated (no layer ran
    ahead of it). Read to its end, the body is exactly the original."""
    raw = b"\0" * (256 * CHUNK_BYTES)
    bomb = gzip.compress(gzip.compress(raw))
    _, seen = drive(bomb, b"gzip, gzip", stop_after=2 * CHUNK_BYTES)
    assert max(seen) <= CHUNK_BYTES
    assert sum(seen) <= 3 * CHUNK_BYTES
    consumed, all_seen = drive(bomb, b"gzip, gzip", stop_after=len(raw))
    assert max(all_seen) <= CHUNK_BYTES
    assert sum(all_seen) == len(raw)
    assert consumed == len(bomb)


def test_what_a_layer_reads_is_bounded_too() -> None:
    """Empty gzip members (20 bytes each) inflate to nothing: 40 of them (800 bytes) are read
    whole under a 1,000-byte bound, 100 (2,000 bytes) are a 413 once 1,000 are passed, though
    the body limit inside never sees a byte."""
    empty = gzip.compress(b"")
    assert len(empty) == 20
    consumed, seen = drive(empty * 40, b"gzip", stop_after=1, max_body_bytes=1000)
    assert consumed == 800
    assert sum(seen) == 0
    with pytest.raises(BodyTooLarge, match="SDPA_MAX_BODY_BYTES"):
        drive(empty * 100, b"gzip", stop_after=1, max_body_bytes=1000)


def test_a_member_cut_short_is_an_error() -> None:
    body = gzip.compress(b"x" * 10_000) + gzip.compress(b"y" * 10_000)[:-8]
    with pytest.raises(InvalidRequest, match="ends early"):
        drive(body, b"gzip", stop_after=1 << 30)


def test_the_app_bounds_what_a_layer_reads(client: httpx.Client) -> None:
    """Through create_app: empty gzip members past SDPA_MAX_BODY_BYTES on the wire are a 413,
    though they inflate to nothing (without the bound they were read for as long as they came).
    """
    empty = gzip.compress(b"")
    stream = empty * (MAX_BODY // len(empty) + 2)
    response = post(client, stream, ["gzip"])
    assert response.status_code == 413, response.text
    assert "SDPA_MAX_BODY_BYTES" in response.json()["detail"]
