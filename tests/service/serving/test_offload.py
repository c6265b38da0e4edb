"""Which bodies decode, and which answers encode, on the event loop: decided by the work,
estimated from the characters that cost it, each decision checked against counts made by hand;
and the collector's pause while bodies decode."""

from __future__ import annotations

import asyncio
import base64
import gc
import json
import threading

import numpy as np
import pytest

from service.serving import offload
from service.serving.gc_pause import gc_paused
from service.serving.offload import (
    DECODE_NS_PER_BYTE,
    DECODE_NS_PER_ITEM,
    DECODE_NS_PER_LIST,
    INLINE_BUDGET_NS,
    INLINE_MAX_BYTES,
    TINY_BYTES,
    decode_inline,
    decode_ns,
    encode_inline,
    off_loop_if,
    run_decoding,
)


def b64_body(shape: tuple[int, ...]) -> bytes:
    x = np.random.default_rng(0).standard_normal(shape).astype(np.float32)
    t = {"dtype": "float32", "shape": list(shape), "b64": base64.b64encode(x.tobytes()).decode()}
    return json.dumps({"q": t, "k": t, "v": t, "diagnostics": "none"}).encode()


def test_the_estimate_counts_bytes_lists_and_items() -> None:
    # 13 bytes, 3 "[" and 3 ",": 6 x 13 + 700 x 3 + 400 x 3 ns.
    assert decode_ns(b"[[1,2],[3,4]]") == 78 + 2100 + 1200
    # Past 32 of a character the rest is counted another way: 99 "," in 201 bytes.
    many = b"[" + b"1," * 99 + b"1]"
    assert decode_ns(many) == 6 * 201 + 700 + 400 * 99
    # v2: only the JSON header counts; the binary data after it is bytes to copy.
    assert decode_ns(b"[1,2]" + b",[" * 50, json_bytes=5) == 6 * 5 + 700 + 400
    assert (DECODE_NS_PER_BYTE, DECODE_NS_PER_LIST, DECODE_NS_PER_ITEM) == (6, 700, 400)
    assert INLINE_BUDGET_NS == 3_000_000


def test_the_small_payload_preset_in_base64_decodes_on_the_loop() -> None:
    # q, k, v of [1, 4, 64, 64] (sdpa-loadtest --preset small): 262,364 bytes, 3 "[" and 18
    # ",": 1.57 ms estimated, under the 3 ms budget.
    body = b64_body((1, 4, 64, 64))
    assert (len(body), body.count(b"["), body.count(b",")) == (262_364, 3, 18)
    assert decode_ns(body) == 6 * 262_364 + 700 * 3 + 400 * 18
    assert decode_inline(body)


def test_a_tiny_body_is_not_even_counted_and_a_large_one_always_leaves_the_loop() -> None:
    assert decode_inline(b"[" * TINY_BYTES)  # 2 KiB of "[": 1.4 ms at 706 ns each
    assert decode_inline(b"[" * 4249)  # counted: 4,249 x 706 ns = 2.9998 ms
    assert not decode_inline(b"[" * 4250)  # 3.0005 ms
    assert decode_inline(b" " * INLINE_MAX_BYTES)  # 6 ns x 393,216 = 2.36 ms
    assert not decode_inline(b" " * (INLINE_MAX_BYTES + 1))  # uncounted, over the size


