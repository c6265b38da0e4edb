"""Which decoding and encoding runs on the event loop, and which on a worker thread.

The choice is made by the work, estimated from the body in microseconds, not by its size
alone: some shapes of JSON cost a hundred times more per byte than others. Measured on the
2-core development machine (prepare_attention and prepare_infer with the collector paused,
torch on one thread, as the server's loop and workers run it):

| body                              | ns per byte | what it costs per unit          |
| --------------------------------- | ----------- | ------------------------------- |
| b64 tensors (the fast path)       | 0.4 - 4     | mostly fixed: 0.3 ms at 262 KB  |
| whitespace, long floats           | 1 - 4       |                                 |
| string escapes (\\u00e9), big ints | 8 - 14      | per byte                        |
| JSON rows of 64 numbers           | 11 - 19     | 250 - 400 ns per ","            |
| rows of 2 numbers, ints           | 75 - 125    |                                 |
| [N, 1, 1] nested lists            | 140 - 190   | 600 - 700 ns per "["            |
| rank 6 single-element lists       | 135 - 320   |                                 |

So the estimate is DECODE_NS_PER_BYTE a byte, DECODE_NS_PER_LIST a "[", and
DECODE_NS_PER_ITEM a "," (an element, a key, a list), each near the top of its range; finding
both characters takes 10 µs in the small preset's 262 KB body (service.wire.codec.occurrences;
numpy's count takes 57). A body whose estimate is under INLINE_BUDGET_NS (a few milliseconds)
decodes on the loop, where the thread hop would cost more than it saves; so does a body under
TINY_BYTES, without counting. A body over INLINE_MAX_BYTES is not even counted: it always
leaves the loop (the worst bytes, big integers, cost 14 ns each, 5.5 ms at that size).

A worker thread frees the loop only from the work that lets the GIL go: numpy's and torch's
numerical kernels and base64 do, but the JSON parser and numpy reading nested lists hold it
from start to end of each call. So a body that leaves the loop has its big arrays of numbers
parsed in pieces (service.wire.json_arrays: no call on more than 256 KiB of them, no Python
object per number). With the collector paused (service.serving.gc_pause), on the 2-core
development machine (bench/attack_decode.py decode-costs): 18 MiB of single-element lists
stalled the loop 875 ms parsed whole on a worker, 9 ms in pieces; 128 MiB of rows of 64 numbers
1.0-2.1 s, 8-10 ms; a 32 MiB bool mask 266 ms, 3 ms.
"""

from __future__ import annotations

import functools
from collections.abc import Callable
from typing import Final, ParamSpec, TypeVar

import anyio.to_thread

from service.serving.gc_pause import gc_paused
from service.wire.codec import occurrences

P = ParamSpec("P")
T = TypeVar("T")

DECODE_NS_PER_BYTE: Final = 6
DECODE_NS_PER_LIST: Final = 700
DECODE_NS_PER_ITEM: Final = 400
# Work the loop may do for one request's decoding or encoding: a few milliseconds.
INLINE_BUDGET_NS: Final = 3_000_000
# Below this a body decodes inline without counting: at 320 ns a byte (the worst measured) it
# takes under a millisecond.
TINY_BYTES: Final = 2048
# Above this a body always leaves the loop. It holds the b64 small-payload preset
# (q, k, v of [1, 4, 64, 64]: 262 KB), which must stay inline.
INLINE_MAX_BYTES: Final = 384 * 1024

# Encoding, per number: orjson writes a float32 in 42-49 ns, base64 2-6 ns; binary outputs
# (v2) are sent from the result tensors without encoding.
ENCODE_NS_PER_JSON_NUMBER: Final = 50
ENCODE_NS_PER_BASE64_NUMBER: Final = 6

_LIST: Final = ord("[")
_ITEM: Final = ord(",")


def decode_ns(body: bytes, *, json_bytes: int | None = None) -> int:
    """The estimated nanoseconds of parsing and decoding the body's JSON: all of it, or its
    first `json_bytes` (v2's JSON header)."""
    end = len(body) if json_bytes is None else json_bytes
    lists = occurrences(body, _LIST, end=end)
    items = occurrences(body, _ITEM, end=end)
    return DECODE_NS_PER_BYTE * end + DECODE_NS_PER_LIST * lists + DECODE_NS_PER_ITEM * items


def decode_inline(body: bytes, *, json_bytes: int | None = None) -> bool:
    """Whether `body` decodes on the event loop. `json_bytes`: how much of it is JSON (v2's
    binary data after its JSON header costs only a copy); None: all of it."""
    if len(body) <= TINY_BYTES:
        return True
    if len(body) > INLINE_MAX_BYTES:
        return False
    return decode_ns(body, json_bytes=json_bytes) <= INLINE_BUDGET_NS


def encode_inline(*, json_numbers: int, base64_numbers: int = 0) -> bool:
    """Whether a response of that many numbers, written as JSON and as base64, is encoded on
    the event loop."""
    work = ENCODE_NS_PER_JSON_NUMBER * json_numbers + ENCODE_NS_PER_BASE64_NUMBER * base64_numbers
    return work <= INLINE_BUDGET_NS


async def off_loop_if(heavy: bool, fn: Callable[P, T], /, *args: P.args, **kwargs: P.kwargs) -> T:
    """fn(*args, **kwargs) on a worker thread when `heavy`, inline otherwise. Cancelling the
    awaiting task (the drain ended: service.api.compute) returns at once; the thread finishes
    on its own and its result is dropped."""
    if heavy:
        call = functools.partial(fn, *args, **kwargs)
        return await anyio.to_thread.run_sync(call, abandon_on_cancel=True)
    return fn(*args, **kwargs)


def without_gc(fn: Callable[P, T], /, *args: P.args, **kwargs: P.kwargs) -> T:
    """fn(*args, **kwargs) with the cyclic collector paused (service.serving.gc_pause): for
    decoding, whose parsed JSON trees hold no cycle for it to find."""
    with gc_paused():
        return fn(*args, **kwargs)


async def run_decoding(inline: bool, fn: Callable[P, T], /, *args: P.args, **kwargs: P.kwargs) -> T:
    """fn(*args, **kwargs), a body's decoding: on the loop when `inline` (decode_inline), else
    on a worker thread with the collector paused (a few microseconds a call: not worth it for
    the few objects of an inline body). Cancelling the awaiting task returns at once, as
    off_loop_if does."""
    if inline:
        return fn(*args, **kwargs)
    call = functools.partial(without_gc, fn, *args, **kwargs)
    return await anyio.to_thread.run_sync(call, abandon_on_cancel=True)
