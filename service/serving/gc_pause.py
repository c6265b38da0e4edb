"""Python's cyclic garbage collector paused while a request body is decoded.

Parsing a JSON body allocates one Python object per list, number and key, and CPython 3.11's
collector runs after every 700 container allocations, walking the young objects (every tenth
time the older ones too, and the whole heap once enough survived): it walks the parsed tree
again and again, though a tree parsed from JSON holds no reference cycle and none of it can be
garbage. In a process that holds torch (about 200,000 tracked objects), parsing 2.7 MB of
single-element nested lists took 1.08 s with the collector and 0.12 s without it; rows of 64
numbers 190 ms and 120 ms (6.4 MB). The parser and numpy hold the GIL throughout, so on a
worker thread too this time stalls the event loop.

The collector has no per-thread switch: the pause is the process's, as long as any decode
runs (a count of them), and it is lifted by the last one to end if the collector was enabled
when the first began. Cyclic garbage made meanwhile by other threads waits that long.
"""

from __future__ import annotations

import gc
import threading

_lock = threading.Lock()
_decoding = 0
_was_enabled = False


class gc_paused:  # noqa: N801 - used as a function: `with gc_paused():`
    """No cyclic garbage collection while the block runs (reference counting goes on). A class,
    not @contextmanager: a generator-based one costs 2 µs a use."""

    def __enter__(self) -> None:
        global _decoding, _was_enabled
        with _lock:
            if _decoding == 0:
                _was_enabled = gc.isenabled()
                gc.disable()
            _decoding += 1

    def __exit__(self, *exc: object) -> None:
        global _decoding
        with _lock:
            _decoding -= 1
            if _decoding == 0 and _was_enabled:
                gc.enable()


def decodes_in_progress() -> int:
    """How many decodes hold the pause now (one that was abandoned included: a request answered
    503 at the end of the drain leaves its worker thread to finish)."""
    with _lock:
        return _decoding