@pytest.mark.parametrize(
    ("what", "body", "inline"),
    [
        # 1,800 single-element rows [N, 1, 1]: 3 x 1,800 x 2 + 4 "[" (10,804 x 700 ns = 7.6 ms).
        ("nested single-element lists", json.dumps({"q": [[[0.5]]] * 1800}).encode(), False),
        # 4,000 keys: 4,000 "," (1.6 ms) + 51,785 bytes (0.31 ms): under the budget.
        ("4,000 unknown fields", json.dumps({f"x{i}": 0 for i in range(4000)}).encode(), True),
        # 8,000 keys: 3.2 ms of "," alone.
        ("8,000 unknown fields", json.dumps({f"x{i}": 0 for i in range(8000)}).encode(), False),
        # [32, 64] floats: 2,047 "," (0.82 ms) + 33 "[" + ~45 KB: inline; [128, 64]: 3.3 ms.
        ("json [32, 64]", json.dumps({"q": np.ones((32, 64)).tolist()}).encode(), True),
        ("json [128, 64]", json.dumps({"q": np.ones((128, 64)).tolist()}).encode(), False),
        # 90,000 unknown fields in 1.1 MB: over INLINE_MAX_BYTES, never counted.
        ("90,000 unknown fields", json.dumps({f"x{i}": 0 for i in range(90_000)}).encode(), False),
    ],
)
def test_each_shape_decodes_where_its_estimate_says(what: str, body: bytes, inline: bool) -> None:
    assert decode_inline(body) is inline, (what, decode_ns(body) / 1e6)


def test_v2_binary_data_costs_no_counting_but_its_size_still_bounds() -> None:
    header = b'{"inputs": []}'
    binary = b"[" * 100_000  # raw bytes, never parsed: "[" there costs nothing
    body = header + binary
    assert not decode_inline(body)
    assert decode_inline(body, json_bytes=len(header))
    assert not decode_inline(header + b"\x00" * INLINE_MAX_BYTES, json_bytes=len(header))


def test_encoding_stays_on_the_loop_up_to_three_milliseconds() -> None:
    # JSON: 50 ns a number, 60,000 numbers in 3 ms; base64: 6 ns, 500,000.
    assert encode_inline(json_numbers=60_000)
    assert not encode_inline(json_numbers=60_001)
    assert encode_inline(json_numbers=0, base64_numbers=500_000)
    assert not encode_inline(json_numbers=1, base64_numbers=500_000)
    # The small preset's answer: [1, 4, 64, 64] in base64.
    assert encode_inline(json_numbers=0, base64_numbers=16_384)


def test_off_loop_if_runs_on_a_worker_thread_only_when_heavy() -> None:
    def where(tag: str, *, suffix: str) -> tuple[str, int]:
        return tag + suffix, threading.get_ident()

    async def both() -> tuple[tuple[str, int], tuple[str, int], int]:
        inline = await off_loop_if(False, where, "a", suffix="!")
        heavy = await off_loop_if(True, where, "b", suffix="?")
        return inline, heavy, threading.get_ident()

    (text_a, thread_a), (text_b, thread_b), loop_thread = asyncio.run(both())
    assert (text_a, text_b) == ("a!", "b?")
    assert thread_a == loop_thread
    assert thread_b != loop_thread


def test_a_heavy_decode_runs_on_a_worker_thread_with_the_collector_paused() -> None:
    def observe(tag: str) -> tuple[str, int, bool]:
        return tag, threading.get_ident(), gc.isenabled()

    async def both() -> tuple[tuple[str, int, bool], tuple[str, int, bool], int]:
        inline = await run_decoding(True, observe, "inline")
        heavy = await run_decoding(False, observe, tag="heavy")
        return inline, heavy, threading.get_ident()

    inline, heavy, loop_thread = asyncio.run(both())
    assert inline == ("inline", loop_thread, True)
    assert heavy[0] == "heavy"
    assert heavy[1] != loop_thread
    assert heavy[2] is False
    assert gc.isenabled()


def test_decoding_pauses_the_collector_and_restores_it() -> None:
    assert gc.isenabled()
    with gc_paused():
        assert not gc.isenabled()
        with gc_paused():  # a second decode at once (another thread, in the server)
            assert not gc.isenabled()
        assert not gc.isenabled()  # the first is still decoding
        assert offload.without_gc(gc.isenabled) is False
    assert gc.isenabled()


def test_a_collector_disabled_before_stays_disabled() -> None:
    gc.disable()
    try:
        with gc_paused():
            assert not gc.isenabled()
        assert not gc.isenabled()
    finally:
        gc.enable()
