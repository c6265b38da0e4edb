"""POST /v1/attention (and its alias POST /attention): read, call serving, answer.

The route reads the raw body and leaves parsing to service.serving (pydantic_core on the bytes,
numpy for tensors): FastAPI's body-parameter machinery would walk every tensor element through
pydantic. The OpenAPI document still describes the body, by $ref (service.api.openapi).
"""

from __future__ import annotations

from typing import Final

from fastapi import APIRouter, Request
from starlette.responses import Response

from service.api import compute
from service.api.deps import StateDep
from service.api.openapi import compute_responses, json_ref, request_body
from service.serving.v1 import AttentionDoor
from service.wire.models import ATTENTION_EXAMPLE

router = APIRouter()


async def attention(request: Request, state: StateDep) -> Response:
    """Scaled dot-product attention, with optional weights and diagnostics."""
    return await compute.serve_with(request, state, AttentionDoor, compute.json_answer)


ATTENTION_SUMMARY: Final = "Scaled dot-product attention"
ATTENTION_DESCRIPTION: Final = (
    "softmax(q kᵀ · scale + mask) · v over q [..., H, N_q, D], k [..., H_kv, N_kv, D], "
    "v [..., H_kv, N_kv, D_v]. Tensors travel as {dtype, shape, data} (nested lists), "
    "{dtype, shape, b64} (little-endian bytes, the fast path) or a bare nested list. "
    "Masks combine by logical AND: causal, key_lengths, key_padding_mask (True = padding), "
    "attn_mask (bool True = attend, or an additive float bias). A fully masked row yields "
    "zeros. The Server-Timing header splits the server's time into read, decode, queue, "
    "compute, dispatch and encode."
)


for _path, _operation_id, _summary in (
    ("/v1/attention", "attention", ATTENTION_SUMMARY),
    ("/attention", "attention_alias", "Alias of POST /v1/attention"),
):
    router.add_api_route(
        _path,
        attention,
        methods=["POST"],
        operation_id=_operation_id,
        summary=_summary,
        description=ATTENTION_DESCRIPTION,
        openapi_extra=request_body("AttentionRequest", ATTENTION_EXAMPLE),
        responses=compute_responses(json_ref("AttentionResponse"), "The attention result."),
        tags=["attention"],
    )
