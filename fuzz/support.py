"""What the harnesses share: the settings they parse under, what counts as a finding, and the
atheris entry point.

A parser's answer to any bytes is a prepared job or a client error: a ServiceError of a 4xx
status, or sdpa_core's SdpaError (the doors answer it 422, or 400 on v2). Everything else is a
finding: another exception (ValueError, TypeError, IndexError, RecursionError, MemoryError,
OverflowError...: a 500), a client error whose answer cannot be written (its text not UTF-8 or
not JSON: a 500 while answering), a hang (libFuzzer's -timeout) or a blow-up of memory
(-rss_limit_mb). Where a parser has two ways to read the same bytes (v1 and v2 JSON parsed whole
or in pieces: service.wire.json_arrays), the two answers must also be the same, word for word
and bit for bit, as that module promises.

Nothing from service or sdpa_core is imported at this module's import: `fuzz_main` imports the
harness's target inside atheris.instrument_imports, so that only our packages are instrumented
(torch, numpy and pydantic are imported first, uninstrumented: instrumented, torch alone takes
minutes to import and runs many times slower). The corpus replay test
(tests/service/wire/test_fuzz_corpus.py) loads the same targets without atheris.
"""

from __future__ import annotations

import dataclasses
import json
import os
import sys
import zlib
from collections.abc import Callable, Sequence
from functools import cache
from pathlib import Path
from typing import TYPE_CHECKING, Any, Final

if TYPE_CHECKING:
    from service.runtime.policy import CostModel
    from service.settings import Settings
    from service.wire.json_arrays import Pieces

ROOT: Final = Path(__file__).resolve().parent
CORPUS: Final = ROOT / "corpus"
# The packages whose code atheris instruments (coverage, and comparisons it learns from).
INSTRUMENTED: Final = ("service", "sdpa_core")
# Imported before instrumentation starts: they stay uninstrumented even where our modules
# import them (a module imported once is not imported again).
UNINSTRUMENTED: Final = (
    "torch",
    "numpy",
    "pydantic",
    "pydantic_core",
    "pydantic_settings",
    "orjson",
    "pybase64",
    "google.protobuf",
)
# Instrumented for coverage only, without atheris's comparison tracing: they compare numpy
# arrays and torch tensors element by element, and atheris 3.0 leaks the result of every
# comparison it traces that is not a bool (each `array == x` kept forever: 55 KB an input, RSS
# past the limit in minutes). Imported first, so that the traced import after them leaves them
# as they are. The parsers' own comparisons (names, datatypes, field values) stay traced.
UNTRACED: Final = (
    "sdpa_core",
    "service.runtime.jobs",
    "service.runtime.policy",
    "service.wire.bytecount",
    "service.wire.json_spans",
    "service.wire.span_layout",
    "service.wire.number_lists",
    "service.wire.json_errors",
    "service.wire.json_arrays",
)
# Small limits: every input, however its shapes are written, decodes in about a millisecond,
# and the limits themselves are reached and refused often.
MAX_ELEMENTS: Final = 4096

# What a parser answered: ("ok", a summary of what it returned) or ("refused", the client
# error's class name, its text, its field errors).
Answer = tuple[Any, ...]
Check = Callable[[bytes], None]


class Finding(AssertionError):
    """A parser answered bytes with something other than a prepared job or a client error."""


@cache
def settings() -> Settings:
    """The settings every harness parses under (tests/support/app.py's small_settings, with
    smaller tensors), read from no environment variable of the caller's."""
    from service.settings import Settings

    saved = {name: os.environ.pop(name) for name in list(os.environ) if name.startswith("SDPA_")}
    try:
        return Settings(
            device="cpu",
            max_body_bytes=1 << 20,
            max_elements=MAX_ELEMENTS,
            max_weights_elements=MAX_ELEMENTS,
            max_response_bytes=1 << 20,
            compile_kernels=False,
            log_level="warning",
        )
    finally:
        os.environ.update(saved)


@cache
def cost_model() -> CostModel:
    from service.runtime.policy import CostModel

    return CostModel.uncalibrated()


def pieces_for(data: bytes) -> Pieces:
    """Pieces small enough to cut a fuzzer's small bodies, chosen from the bytes themselves
    (the same bytes always get the same pieces): spans of 4 to 67 bytes cut every 8 to 135
    bytes, read by numpy in one window or (one body in sixteen, as it costs ten times as much)
    in windows of 16 bytes."""
    from service.wire.json_arrays import Pieces

    h = zlib.crc32(data)
    return Pieces(
        piece_bytes=8 + h % 128,
        min_span_bytes=4 + (h >> 8) % 64,
        few_values=0,
        window=16 if (h >> 16) % 16 == 0 else 1 << 18,
    )


# ---- what an answer is -------------------------------------------------------------------


