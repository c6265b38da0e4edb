"""SDPA_MAX_INFLIGHT_BYTES through the app (ASGI, driven as uvicorn drives it): while the
requests in flight hold bodies (declared or read) and answers near the limit, a new request
gets 503 with Retry-After before any of its body is read, probes still answer, and once the
holders leave the budget is free. Bodies without Content-Length (chunked, or inflated) and the
parse estimate of JSON bodies grow their reservation as they arrive, and are refused mid-stream
once over (503 beside others, 413 or 422 alone); the parse estimate is dropped once decoded."""

from __future__ import annotations

import asyncio
import gzip
import json
from typing import Any

import pytest
import torch
from prometheus_client.parser import text_string_to_metric_families
from starlette.types import Receive, Scope, Send

from service.app import create_app
from service.middleware.access_log import AccessLogMiddleware
from service.middleware.inflight import BODY_WINDOW, InflightBytesMiddleware, parse_estimate
from service.serving.offload import INLINE_MAX_BYTES
from service.wire.lengths import BEYOND_ANY_LIMIT, parse_length
from tests.support.app import asgi_scope, in_process_client, ready_engine, small_settings
from tests.support.wire import to_wire

MiB = 1024 * 1024
LIMIT = 4096


async def call(app: Any, scope: dict[str, Any], incoming: list[dict[str, Any]]) -> list[Any]:
    sent: list[dict[str, Any]] = []
    read: list[int] = []

    async def receive() -> dict[str, Any]:
        if not incoming:
            return {"type": "http.disconnect"}
        message = incoming.pop(0)
        if message.get("wait") is not None:
            message["reached"].set()  # the chunks before were read (and counted)
            await message["wait"].wait()
            return {"type": "http.disconnect"}
        read.append(len(message.get("body", b"")))
        return message

    async def send(message: dict[str, Any]) -> None:
        sent.append(message)

    await app(scope, receive, send)
    return [sent, read]


def status(sent: list[dict[str, Any]]) -> int:
    return int(next(m for m in sent if m["type"] == "http.response.start")["status"])


def test_a_new_request_waits_for_the_bytes_in_flight_to_come_back() -> None:
    app = create_app(small_settings(max_inflight_bytes=LIMIT))

    async def scenario() -> None:
        leave, stalled = asyncio.Event(), asyncio.Event()
        # The holder: declares 4,090 bytes, sends 3,000, then stalls (and later leaves).
        holder = asyncio.create_task(
            call(
                app,
                asgi_scope("POST", "/v1/attention", content_length=4090),
                [
                    {"type": "http.request", "body": b" " * 3000, "more_body": True},
                    {"wait": leave, "reached": stalled},
                ],
            )
        )
        await stalled.wait()
        # Its declared body is held from the start, not only what arrived.
        assert _held(app) == 4090
        body = b'{"q": [[1.0]], "k": [[1.0]], "v": [[1.0]]}'
        refused, read = await call(
            app, asgi_scope("POST", "/v1/attention", content_length=len(body)),
            [{"type": "http.request", "body": body, "more_body": False}],
        )  # fmt: skip
        assert status(refused) == 503
        headers = dict(next(m for m in refused if m["type"] == "http.response.start")["headers"])
        assert headers[b"retry-after"] == b"1"
        assert b"SDPA_MAX_INFLIGHT_BYTES" in b"".join(
            m.get("body", b"") for m in refused if m["type"] == "http.response.body"
        )
        assert read == []  # refused before a byte of its body was read
        for path in ("/healthz", "/v2/health/live", "/v2/health/ready"):
            probe, _ = await call(app, asgi_scope("GET", path), [])
            # Probes are never refused for it (this app has no engine: ready says "starting").
            said = b"".join(m.get("body", b"") for m in probe if m["type"] == "http.response.body")
            assert b"SDPA_MAX_INFLIGHT_BYTES" not in said, path
            assert status(probe) == 200 or b"starting" in said, path
        leave.set()
        await holder
        assert _held(app) == 0  # the holder's bytes came back when it ended

    asyncio.run(scenario())


def computed(exposition: str) -> float:
    """How many device calls the engine has timed (sdpa_compute_seconds' counts, every path)."""
    return sum(
        sample.value
        for family in text_string_to_metric_families(exposition)
        for sample in family.samples
        if sample.name == "sdpa_compute_seconds_count"
    )


