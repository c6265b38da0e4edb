"""The app's own OpenAPI document against the running server, driven by schemathesis.

Over 1,000 generated requests across every documented operation (valid and schema-violating
bodies), then schemathesis' coverage cases (boundary values, each property's type mutated, and
every HTTP method an operation lacks): no response is a 5xx, every response's status, content
type, headers and body conform to what the document says (problem+json included), a body the
schema forbids is refused, a method a path lacks is a 405 with Allow, and a field whose schema
states its dtype exactly is never refused for its dtype.

positive_data_acceptance is left out on purpose: the schema cannot express what ties tensors
together (q's and k's D, the heads, a mask's broadcast), so a schema-valid body is often, and
rightly, a 422. documented_dtypes_are_accepted checks the part of it that the schema does state.
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
from schemathesis.checks import CheckContext
from schemathesis.core.transport import Response

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
    # What the schema forbids is refused: {"dtype": ..., "data": 0} where data must be an array.
    "negative_data_rejection",
    # A method the path lacks (PUT /healthz) is a 405 with Allow, not a 415 for its content type
    # (the coverage cases send those).
    "unsupported_method",
)
# Fields whose schema states their dtype exactly: a key padding mask is bool only, as a bool
# tensor object or a nested list of booleans.
EXACT_DTYPE_FIELDS = frozenset({"key_padding_mask"})
# The error types of a refused dtype or element type (service.wire.codec, service.wire.models).
DTYPE_ERRORS = frozenset({"dtype", "type"})


def documented_dtypes_are_accepted(
    ctx: CheckContext, response: Response, case: schemathesis.Case[Any]
) -> bool | None:
    """A schema-valid body is never refused for the dtype of a field the schema types exactly."""
    meta = case.meta
    if meta is None or not meta.generation.mode.is_positive or response.status_code != 422:
        return None
    errors = response.json().get("errors", [])
    refused = [
        err
        for err in errors
        if err.get("type") in DTYPE_ERRORS
        and len(err.get("loc", ())) > 1
        and err["loc"][1] in EXACT_DTYPE_FIELDS
    ]
    assert not refused, f"the schema allows what the server refuses: {refused}"
    return None


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
        # v2's deadline parameter, in microseconds (0: the server's default).
        params = body.get("parameters")
        timeout_us = params.get("timeout") if isinstance(params, dict) else None
        if (
            isinstance(params, dict)
            and isinstance(timeout_us, int)
            and not isinstance(timeout_us, bool)
            and 1 <= timeout_us < 1_000_000
        ):
            params["timeout"] = 1_000_000


def _checks() -> list[Any]:
    return [getattr(schemathesis.checks, name) for name in CHECK_NAMES] + [
        documented_dtypes_are_accepted
    ]


def test_schema_driven_requests_conform(api_server: LiveServer) -> None:
    schema = schemathesis.openapi.from_url(f"{api_server.url}/openapi.json")
    checks = _checks()
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
        "GET /v2",
        "GET /v2/health/ready",
        "GET /v2/models/attention",
        "GET /v2/models/attention/ready",
        "POST /v2/models/attention/infer",
        "POST /v2/models/attention/versions/1/infer",
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


def test_coverage_cases_conform(api_server: LiveServer) -> None:
    """schemathesis' coverage phase, which sends what random generation rarely does: every method
    an operation lacks, each property's type mutated (a scalar where an array is due), boundary
    values."""
    schema = schemathesis.openapi.from_url(f"{api_server.url}/openapi.json")
    checks = _checks()
    methods: Counter[str] = Counter()
    statuses: Counter[int] = Counter()
    for result in schema.get_all_operations():
        operation = result.ok()  # type: ignore[union-attr]
        cases = operation.schema.iter_coverage_cases(
            operation,
            generation_modes=[GenerationMode.POSITIVE, GenerationMode.NEGATIVE],
            generation_config=schema.config.generation_for(operation=operation, phase="coverage"),
        )
        for case in cases:
            _no_instant_deadline(case)
            response = case.call_and_validate(base_url=api_server.url, checks=checks)
            methods[case.method.upper()] += 1
            statuses[response.status_code] += 1
    # Each GET route was sent the body methods it lacks, each POST route GET, PUT and PATCH.
    assert {"GET", "PUT", "PATCH", "POST", "DELETE"} <= set(methods), methods
    assert statuses[405] >= 4 * 4, statuses  # PUT, PATCH, POST, DELETE on each GET route
    assert statuses[200] > 0
    assert statuses[422] > 0
    assert not [s for s in statuses if s >= 500], statuses
