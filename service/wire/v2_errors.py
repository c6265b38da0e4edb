"""How the Open Inference Protocol words an error, for both of its doors (REST and gRPC).

Its clients (tritonclient, KServe's) read one message: it names the input, output or parameter
in v2's words ("input 'q': ...", "parameter 'scale': ..."), where v1 locates the field by its
own name in errors[].loc. What v1 answers 422 (or 415) is a 400 on v2 REST and INVALID_ARGUMENT
on gRPC; other statuses are v1's.
"""

from __future__ import annotations

from typing import Final

from service.errors import ServiceError, clip

_V2_STATUS: Final = {422: 400, 415: 400}
_V2_INPUTS: Final = frozenset({"q", "k", "v", "key_lengths", "key_padding_mask", "attn_mask"})
# v1 field names (in errors[].loc) -> what a v2 request calls them.
_V2_NAMES: Final = {
    "return_weights": "output 'weights'",
    "response_encoding": "outputs",
    "timeout_ms": "parameter 'timeout'",
}


def v2_status(status: int) -> int:
    """The HTTP status v2 REST answers where v1 answers `status`."""
    return _V2_STATUS.get(status, status)


def v2_name(field: str | int) -> str:
    """A v1 field name as v2 names it: input 'q', output 'weights', parameter 'scale'."""
    if field in _V2_INPUTS:
        return f"input {field!r}"
    return _V2_NAMES.get(str(field), f"parameter {field!r}")


def v2_message(exc: ServiceError) -> str:
    """A client error's message in v2's words, clipped (service.errors). The serving layer's
    shared checks locate their field by its v1 name (loc ["body", name, ...]): the message then
    starts with its v2 name; the v2 decoders' own errors (loc ["v2", ...]) are worded already."""
    loc = exc.errors[0].loc if exc.errors else ()
    if len(loc) > 1 and loc[0] == "body":
        return clip(f"{v2_name(loc[1])}: {exc.field_detail}")
    return clip(exc.detail)