def _held(app: Any) -> int:
    """The in-flight counter of the app's InflightBytesMiddleware."""
    layer = app.middleware_stack
    while layer is not None and not isinstance(layer, InflightBytesMiddleware):
        layer = getattr(layer, "app", None)
    assert layer is not None
    return int(layer.held)


# Weights [1, 1, 128, 128] from q = k = v [1, 1, 128, 4] in base64, no diagnostics, by hand:
# the answer holds 128·4 + 128·128 = 16,896 numbers at 4·4/3 bytes plus the 4,096-byte
# envelope = 94,208 bytes; the working set adds the inputs (3·128·4·4 = 6,144), the results
# (output 2,048 + weights 65,536) and the encoder's copy (94,208): 262,144 bytes.
WORKING_SET = 262_144


def weights_request() -> dict[str, Any]:
    gen = torch.Generator().manual_seed(0)
    tensors = {name: to_wire(torch.randn(1, 1, 128, 4, generator=gen), "b64") for name in "qkv"}
    return {**tensors, "return_weights": True, "diagnostics": "none"}


def test_an_answer_that_can_never_fit_is_a_422_before_it_is_computed() -> None:
    """The request holds its body besides its working set."""
    body = json.dumps(weights_request()).encode()
    alone = WORKING_SET + len(body)
    headers = {"content-type": "application/json"}
    with in_process_client(small_settings(max_inflight_bytes=alone - 1)) as client:
        refused = client.post("/v1/attention", content=body, headers=headers)
        assert refused.status_code == 422
        error = refused.json()["errors"][0]
        assert error["type"] == "inflight_limit"
        assert "SDPA_MAX_INFLIGHT_BYTES" in error["msg"]
        assert "base64" in error["msg"]
        assert computed(client.get("/metrics").text) == 0
    with in_process_client(small_settings(max_inflight_bytes=alone)) as client:
        assert client.post("/v1/attention", content=body, headers=headers).status_code == 200


def test_an_answer_that_does_not_fit_beside_others_waits_with_a_503() -> None:
    """A stalled upload holds 50,000 bytes: the weights request's working set no longer fits
    beside it (503 before compute); once the upload leaves, it is served, and the bytes held
    come back to zero."""
    body = json.dumps(weights_request()).encode()
    settings = small_settings(max_inflight_bytes=WORKING_SET + len(body) + 40_000)
    app = create_app(settings, engine=ready_engine(settings))

    async def scenario() -> None:
        async with app.router.lifespan_context(app):  # the engine, as uvicorn starts it
            leave, stalled = asyncio.Event(), asyncio.Event()
            holder = asyncio.create_task(
                call(
                    app,
                    asgi_scope("POST", "/v1/attention", content_length=100_000),
                    [
                        {"type": "http.request", "body": b" " * 50_000, "more_body": True},
                        {"wait": leave, "reached": stalled},
                    ],
                )
            )
            await stalled.wait()
            request = [{"type": "http.request", "body": body, "more_body": False}]
            scope = asgi_scope("POST", "/v1/attention", content_length=len(body))
            refused, _ = await call(app, scope, list(request))
            assert status(refused) == 503
            metrics, _ = await call(app, asgi_scope("GET", "/metrics"), [])
            exposition = b"".join(m.get("body", b"") for m in metrics).decode()
            assert computed(exposition) == 0
            assert 'sdpa_rejected_total{reason="inflight_bytes"} 1.0' in exposition
            leave.set()
            await holder
            stays = {"wait": asyncio.Event(), "reached": asyncio.Event()}  # a client that stays
            served, _ = await call(app, scope, [*request, stays])
            assert status(served) == 200
            assert _held(app) == 0

    asyncio.run(scenario())


def test_bodies_declared_together_cannot_pass_the_limit_together() -> None:
    """Two clients send their headers at once, each declaring 3,000 bytes under a 4,096-byte
    limit: the first reserves its body before a byte arrives, the second gets 503 before any of
    its body is read. A body declared larger than the limit allows at all is a 413."""
    app = create_app(small_settings(max_inflight_bytes=LIMIT))

    async def scenario() -> None:
        leave, stalled = asyncio.Event(), asyncio.Event()
        first = asyncio.create_task(
            call(
                app,
                asgi_scope("POST", "/v1/attention", content_length=3000),
                [{"wait": leave, "reached": stalled}],  # nothing sent yet
            )
        )
        await stalled.wait()
        assert _held(app) == 3000
        second, read = await call(
            app, asgi_scope("POST", "/v1/attention", content_length=3000),
            [{"type": "http.request", "body": b" " * 3000, "more_body": False}],
        )  # fmt: skip
        assert status(second) == 503
        assert read == []
        too_big, read = await call(
            app, asgi_scope("POST", "/v1/attention", content_length=LIMIT + 1),
            [{"type": "http.request", "body": b" " * (LIMIT + 1), "more_body": False}],
        )  # fmt: skip
        assert status(too_big) == 413
        assert read == []
        leave.set()
        await first
        assert _held(app) == 0

    asyncio.run(scenario())


