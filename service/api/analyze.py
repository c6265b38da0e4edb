"""POST /v1/analyze: compare divisors of the raw scores q.k (none, sqrt_dk, dk, ...).

On q and k from the request, or on seeded synthetic ones. The job takes the same queue and device
worker as attention requests (as a group of one), so it counts against the same limits, metrics
and deadlines.
"""

from __future__ import annotations

from fastapi import APIRouter, Request
from starlette.responses import Response

from service.api import compute
from service.api.deps import StateDep
from service.api.openapi import compute_responses, json_ref, request_body
from service.serving.v1 import AnalyzeDoor
from service.wire.models import ANALYZE_EXAMPLE

router = APIRouter()


async def analyze(request: Request, state: StateDep) -> Response:
    """Compare scaling strategies of the raw attention scores."""
    return await compute.serve_with(request, state, AnalyzeDoor, compute.json_answer)


router.add_api_route(
    "/v1/analyze",
    analyze,
    methods=["POST"],
    operation_id="analyze",
    summary="Compare score-scaling strategies",
    description=(
        "How does dividing the raw scores q·k by each divisor shape the softmax? For each "
        "strategy (none, sqrt_dk, dk, dk_quarter, two_sqrt_dk and custom {name, divisor}): "
        "score variance, entropy, normalized entropy, max weight, saturated fraction and "
        "gradient health. Also the raw score variance and the recommended divisor (the std of "
        "the raw scores). Runs on q and k from the request, or on seeded synthetic data."
    ),
    openapi_extra=request_body("AnalyzeRequest", ANALYZE_EXAMPLE),
    responses=compute_responses(json_ref("AnalyzeResponse"), "The scaling report."),
    tags=["analysis"],
)
