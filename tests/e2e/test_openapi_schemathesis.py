"""The app's own OpenAPI document against the running server, driven by schemathesis.

Over 1,000 generated requests across every documented operation (valid and schema-violating
bodies): no response is a 5xx, and every response's status, content type, headers and body
conform to what the document says (problem+json included).
"""

from __future__ import annotations

from collections import Counter
from typing import Any

import pytest
import schemathesis
import schemathesis.checks
from hypothesis import HealthCheck, Phase, settings
from hypothesis import given as hyp_given
from schemathesis import GenerationMode

from tests.support.live_server import LiveServer

pytestmark = [pytest.mark.xdist_group("api_server"), pytest.mark.slow]

# Requests per operation and generation mode. Operations without inputs yield one distinct case
# and stop early; the bodies of the three POST operations carry the count. Valid-by-schema bodies
# are cheaper to generate than invalid ones, and reach the compute.
EXAMPLES = {GenerationMode.POSITIVE: 270, GenerationMode.NEGATIVE: 70}
MIN_TOTAL = 1000
CHECK_NAMES = (
    "not_a_server_error",
    "status_code_conformance",
    "content_type_conformance",
    "response_headers_conformance",
    "response_schema_conformance",
)


def _no_instant_deadline(case: schemathesis.Case[Any]) -> None:
    # A valid timeout_ms of a few milliseconds legitimately ends in a 504 on a busy machine:
    # lift such deadlines to one second, still exercising the field.
    body = case.body
    if isinstance(body, dict):
        timeout = body.get("timeout_ms")
        if (
            isinstance(timeout, int | float)
            and not isinstance(timeout, bool)
            and 1 <= timeout < 1000
        ):
            body["timeout_ms"] = 1000


def test_schema_driven_requests_conform(api_server: LiveServer) -> None:
    schema = schemathesis.openapi.from_url(f"{api_server.url}/openapi.json")
    checks = [getattr(schemathesis.checks, name) for name in CHECK_NAMES]
    calls: Counter[str] = Counter()
    statuses: Counter[int] = Counter()
    operations = [result.ok() for result in schema.get_all_operations()]  # type: ignore[union-attr]
    assert {op.label for op in operations} >= {
        "POST /v1/attention",
        "POST /attention",
        "POST /v1/analyze",
        "GET /healthz",
        "GET /readyz",
        "GET /v1/info",
        "GET /metrics",
    }
    for operation in operations:
        for mode in (GenerationMode.POSITIVE, GenerationMode.NEGATIVE):
            if mode is GenerationMode.NEGATIVE and operation.method.upper() == "GET":
                continue  # nothing to make invalid: these operations take no input

            @settings(
                max_examples=EXAMPLES[mode],
                deadline=None,
                database=None,
                derandomize=True,
                phases=[Phase.explicit, Phase.generate],
                suppress_health_check=list(HealthCheck),
            )
            @hyp_given(case=operation.as_strategy(generation_mode=mode))
            def call(case: schemathesis.Case[Any]) -> None:
                _no_instant_deadline(case)
                response = case.call_and_validate(base_url=api_server.url, checks=checks)
                calls[case.operation.label] += 1
                statuses[response.status_code] += 1

            call()
    total = sum(calls.values())
    assert total >= MIN_TOTAL, (total, calls)
    # The generated traffic reached the compute as well as the validation.
    assert statuses[200] > 0
    assert statuses[422] > 0
    assert not [s for s in statuses if s >= 500], statuses