def test_a_declared_body_holds_what_arrived_and_a_window_ahead_of_it() -> None:
    """Under an 8 MiB limit a client declares 7 MiB and sends nothing: it holds BODY_WINDOW
    (1 MiB), not its declaration (48 such clients had held a whole limit at a few bytes a
    second), so a second client's 2 MiB body is admitted beside it (it was a 503: 7 + 2 > 8)
    and holds its body and what decoding its JSON strings takes (1.75x, past the first 8 KiB):
    6.5 MiB in all."""
    app = create_app(small_settings(max_inflight_bytes=8 * MiB, max_body_bytes=8 * MiB))

    async def scenario() -> None:
        leave, stalled, second_in = asyncio.Event(), asyncio.Event(), asyncio.Event()
        first = asyncio.create_task(
            call(
                app,
                asgi_scope("POST", "/v1/attention", content_length=7 * MiB),
                [{"wait": leave, "reached": stalled}],  # nothing sent
            )
        )
        await asyncio.wait_for(stalled.wait(), 10)
        assert _held(app) == BODY_WINDOW
        second = asyncio.create_task(
            call(
                app,
                asgi_scope("POST", "/v1/attention", content_length=2 * MiB),
                [
                    {"type": "http.request", "body": b" " * (2 * MiB), "more_body": True},
                    {"wait": leave, "reached": second_in},
                ],
            )
        )
        await asyncio.wait_for(second_in.wait(), 10)
        assert _held(app) == BODY_WINDOW + 2 * MiB + int(1.75 * 2 * MiB) - 8192
        leave.set()
        await first
        await second
        assert _held(app) == 0

    asyncio.run(scenario())


def chunked_scope(path: str, *headers: tuple[bytes, bytes]) -> dict[str, Any]:
    """The scope of a request without Content-Length (chunked, or inflated inside the app)."""
    scope = asgi_scope("POST", path)
    scope["headers"] = [(b"content-type", b"application/json"), *headers]
    return scope


def body_of(sent: list[dict[str, Any]]) -> dict[str, Any]:
    said = b"".join(m.get("body", b"") for m in sent if m["type"] == "http.response.body")
    parsed: dict[str, Any] = json.loads(said)
    return parsed


def test_a_chunked_body_is_refused_mid_stream_once_others_hold_the_room() -> None:
    """A holder declares 3,000 bytes of a 4,096-byte limit; a chunked body's first 1,000 bytes
    fit beside it (4,000), its next 200 do not (4,200): 503 with Retry-After at that chunk,
    and what it had read comes back at once."""
    app = create_app(small_settings(max_inflight_bytes=LIMIT))

    async def scenario() -> None:
        leave, stalled = asyncio.Event(), asyncio.Event()
        holder = asyncio.create_task(
            call(
                app,
                asgi_scope("POST", "/v1/attention", content_length=3000),
                [{"wait": leave, "reached": stalled}],
            )
        )
        await stalled.wait()
        streamed, read = await call(
            app,
            chunked_scope("/v1/attention"),
            [
                {"type": "http.request", "body": b" " * 1000, "more_body": True},
                {"type": "http.request", "body": b" " * 200, "more_body": True},
                {"type": "http.request", "body": b" " * 200, "more_body": False},
            ],
        )
        assert status(streamed) == 503
        start = next(m for m in streamed if m["type"] == "http.response.start")
        assert dict(start["headers"])[b"retry-after"] == b"1"
        assert "SDPA_MAX_INFLIGHT_BYTES" in body_of(streamed)["detail"]
        assert read == [1000, 200]  # refused at the chunk that passed, not after the body
        assert _held(app) == 3000
        leave.set()
        await holder
        assert _held(app) == 0

    asyncio.run(scenario())


