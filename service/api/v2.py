"""The Open Inference Protocol (v2, KServe's REST protocol with Triton's binary tensor data
extension): server and model metadata, health, and infer for the model "attention" (version
"1"). Thin routes: infer reads the raw body and hands it, as a service.serving.v2.InferDoor, to
the same serving pipeline as v1's and gRPC's doors, so limits, batching, deadlines,
cancellation and metrics are v1's. Errors are {"error": "..."} (service.http_errors).
"""

from __future__ import annotations

from typing import Any, Final

from fastapi import APIRouter, Request
from starlette.responses import Response
from starlette.types import Receive, Scope, Send

from service.api import compute
from service.api.deps import StateDep
from service.api.openapi import json_ref, v2_error_doc, v2_infer_request_body
from service.http_errors import v2_error_response
from service.serving.encode_v2 import InferAnswer
from service.serving.pipeline import Served
from service.serving.prepare_v2 import PER_HEAD_OUTPUTS, PER_ROW_OUTPUTS
from service.serving.v2 import InferDoor
from service.version import VERSION
from service.wire.codec import dumps
from service.wire.v2_models import EXTENSIONS, MODEL_NAME, MODEL_VERSION, SERVER_NAME

router = APIRouter(tags=["v2"])

HEADER_LENGTH: Final = "Inference-Header-Content-Length"
# Below this, a binary response goes out as one write: each write costs a system call, and
# joining a few kilobytes costs less.
_JOIN_BELOW_BYTES: Final = 64 * 1024

_VARIABLE_4D: Final = [-1, -1, -1, -1]
MODEL_METADATA: Final[dict[str, Any]] = {
    "name": MODEL_NAME,
    "versions": [MODEL_VERSION],
    "platform": "pytorch",
    # One datatype per tensor in the metadata; q, k, v (and a float attn_mask) also take FP16,
    # BF16 (binary data only) and FP64; key_lengths also INT32. Ranks from 2 to 6 are accepted
    # (leading batch dimensions), shown here as the common [B, H, N, D].
    "inputs": [
        {"name": "q", "datatype": "FP32", "shape": _VARIABLE_4D},
        {"name": "k", "datatype": "FP32", "shape": _VARIABLE_4D},
        {"name": "v", "datatype": "FP32", "shape": _VARIABLE_4D},
        {"name": "key_lengths", "datatype": "INT64", "shape": [-1]},
        {"name": "key_padding_mask", "datatype": "BOOL", "shape": [-1, -1]},
        {"name": "attn_mask", "datatype": "BOOL", "shape": _VARIABLE_4D},
    ],
    "outputs": [
        {"name": "output", "datatype": "FP32", "shape": _VARIABLE_4D},
        {"name": "weights", "datatype": "FP32", "shape": _VARIABLE_4D},
        *(
            {
                "name": name,
                "datatype": "INT64" if name == "visible_keys" else "FP32",
                "shape": [-1, -1, -1],
            }
            for name in PER_ROW_OUTPUTS
        ),
        # With diagnostics "summary" or "full": the summary's statistics per head, [B, H].
        *(
            {
                "name": name,
                "datatype": "INT64" if stat == "masked_rows" else "FP32",
                "shape": [-1, -1],
            }
            for name, stat in PER_HEAD_OUTPUTS.items()
        ),
    ],
}


def _json(payload: Any, status_code: int = 200) -> Response:
    return Response(content=dumps(payload), status_code=status_code, media_type="application/json")


def _ok(schema: str, description: str, example: Any) -> dict[str, Any]:
    content = {"application/json": {"schema": json_ref(schema), "example": example}}
    return {"description": description, "content": content}


_NOT_READY = v2_error_doc("Not ready: warming up, or draining on shutdown.", retry_after=True)
_UNAUTHORIZED = v2_error_doc("Missing or invalid API key (when keys are configured).")


# ---- server --------------------------------------------------------------------------------


async def server_metadata() -> Response:
    return _json({"name": SERVER_NAME, "version": VERSION, "extensions": list(EXTENSIONS)})


async def server_live() -> Response:
    return _json({"live": True})


async def server_ready(state: StateDep) -> Response:
    reason = state.not_ready_reason()
    if reason is None:
        return _json({"ready": True})
    return v2_error_response(
        status=503, message=f"not ready: {reason}", headers={"Retry-After": "1"}
    )


router.add_api_route(
    "/v2",
    server_metadata,
    methods=["GET"],
    operation_id="v2_server_metadata",
    summary="Server metadata (v2)",
    responses={
        200: _ok(
            "ServerMetadata",
            "Name, version and protocol extensions.",
            {"name": SERVER_NAME, "version": VERSION, "extensions": list(EXTENSIONS)},
        ),
        401: _UNAUTHORIZED,
    },
)
router.add_api_route(
    "/v2/health/live",
    server_live,
    methods=["GET"],
    operation_id="v2_server_live",
    summary="Liveness (v2)",
    responses={200: _ok("ServerLive", "The process serves HTTP.", {"live": True})},
)
router.add_api_route(
    "/v2/health/ready",
    server_ready,
    methods=["GET"],
    operation_id="v2_server_ready",
    summary="Readiness (v2)",
    responses={
        200: _ok("ServerReady", "Warmed up on the device; accepting work.", {"ready": True}),
        503: _NOT_READY,
    },
)


# ---- the model -----------------------------------------------------------------------------


