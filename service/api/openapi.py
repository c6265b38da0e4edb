"""The OpenAPI document: response documentation shared by the routes, and the document itself.

The hot routes read their bodies raw (FastAPI's body machinery would validate megabytes of
tensor lists through pydantic), so they declare their request bodies by $ref, and the document
adds the wire models' schemas to its components.
"""

from __future__ import annotations

from collections.abc import Iterable, Mapping
from typing import Any, Final

from fastapi import FastAPI
from fastapi.openapi.utils import get_openapi
from pydantic.json_schema import models_json_schema

from service.wire.models import REQUEST_MODELS, RESPONSE_MODELS
from service.wire.observe import OBSERVE_REQUEST_MODELS, OBSERVE_RESPONSE_MODELS
from service.wire.v2_models import V2_REQUEST_MODELS, V2_RESPONSE_MODELS


def json_ref(name: str) -> dict[str, str]:
    """A reference to a schema in the OpenAPI document's components."""
    return {"$ref": f"#/components/schemas/{name}"}


def problem_doc(description: str, *, retry_after: bool = False) -> dict[str, Any]:
    """An OpenAPI response whose body is problem+json."""
    doc: dict[str, Any] = {
        "description": description,
        "content": {"application/problem+json": {"schema": json_ref("Problem")}},
    }
    if retry_after:
        doc["headers"] = {
            "Retry-After": {
                "description": "Seconds after which a retry may succeed.",
                "schema": {"type": "integer", "minimum": 1},
            }
        }
    return doc


def v2_error_doc(description: str, *, retry_after: bool = False) -> dict[str, Any]:
    """An OpenAPI response of the v2 routes, whose errors are {"error": "..."}."""
    doc = problem_doc(description, retry_after=retry_after)
    doc["content"] = {"application/json": {"schema": json_ref("InferError")}}
    return doc


def v2_infer_request_body() -> dict[str, Any]:
    """openapi_extra of v2 infer: a JSON body, or a JSON header followed by binary data."""
    example = {
        "inputs": [
            {"name": name, "shape": [1, 2, 2], "datatype": "FP32",
             "data": [1.0, 0.0, 0.0, 1.0]}
            for name in ("q", "k", "v")
        ],
        "parameters": {"causal": True, "diagnostics": "summary"},
        "outputs": [{"name": "output"}],
    }  # fmt: skip
    return {
        "requestBody": {
            "required": True,
            "content": {
                "application/json": {"schema": json_ref("InferRequest"), "example": example}
            },
        }
    }


UNAUTHORIZED_DOC: Final = problem_doc("Missing or invalid API key (when keys are configured).")


def compute_responses(ok_schema: Mapping[str, Any], ok_description: str) -> dict[int | str, Any]:
    """Responses of a compute route (POST /v1/attention, /v1/analyze)."""
    return {
        200: {
            "description": ok_description,
            "content": {"application/json": {"schema": ok_schema}},
        },
        401: UNAUTHORIZED_DOC,
        413: problem_doc("Body larger than SDPA_MAX_BODY_BYTES (refused while it streams in)."),
        415: problem_doc("The body is not declared as JSON (Content-Type: application/json)."),
        422: problem_doc(
            "Invalid request: JSON, fields, shapes, masks, dtypes, non-finite values or limits; "
            "errors[].loc names the field."
        ),
        429: problem_doc(
            "Your tenant (API key) holds its share of the queue (SDPA_TENANT_MAX_QUEUE_SHARE); "
            "retry after Retry-After, its own backlog.",
            retry_after=True,
        ),
        503: problem_doc("Queue full or shutting down; retry after Retry-After.", retry_after=True),
        504: problem_doc("The deadline passed while the request was queued; it was not computed."),
    }


def request_body(schema: str, example: Mapping[str, Any]) -> dict[str, Any]:
    """openapi_extra of a route that reads its JSON body raw: the body's schema by $ref."""
    return {
        "requestBody": {
            "required": True,
            "content": {"application/json": {"schema": json_ref(schema), "example": example}},
        }
    }


def openapi_document(app: FastAPI, *, auth: bool, open_paths: Iterable[str] = ()) -> dict[str, Any]:
    """FastAPI's document plus our wire schemas (the hot routes declare their bodies by $ref).

    With `auth`, every operation needs a key but those under `open_paths` (the probes).
    """
    if app.openapi_schema:
        return app.openapi_schema
    schema = get_openapi(
        title=app.title, version=app.version, description=app.description, routes=app.routes
    )
    _, defs = models_json_schema(
        [
            (model, "validation")
            for model in (*REQUEST_MODELS, *V2_REQUEST_MODELS, *OBSERVE_REQUEST_MODELS)
        ]
        + [
            (model, "serialization")
            for model in (*RESPONSE_MODELS, *V2_RESPONSE_MODELS, *OBSERVE_RESPONSE_MODELS)
        ],
        ref_template="#/components/schemas/{model}",
    )
    components = schema.setdefault("components", {})
    components.setdefault("schemas", {}).update(defs.get("$defs", {}))
    if auth:
        components["securitySchemes"] = {
            "bearer": {"type": "http", "scheme": "bearer"},
            "apiKey": {"type": "apiKey", "in": "header", "name": "X-API-Key"},
        }
        schema["security"] = [{"bearer": []}, {"apiKey": []}]
        for path in open_paths:
            for operation in schema["paths"].get(path, {}).values():
                operation["security"] = []
    app.openapi_schema = schema
    return schema