def test_a_chunked_body_that_alone_passes_the_limit_is_a_413_mid_stream() -> None:
    """Alone, 4,000 bytes fit a 4,096-byte limit and 4,100 never will: 413 naming the body."""
    app = create_app(small_settings(max_inflight_bytes=LIMIT))

    async def scenario() -> None:
        streamed, read = await call(
            app,
            chunked_scope("/v1/attention"),
            [
                {"type": "http.request", "body": b" " * 4000, "more_body": True},
                {"type": "http.request", "body": b" " * 100, "more_body": True},
                {"type": "http.request", "body": b" " * 100, "more_body": False},
            ],
        )
        assert status(streamed) == 413
        error = body_of(streamed)["errors"][0]
        assert error["loc"] == ["body"]
        assert "4100" in error["msg"]
        assert "SDPA_MAX_INFLIGHT_BYTES" in error["msg"]
        assert read == [4000, 100]
        assert _held(app) == 0

    asyncio.run(scenario())


def test_json_separators_reserve_their_parse_peak_as_they_arrive() -> None:
    """Each "," reserves 52 bytes, each "[" or "{" 88 and each ":" 56 (what parsing them was
    measured to hold), past the first 8,192 bytes of estimate. By hand: 1,000 "0," (2,000
    bytes) reserve 2,000 + 1,000·52 - 8,192 = 45,808 bytes; 100 "[0]," more (400 bytes) add
    400 + 100·(52 + 88) = 14,400: 60,208. A base64 body's reservation stays its body."""
    app = create_app(small_settings(max_inflight_bytes=1 << 20))

    async def scenario() -> None:
        leave, stalled, next_chunk, more = (asyncio.Event() for _ in range(4))
        holder = asyncio.create_task(
            call(
                app,
                chunked_scope("/v1/attention"),
                [
                    {"type": "http.request", "body": b"0," * 1000, "more_body": True},
                    {"wait": next_chunk, "reached": stalled},
                ],
            )
        )
        await stalled.wait()
        assert _held(app) == 45_808
        next_chunk.set()
        await holder
        assert _held(app) == 0
        holder = asyncio.create_task(
            call(
                app,
                chunked_scope("/v1/attention"),
                [
                    {"type": "http.request", "body": b"0," * 1000, "more_body": True},
                    {"type": "http.request", "body": b"[0]," * 100, "more_body": True},
                    {"wait": leave, "reached": more},
                ],
            )
        )
        await more.wait()
        assert _held(app) == 60_208
        leave.set()
        await holder
        b64 = json.dumps(weights_request()).encode()
        assert b64.count(b",") < 40  # the envelope: a few fields and shapes
        done, arrived = asyncio.Event(), asyncio.Event()
        holder = asyncio.create_task(
            call(
                app,
                asgi_scope("POST", "/v1/attention", content_length=len(b64)),
                [
                    {"type": "http.request", "body": b64, "more_body": True},
                    {"wait": done, "reached": arrived},
                ],
            )
        )
        await arrived.wait()
        # A base64 body holds no separators, but its strings become a str as long as
        # themselves and their decoded bytes: 1.75x the JSON read, past the free envelope.
        assert _held(app) == len(b64) + int(1.75 * len(b64)) - 8192
        done.set()
        await holder

    asyncio.run(scenario())


def json_weights_body() -> bytes:
    """The weights request of weights_request() with q, k, v as JSON lists of 0.5 (the answer
    in base64, so its working set is WORKING_SET). Its separators, by hand: each [1, 1, 128, 4]
    list holds 128·3 commas in its rows and 127 between them (511) and 3 + 128 = 131 "["; the
    object holds 6 keys (6 ":", 5 commas) in one "{". Estimate: (3·511 + 5)·52 + (3·131 + 1)·88
    + 6·56 = 114,984; reserved past the 8,192-byte envelope: 106,792."""
    rows = [[0.5] * 4 for _ in range(128)]
    tensor = [[rows]]
    body = json.dumps(
        {"q": tensor, "k": tensor, "v": tensor, "return_weights": True,
         "diagnostics": "none", "response_encoding": "base64"}
    ).encode()  # fmt: skip
    assert (body.count(b","), body.count(b"["), body.count(b"{")) == (1538, 393, 1)
    return body


JSON_PARSE_RESERVED = 106_792


