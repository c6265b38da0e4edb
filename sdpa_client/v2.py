"""The Open Inference Protocol (v2) for `protocol="v2"`: request bodies and answers, no I/O.

The service also speaks KServe's v2 REST protocol with Triton's binary tensor data extension
(POST /v2/models/attention/infer). With binary data (the default) a request is a JSON header
followed by the tensors' raw little-endian bytes, and so is the answer: no base64, and BF16
travels as its raw bits. The answer is read into the same `AttentionResponse` as v1's: the
output, the weights, the per-row statistics and the per-head ones ("<stat>_per_head") from the
named outputs, the summary statistics and the meta fields from the response parameters.

Needs numpy only, like the rest of the package.
"""

from __future__ import annotations

import json
import math
from collections.abc import Mapping
from typing import Any, Final

import httpx
import numpy as np

from sdpa_client.bodies import checked_priority
from sdpa_client.codec import AnyArray, is_torch_tensor, to_numpy
from sdpa_client.errors import SDPAProtocolError
from sdpa_client.fields import (
    COUNT_STATS,
    PER_HEAD_STAT_NAMES,
    PER_ROW_STAT_NAMES,
    SUMMARY_STAT_NAMES,
)
from sdpa_client.types import (
    AttentionResponse,
    DiagnosticsReport,
    ResponseMeta,
    _parse_summary,
)

INFER_PATH: Final = "/v2/models/attention/infer"
HEADER_LENGTH: Final = "Inference-Header-Content-Length"
# A per-head statistic's output is named "<stat>_per_head" (entropy_per_head, ...): [..., H].
PER_HEAD_SUFFIX: Final = "_per_head"
_DATATYPE_OF_WIRE: Final = {
    "float16": "FP16",
    "bfloat16": "BF16",
    "float32": "FP32",
    "float64": "FP64",
    "bool": "BOOL",
}
_LITTLE_ENDIAN: Final[dict[str, np.dtype[Any]]] = {
    "FP16": np.dtype("<f2"),
    "BF16": np.dtype("<u2"),  # raw bits (numpy has no bfloat16)
    "FP32": np.dtype("<f4"),
    "FP64": np.dtype("<f8"),
    "BOOL": np.dtype("|b1"),
    "INT32": np.dtype("<i4"),
    "INT64": np.dtype("<i8"),
}


def _tensor_input(name: str, x: object, *, binary: bool) -> tuple[dict[str, Any], bytes | None]:
    """One float or bool tensor input: its header entry and (binary) its bytes."""
    wire, arr = to_numpy(x, param=name)
    datatype = _DATATYPE_OF_WIRE[wire]
    return _entry(name, arr, datatype, binary=binary)


def _int_input(name: str, x: object, *, binary: bool) -> tuple[dict[str, Any], bytes | None]:
    arr = np.asarray(x.tolist() if is_torch_tensor(x) else x)  # type: ignore[attr-defined]
    if arr.dtype.kind not in "iu":
        raise TypeError(f"{name}: expected integers, got dtype {arr.dtype}")
    datatype = "INT32" if arr.dtype == np.int32 else "INT64"
    return _entry(name, arr, datatype, binary=binary)


def _entry(
    name: str, arr: AnyArray, datatype: str, *, binary: bool
) -> tuple[dict[str, Any], bytes | None]:
    entry: dict[str, Any] = {"name": name, "shape": [int(s) for s in arr.shape]}
    entry["datatype"] = datatype
    if binary:
        raw = np.ascontiguousarray(arr, dtype=_LITTLE_ENDIAN[datatype]).tobytes()
        entry["parameters"] = {"binary_data_size": len(raw)}
        return entry, raw
    if datatype == "BF16":
        raise TypeError(f"{name}: BF16 travels only as binary data (binary=True)")
    flat = arr.reshape(-1)
    if flat.dtype.kind == "f" and np.isneginf(flat).any():
        # JSON has no -inf: the server reads null in a float mask as -inf (not visible).
        entry["data"] = [None if math.isinf(x) and x < 0 else x for x in flat.tolist()]
    else:
        entry["data"] = flat.tolist()
    return entry, None