def summary(value: Any) -> Any:
    """A value as something == compares exactly: tensors by dtype, shape and bytes, floats by
    repr (nan equals nan), dataclasses field by field."""
    import torch

    if isinstance(value, torch.Tensor):
        t = value.detach().cpu().contiguous()
        raw = t.view(torch.int16) if t.dtype == torch.bfloat16 else t
        return ("tensor", str(t.dtype), tuple(t.shape), raw.numpy().tobytes())
    if dataclasses.is_dataclass(value) and not isinstance(value, type):
        return (
            type(value).__name__,
            tuple((f.name, summary(getattr(value, f.name))) for f in dataclasses.fields(value)),
        )
    if isinstance(value, float):
        return repr(value)
    if isinstance(value, list | tuple):
        return tuple(summary(v) for v in value)
    if isinstance(value, dict):
        return tuple(sorted((repr(k), summary(v)) for k, v in value.items()))
    if value is None or isinstance(value, bool | int | str | bytes):
        return value
    return repr(value)  # torch.dtype, enums: their repr says what they are


def _written(payload: Any, what: str) -> None:
    """Raise a Finding when `payload` cannot be written as the JSON of an answer: the doors
    write it as starlette's JSONResponse does (no NaN, UTF-8), gRPC its text as UTF-8."""
    try:
        json.dumps(payload, ensure_ascii=False, allow_nan=False, separators=(",", ":")).encode()
    except (TypeError, ValueError) as exc:  # UnicodeEncodeError is a ValueError
        raise Finding(f"{what} cannot be written as an answer: {exc!r}: {payload!r}") from exc


def answer(call: Callable[[], Any]) -> Answer:
    """What `call()` answers, when it is a client error or a result; anything else propagates
    (or is raised as a Finding): a 500."""
    from sdpa_core.errors import SdpaError
    from service.errors import ServiceError, problem_payload

    try:
        value = call()
    except ServiceError as exc:
        if not 400 <= exc.status < 500:
            raise Finding(f"a parser raised {type(exc).__name__} ({exc.status})") from exc
        _written(
            problem_payload(
                status=exc.status, detail=exc.detail, title=exc.title, errors=exc.errors
            ),
            type(exc).__name__,
        )
        _written({"error": exc.field_detail}, type(exc).__name__)
        errors = tuple((tuple(e.loc), e.msg, e.type) for e in exc.errors)
        return ("refused", type(exc).__name__, exc.detail, errors)
    except SdpaError as exc:
        parts = [exc.message, exc.param, str(exc.expected), str(exc.got), str(exc)]
        _written(parts, type(exc).__name__)
        return ("refused", type(exc).__name__, str(exc), ())
    return ("ok", summary(value))


def same_answers(whole: Answer, in_pieces: Answer, *, what: str) -> None:
    """Raise a Finding when parsing in pieces answered otherwise than parsing whole. The one
    refusal that parsing in pieces adds (an envelope of too many values) is not a difference."""
    if whole == in_pieces:
        return
    if in_pieces[0] == "refused" and any(e[2] == "too_many_values" for e in in_pieces[3]):
        return
    raise Finding(
        f"{what}: parsed whole and in pieces, the same bytes got different answers:\n"
        f"  whole:     {_short(whole)}\n  in pieces: {_short(in_pieces)}"
    )


def _short(a: Answer) -> str:
    text = repr(a)
    return text if len(text) <= 2000 else text[:2000] + "..."


# ---- atheris ---------------------------------------------------------------------------


def fuzz_main(
    load: Callable[[], Check],
    argv: Sequence[str] | None = None,
    *,
    mutator: Callable[[bytes, int, int], bytes] | None = None,
) -> None:
    """Run a harness under atheris with libFuzzer's arguments (`argv`, sys.argv by default):
    `load()` imports and returns its target, instrumenting our packages only."""
    import contextlib
    import importlib

    import atheris  # type: ignore[import-untyped, unused-ignore]

    for name in UNINSTRUMENTED:
        with contextlib.suppress(ImportError):  # an optional speedup missing
            importlib.import_module(name)
    from atheris.import_hook import (  # type: ignore[import-untyped, unused-ignore]
        HookManager,
    )

    with HookManager(set(INSTRUMENTED), set(), True, trace_dataflow=False):
        for name in UNTRACED:
            importlib.import_module(name)
    with atheris.instrument_imports(include=list(INSTRUMENTED)):
        check = load()
    args = list(sys.argv if argv is None else argv)
    if args and args[0].endswith(".py") and Path(args[0]).resolve().parent == ROOT:
        # Run as `python -m fuzz.<harness>`: libFuzzer starts itself again for -merge (and
        # -fork) with the shell command args[0] + flags, and a .py file is no command.
        args[0] = f"{sys.executable} -m fuzz.{Path(args[0]).stem}"
    if mutator is None:
        atheris.Setup(args, check)
    else:
        atheris.Setup(args, check, custom_mutator=mutator)
    atheris.Fuzz()


def fuzz_mutate(data: bytes, max_size: int) -> bytes:
    """libFuzzer's own mutation of `data` (atheris.Mutate), for custom mutators."""
    import atheris  # type: ignore[import-untyped, unused-ignore]

    return bytes(atheris.Mutate(data, max_size))