def test_a_json_body_whose_parse_never_fits_is_a_422_before_it_is_parsed() -> None:
    body = json_weights_body()
    headers = {"content-type": "application/json"}
    limit = len(body) + JSON_PARSE_RESERVED - 1
    with in_process_client(small_settings(max_inflight_bytes=limit)) as client:
        refused = client.post("/v1/attention", content=body, headers=headers)
        assert refused.status_code == 422
        error = refused.json()["errors"][0]
        assert error["type"] == "inflight_limit"
        assert "parsing" in error["msg"]
        assert "base64" in error["msg"]
        assert "SDPA_MAX_INFLIGHT_BYTES" in error["msg"]
        assert computed(client.get("/metrics").text) == 0


def test_the_parse_reservation_is_dropped_once_the_request_is_decoded() -> None:
    """Body + parse (106,792) fit a limit of body + WORKING_SET (262,144), and so does body +
    working set, but not all three: served, so the parse reservation was gone before the
    working set was reserved. One byte less is the working set's own 422."""
    body = json_weights_body()
    headers = {"content-type": "application/json"}
    with in_process_client(small_settings(max_inflight_bytes=len(body) + WORKING_SET)) as client:
        served = client.post("/v1/attention", content=body, headers=headers)
        assert served.status_code == 200, served.text
    with in_process_client(
        small_settings(max_inflight_bytes=len(body) + WORKING_SET - 1)
    ) as client:
        refused = client.post("/v1/attention", content=body, headers=headers)
        assert refused.status_code == 422
        assert "at its peak" in refused.json()["errors"][0]["msg"]


def v2_binary_body(fill: bytes) -> tuple[bytes, int]:
    """A v2 request of q, k, v [1, 1, 128, 4] as binary data of `fill` bytes, output "output"
    as binary data -> (the body, its JSON header's length)."""
    header = json.dumps(
        {
            "inputs": [
                {"name": name, "shape": [1, 1, 128, 4], "datatype": "FP32",
                 "parameters": {"binary_data_size": 2048}}
                for name in "qkv"
            ],
            "outputs": [{"name": "output", "parameters": {"binary_data": True}}],
        }
    ).encode()  # fmt: skip
    return header + fill * (3 * 2048), len(header)


def test_v2_binary_data_is_not_scanned_for_json() -> None:
    """The binary data is 6,144 bytes of "," (float32 0x2C2C2C2C, about 2.4e-12): scanned as
    JSON they would reserve 6,144·52 = 319,488 bytes, and a limit of body + 150,000 would
    refuse them. Only the Inference-Header-Content-Length bytes are JSON: served. Told the
    whole body is its header, the same bytes are scanned, and refused (400 on v2)."""
    body, header_length = v2_binary_body(b",")
    url = "/v2/models/attention/infer"
    with in_process_client(small_settings(max_inflight_bytes=len(body) + 150_000)) as client:
        served = client.post(
            url, content=body, headers={"Inference-Header-Content-Length": str(header_length)}
        )
        assert served.status_code == 200, served.text
        scanned = client.post(
            url, content=body, headers={"Inference-Header-Content-Length": str(len(body))}
        )
        assert scanned.status_code == 400
        assert "parsing" in scanned.json()["error"]
        assert "SDPA_MAX_INFLIGHT_BYTES" in scanned.json()["error"]


def test_content_length_is_read_whatever_its_leading_zeros() -> None:
    """5,000 leading zeros (int() refuses strings past 4,300 digits) still declare 3,000 bytes,
    reserved at once; 4,301 significant digits are larger than any limit: 413 before a byte of
    the body is read, never a 500."""
    app = create_app(small_settings(max_inflight_bytes=LIMIT))

    async def scenario() -> None:
        leave, stalled = asyncio.Event(), asyncio.Event()
        zeros = asgi_scope("POST", "/v1/attention")
        zeros["headers"] = [
            (b"content-type", b"application/json"),
            (b"content-length", b"0" * 5000 + b"3000"),
        ]
        holder = asyncio.create_task(call(app, zeros, [{"wait": leave, "reached": stalled}]))
        await stalled.wait()
        assert _held(app) == 3000
        leave.set()
        await holder
        huge = asgi_scope("POST", "/v1/attention")
        huge["headers"] = [
            (b"content-type", b"application/json"),
            (b"content-length", b"9" * 4301),
        ]
        refused, read = await call(
            app, huge, [{"type": "http.request", "body": b"{}", "more_body": False}]
        )
        assert status(refused) == 413
        assert read == []

    asyncio.run(scenario())