def build_infer_request(
    q: object,
    k: object,
    v: object,
    *,
    causal: bool | str = False,
    key_lengths: object | None = None,
    key_padding_mask: object | None = None,
    attn_mask: object | None = None,
    scale: float | None = None,
    temperature: float | None = None,
    return_weights: bool = False,
    diagnostics: str = "summary",
    timeout_ms: float | None = None,
    binary: bool = True,
    tag: str | None = None,
    return_output: bool = True,
    priority: int | None = None,
) -> tuple[bytes, dict[str, str]]:
    """The body and headers of a v2 infer request with `SDPAClient.attention`'s arguments.

    The outputs it names: "output" (unless return_output is False), "weights" (with
    return_weights), the per-row statistics (diagnostics "full") and every per-head one,
    "<stat>_per_head" (diagnostics "summary" or "full"). priority travels as the request
    parameter "priority" (an int), as tritonclient sends it; None sends none.

    Returns:
        (body bytes, headers): with binary data, the JSON header, then the tensors' bytes, and
        Inference-Header-Content-Length.

    Raises:
        TypeError: a dtype the protocol cannot carry, BF16 without binary data, or a priority
            that is not an int.
        ValueError: a negative priority.
    """
    level = None if priority is None else checked_priority(priority)
    parts: list[tuple[dict[str, Any], bytes | None]] = [
        _tensor_input(name, x, binary=binary) for name, x in (("q", q), ("k", k), ("v", v))
    ]
    if key_lengths is not None:
        parts.append(_int_input("key_lengths", key_lengths, binary=binary))
    if key_padding_mask is not None:
        entry = _tensor_input("key_padding_mask", key_padding_mask, binary=binary)
        if entry[0]["datatype"] != "BOOL":
            raise TypeError(
                f"key_padding_mask: expected a boolean mask, got {entry[0]['datatype']}"
            )
        parts.append(entry)
    if attn_mask is not None:
        parts.append(_tensor_input("attn_mask", attn_mask, binary=binary))
    names = [*(["output"] if return_output else []), *(["weights"] if return_weights else [])]
    if diagnostics == "full":
        names += PER_ROW_STAT_NAMES
    if diagnostics != "none":
        names += [f"{name}{PER_HEAD_SUFFIX}" for name in PER_HEAD_STAT_NAMES]
    parameters: dict[str, Any] = {"diagnostics": diagnostics}
    if causal is not False:
        parameters["causal"] = causal
    if scale is not None:
        parameters["scale"] = float(scale)
    if temperature is not None:
        parameters["temperature"] = float(temperature)
    if tag is not None:
        parameters["tag"] = tag
    if timeout_ms is not None:
        parameters["timeout"] = max(1, round(timeout_ms * 1000))  # microseconds
    if level is not None:
        parameters["priority"] = level
    header = json.dumps(
        {
            "inputs": [entry for entry, _ in parts],
            "outputs": [{"name": n, "parameters": {"binary_data": binary}} for n in names],
            "parameters": parameters,
        },
        separators=(",", ":"),
    ).encode()
    if not binary:
        return header, {"content-type": "application/json"}
    body = b"".join([header, *(raw for _, raw in parts if raw is not None)])
    return body, {HEADER_LENGTH: str(len(header)), "content-type": "application/octet-stream"}


def _malformed(what: str) -> SDPAProtocolError:
    return SDPAProtocolError(None, "Malformed response", f"v2 infer: {what}")


def _output_array(out: Mapping[str, Any], body: bytes, offset: int) -> tuple[AnyArray, int]:
    """One output -> (its array, the offset after its binary data)."""
    datatype = str(out["datatype"])
    shape = tuple(int(s) for s in out["shape"])
    size = (out.get("parameters") or {}).get("binary_data_size")
    if size is not None:
        dtype = _LITTLE_ENDIAN[datatype]
        arr = np.frombuffer(body, dtype=dtype, count=int(size) // dtype.itemsize, offset=offset)
        if datatype == "BF16":  # as v1's decoding: every bfloat16 is exactly a float32
            arr = (arr.astype(np.uint32) << np.uint32(16)).view(np.float32)
        return arr.reshape(shape), offset + int(size)
    null_as = -math.inf if out["name"] == "lse" else math.nan
    values = [null_as if x is None else x for x in out["data"]]
    return np.asarray(values, dtype=_LITTLE_ENDIAN[datatype]).reshape(shape), offset


def parse_infer_response(
    response: httpx.Response, *, return_output: bool = True
) -> AttentionResponse:
    """Read a v2 infer answer (JSON, or a JSON header with binary data) as an AttentionResponse.

    Args:
        response: the answer.
        return_output: whether the request asked for "output"; only then must the answer hold
            it (without, the result's output is None unless the server sent one anyway).

    Raises:
        SDPAProtocolError: the answer is not such a response.
    """
    body = response.content
    length = response.headers.get(HEADER_LENGTH)
    try:
        offset = len(body) if length is None else int(length)
        header = json.loads(body[:offset])
        arrays: dict[str, AnyArray] = {}
        for out in header["outputs"]:
            arrays[str(out["name"])], offset = _output_array(out, body, offset)
        params: dict[str, Any] = dict(header.get("parameters") or {})
    except (KeyError, ValueError, TypeError) as exc:
        raise _malformed(f"cannot read the answer ({exc!r})") from exc
    if return_output and "output" not in arrays:
        raise _malformed("no 'output' in response")
    summary = {name: params.pop(name) for name in list(params) if name in SUMMARY_STAT_NAMES}
    per_head: dict[str, AnyArray] = {}
    per_row: dict[str, AnyArray] = {}
    for name, arr in arrays.items():
        if name.endswith(PER_HEAD_SUFFIX):
            per_head[name.removesuffix(PER_HEAD_SUFFIX)] = arr
        elif name not in ("output", "weights"):
            per_row[name] = arr
    for stats in (per_head, per_row):
        for name in COUNT_STATS & set(stats):
            stats[name] = stats[name].astype(np.int64)
    diagnostics = None
    if summary or per_head or per_row:
        diagnostics = DiagnosticsReport(
            summary=_parse_summary(summary), per_head=per_head, per_row=per_row or None
        )
    return AttentionResponse(
        output=arrays.get("output"),
        weights=arrays.get("weights"),
        diagnostics=diagnostics,
        meta=ResponseMeta.from_json(params),
    )
