"""Compressed request bodies (Content-Encoding gzip and deflate), on both protocols, in process.

The truth: the same request sent uncompressed. The body limit counts the inflated body (1 MiB
here): a small gzip body that inflates past it is a 413, and the middleware hands the app at
most CHUNK_BYTES per message, so inflation stops soon after the limit (driven message by
message below, with the bytes counted).
"""

from __future__ import annotations

import gzip
import zlib

import httpx
import pytest

from service.errors import InvalidRequest
from service.middleware.content_encoding import CHUNK_BYTES
from tests.support.inflation import MAX_BODY, V1_BODY, V2_BODY, drive

COMPRESS = {"gzip": gzip.compress, "deflate": zlib.compress}


@pytest.mark.parametrize("encoding", ["gzip", "deflate"])
def test_v1_compressed_equals_plain(client: httpx.Client, encoding: str) -> None:
    plain = client.post(
        "/v1/attention", content=V1_BODY, headers={"Content-Type": "application/json"}
    )
    packed = client.post(
        "/v1/attention",
        content=COMPRESS[encoding](V1_BODY),
        headers={"Content-Type": "application/json", "Content-Encoding": encoding},
    )
    assert plain.status_code == packed.status_code == 200, packed.text
    assert packed.json()["output"] == plain.json()["output"]


def test_compressed_requests_are_counted_under_their_route(client: httpx.Client) -> None:
    """The access log and the metrics label a compressed request by its route, not
    "unmatched" (the router must record the route in the scope the access log reads)."""
    series = 'sdpa_requests_total{route="/v1/attention",status="200",tenant="anonymous"}'

    def count() -> float:
        for line in client.get("/metrics").text.splitlines():
            if line.startswith(series + " "):
                return float(line.split()[-1])
        return 0.0

    before = count()
    packed = client.post(
        "/v1/attention",
        content=gzip.compress(V1_BODY),
        headers={"Content-Type": "application/json", "Content-Encoding": "gzip"},
    )
    assert packed.status_code == 200
    assert count() == before + 1


@pytest.mark.parametrize("encoding", ["gzip", "deflate"])
def test_v2_compressed_equals_plain(client: httpx.Client, encoding: str) -> None:
    url = "/v2/models/attention/infer"
    plain = client.post(url, content=V2_BODY)
    packed = client.post(
        url, content=COMPRESS[encoding](V2_BODY), headers={"Content-Encoding": encoding}
    )
    assert plain.status_code == packed.status_code == 200, packed.text
    assert packed.json()["outputs"] == plain.json()["outputs"]


def test_v1_refusals_are_problems(client: httpx.Client) -> None:
    headers = {"Content-Type": "application/json"}
    bomb = gzip.compress(b" " * (32 * MAX_BODY))
    too_big = client.post(
        "/v1/attention", content=bomb, headers={**headers, "Content-Encoding": "gzip"}
    )
    assert too_big.status_code == 413
    assert too_big.headers["content-type"] == "application/problem+json"
    assert "SDPA_MAX_BODY_BYTES" in too_big.json()["detail"]
    broken = client.post(
        "/v1/attention", content=b"garbage", headers={**headers, "Content-Encoding": "deflate"}
    )
    assert broken.status_code == 422
    assert broken.json()["errors"][0]["loc"] == ["header", "content-encoding"]
    unknown = client.post(
        "/v1/attention", content=V1_BODY, headers={**headers, "Content-Encoding": "zstd"}
    )
    assert unknown.status_code == 415
    assert "zstd" in unknown.json()["detail"]
    assert client.get("/healthz").status_code == 200


def test_inflation_is_bounded_per_message() -> None:
    raw = b"\0" * (256 * CHUNK_BYTES)  # 64 MiB of zeros: about 64 KiB compressed
    body = gzip.compress(raw)
    consumed, seen = drive(
        body, b"gzip", chunk=len(body), stop_after=2 * CHUNK_BYTES, content_length=True
    )
    # One compressed message of the whole bomb, yet never more than CHUNK_BYTES per message,
    # and the app's stop ends the inflation: 3 chunks, not 64 MiB.
    assert max(seen) <= CHUNK_BYTES
    assert sum(seen) <= 3 * CHUNK_BYTES
    assert consumed == len(body)
    # The whole body, read to its end, inflates to exactly the original.
    _, all_seen = drive(body, b"gzip", chunk=4096, stop_after=len(raw), content_length=True)
    assert sum(all_seen) == len(raw)


def test_truncated_stream_is_an_error() -> None:
    body = gzip.compress(b"x" * 10_000)[:-8]
    with pytest.raises(InvalidRequest, match="ends early"):
        drive(body, b"gzip", chunk=1000, stop_after=1 << 30, content_length=True)