def test_a_compressed_body_is_counted_as_it_inflates() -> None:
    """The gzip-compressed JSON weights body declares no inflated length: its bytes and their
    parse estimate are counted as they inflate, with the same limits as the plain body's."""
    body = json_weights_body()
    packed = gzip.compress(body)
    assert len(packed) < len(body) // 20
    headers = {"content-type": "application/json", "content-encoding": "gzip"}
    limit = len(body) + JSON_PARSE_RESERVED - 1
    with in_process_client(small_settings(max_inflight_bytes=limit)) as client:
        refused = client.post("/v1/attention", content=packed, headers=headers)
        assert refused.status_code == 422
        assert "parsing" in refused.json()["errors"][0]["msg"]
    with in_process_client(small_settings(max_inflight_bytes=len(body) + WORKING_SET)) as client:
        served = client.post("/v1/attention", content=packed, headers=headers)
        assert served.status_code == 200, served.text


def test_separators_are_counted_wherever_they_sit_in_a_chunk() -> None:
    """By hand: 10 commas in 10 kB of base64-like bytes (found one by one) reserve 10·52; 100
    (found one by one, then counted) 100·52; each kind of separator at its own cost."""
    filler = b"QUJD" * 2500  # 10,000 bytes of base64: no separator
    sparse = b",".join([filler[:1000]] * 11)
    assert parse_estimate(sparse) == 10 * 52
    dense = b"," * 100 + filler
    assert parse_estimate(dense) == 100 * 52
    assert parse_estimate(b'{"a": [1, 2]}') == 88 + 56 + 88 + 52
    assert parse_estimate(filler) == 0


@pytest.mark.parametrize(
    ("value", "number"),
    [
        (b"42", 42),
        (b" 42 ", 42),
        (b"0" * 5000 + b"42", 42),  # int() refuses strings of more than 4,300 digits
        (b"000", 0),
        (b"9" * 18, 10**18 - 1),
        (b"1" + b"0" * 18, BEYOND_ANY_LIMIT),  # 19 digits: past every limit
        (b"9" * 4301, BEYOND_ANY_LIMIT),
        (b"", None),
        (b"+5", None),
        (b"1_000", None),  # int() would take it
        ("4²".encode(), None),  # str.isdigit() would take it
        (b"-1", None),
    ],
)
def test_numbers_in_headers_are_read_with_a_length_cap(value: bytes, number: int | None) -> None:
    assert parse_length(value) == number


def test_a_refusal_that_escapes_the_app_still_reaches_the_client() -> None:
    """An app that reads the body outside any error handler (a bare ASGI app): the mid-stream
    413 raised from receive() is answered by the middleware, not turned into a 500."""

    async def bare(scope: Scope, receive: Receive, send: Send) -> None:
        while (await receive()).get("more_body"):
            pass
        await send({"type": "http.response.start", "status": 204, "headers": []})
        await send({"type": "http.response.body", "body": b""})

    limited = InflightBytesMiddleware(bare, max_bytes=LIMIT, max_body_bytes=1 << 20)

    async def scenario() -> None:
        streamed, read = await call(
            AccessLogMiddleware(limited),  # the edge, which makes the request's Exchange
            chunked_scope("/v1/attention"),
            [
                {"type": "http.request", "body": b" " * 4000, "more_body": True},
                {"type": "http.request", "body": b" " * 100, "more_body": False},
            ],
        )
        assert status(streamed) == 413
        assert "SDPA_MAX_INFLIGHT_BYTES" in body_of(streamed)["detail"]
        assert read == [4000, 100]
        assert limited.held == 0

    asyncio.run(scenario())


def test_past_the_bytes_parsed_whole_numbers_are_reserved_at_their_numpy_cost() -> None:
    """By hand: past INLINE_MAX_BYTES a body is parsed in pieces (16 bytes a ',' or '[', keys
    and objects as before); a chunk across that offset is charged each side at its own cost."""
    rows = b"[0.5, 0.5]," * 100  # per row: one '[' and two ','
    assert parse_estimate(rows, offset=INLINE_MAX_BYTES) == 100 * 3 * 16
    assert parse_estimate(rows, offset=0) == 100 * (88 + 2 * 52)
    across = INLINE_MAX_BYTES - 50 * len(rows) // 100  # the first 50 rows parsed whole
    assert parse_estimate(rows, offset=across) == 50 * (88 + 2 * 52) + 50 * 3 * 16
    assert parse_estimate(b'{"a": [1, 2]}', offset=INLINE_MAX_BYTES) == 88 + 56 + 16 + 16