async def model_metadata() -> Response:
    return _json(MODEL_METADATA)


async def model_ready(state: StateDep) -> Response:
    reason = state.not_ready_reason()
    if reason is None:
        return _json({"name": MODEL_NAME, "ready": True})
    return v2_error_response(
        status=503,
        message=f"model {MODEL_NAME!r} not ready: {reason}",
        headers={"Retry-After": "1"},
    )


class InferResponse(Response):
    """A v2 infer answer: the JSON header alone, or with binary data after it (Triton's
    extension: Inference-Header-Content-Length says where the header ends). Large binary data
    is written from the result tensors' buffers, one write each, never joined."""

    def __init__(self, served: Served[InferAnswer]) -> None:
        answer = served.answer
        self.status_code = 200
        self.background = None
        self.body = answer.header
        headers = {"Server-Timing": served.phases.server_timing()}
        if answer.buffers:
            headers[HEADER_LENGTH] = str(len(answer.header))
            headers["Content-Length"] = str(answer.size)
            self.media_type = "application/octet-stream"
        else:
            self.media_type = "application/json"
        self.init_headers(headers)
        parts: list[bytes | memoryview] = [answer.header, *answer.buffers]
        if answer.size < _JOIN_BELOW_BYTES:
            parts = [b"".join(parts)]
        self._parts = parts

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        await send(
            {"type": "http.response.start", "status": self.status_code, "headers": self.raw_headers}
        )
        last = len(self._parts) - 1
        for i, part in enumerate(self._parts):
            await send({"type": "http.response.body", "body": part, "more_body": i < last})


async def infer(request: Request, state: StateDep) -> Response:
    """Attention on the inputs q, k, v and the optional masks; outputs as named."""
    header_length = request.headers.get(HEADER_LENGTH)

    def door_for(body: bytes) -> InferDoor:
        return InferDoor(body, header_length)

    return await compute.serve_with(request, state, door_for, InferResponse)


_METADATA_DOC: Final[dict[int | str, dict[str, Any]]] = {
    200: _ok("ModelMetadata", "The model's inputs and outputs.", MODEL_METADATA),
    401: _UNAUTHORIZED,
}
_READY_DOC: Final[dict[int | str, dict[str, Any]]] = {
    200: _ok("ModelReady", "The model can infer.", {"name": MODEL_NAME, "ready": True}),
    401: _UNAUTHORIZED,
    503: _NOT_READY,
}
_INFER_DESCRIPTION: Final = (
    "softmax(q kᵀ · scale + mask) · v. Inputs q, k, v (FP16 | BF16 | FP32 | FP64; BF16 as "
    "binary data only), key_lengths (INT32 | INT64), key_padding_mask (BOOL, true = padding), "
    "attn_mask (BOOL, true = attend; or a float datatype, additive). Parameters: causal, scale, "
    "temperature, diagnostics, tag, timeout (µs), priority. Outputs as named in `outputs` "
    "(output, weights, per-row statistics); none named: output (and the per-row statistics "
    "with diagnostics full). With Triton's binary tensor data extension, the JSON header's "
    "length goes in Inference-Header-Content-Length and the inputs' raw little-endian bytes "
    "follow it."
)
_INFER_DOC: Final[dict[int | str, dict[str, Any]]] = {
    200: {
        "description": "The named outputs; response parameters carry meta fields and summary "
        "statistics. With binary outputs the body is the JSON header, then their bytes "
        "(Inference-Header-Content-Length).",
        "content": {
            "application/json": {"schema": json_ref("InferResponse")},
            "application/octet-stream": {"schema": {"type": "string", "format": "binary"}},
        },
    },
    400: v2_error_doc(
        "Invalid request: JSON, fields, inputs, shapes, masks, datatypes, parameters, "
        "non-finite values or limits; the message names the input or parameter."
    ),
    401: _UNAUTHORIZED,
    413: v2_error_doc("Body larger than SDPA_MAX_BODY_BYTES (after inflation)."),
    429: v2_error_doc(
        "Your tenant (API key) holds its share of the queue (SDPA_TENANT_MAX_QUEUE_SHARE); "
        "retry after Retry-After, its own backlog.",
        retry_after=True,
    ),
    503: v2_error_doc("Queue full or shutting down; retry after Retry-After.", retry_after=True),
    504: v2_error_doc("The deadline passed while the request was queued; it was not computed."),
}

for _base in (f"/v2/models/{MODEL_NAME}", f"/v2/models/{MODEL_NAME}/versions/{MODEL_VERSION}"):
    _suffix = "_version" if "versions" in _base else ""
    router.add_api_route(
        _base,
        model_metadata,
        methods=["GET"],
        operation_id=f"v2_model_metadata{_suffix}",
        summary="Model metadata (v2)",
        responses=_METADATA_DOC,
    )
    router.add_api_route(
        f"{_base}/ready",
        model_ready,
        methods=["GET"],
        operation_id=f"v2_model_ready{_suffix}",
        summary="Model readiness (v2)",
        responses=_READY_DOC,
    )
    router.add_api_route(
        f"{_base}/infer",
        infer,
        methods=["POST"],
        operation_id=f"v2_infer{_suffix}",
        summary="Infer (v2)",
        description=_INFER_DESCRIPTION,
        openapi_extra=v2_infer_request_body(),
        responses=_INFER_DOC,
    )
