"""A catalogue of bad requests against the app (in process).

Each one gets the right 4xx as application/problem+json, with an `errors[].loc` naming the field
at fault, and the server keeps answering /healthz. Limits come from API_SERVER_ENV (body 1 MiB,
65,536 elements per tensor and in the weights).
"""

from __future__ import annotations

import base64
import json
from dataclasses import dataclass
from typing import Any

import httpx
import jsonschema  # type: ignore[import-untyped]
import numpy as np
import pytest

from tests.support.app import API_SERVER_ENV

MAX_BODY = int(API_SERVER_ENV["SDPA_MAX_BODY_BYTES"])
Q = [[1.0, 0.0], [0.0, 1.0], [1.0, 1.0]]  # [N=3, D=2]
OK: dict[str, Any] = {"q": Q, "k": Q, "v": Q}


def b64(values: Any, dtype: str = "<f4") -> str:
    return base64.b64encode(np.asarray(values, dtype=dtype).tobytes()).decode()


def t32(values: Any) -> dict[str, Any]:
    arr = np.asarray(values, dtype="<f4")
    return {"dtype": "float32", "shape": list(arr.shape), "b64": b64(arr)}


def with_(**fields: Any) -> dict[str, Any]:
    return {**OK, **fields}


@dataclass(frozen=True)
class Bad:
    id: str
    status: int
    loc: tuple[str | int, ...] | None  # None: the error is not about a field (404, 405)
    json: Any = None
    content: bytes | None = None
    headers: dict[str, str] | None = None
    path: str = "/v1/attention"
    method: str = "POST"


NAN = t32([[float("nan"), 0.0], [0.0, 1.0], [1.0, 1.0]])
INF_K = t32([[float("inf"), 0.0], [0.0, 1.0], [1.0, 1.0]])
Q4 = np.zeros((1, 2, 3, 2)).tolist()  # [B=1, H=2, N=3, D=2]
BIG_QK = np.zeros((1, 2, 256, 4), dtype="<f4")  # 2 x 256 x 256 weights > 65,536

CATALOGUE = [
    Bad("malformed-json", 422, ("body",), content=b'{"q": [[1.0, 2.0]'),
    Bad("body-not-an-object", 422, ("body",), json=[1, 2, 3]),
    Bad("empty-body", 422, ("body",), content=b""),
    Bad("nan-literal-is-not-json", 422, ("body",), content=b'{"q": [[NaN]]}'),
    Bad("number-overflowing-double", 422, ("body", "q"),
        content=b'{"q": [[1e999, 0]], "k": [[1.0, 0]], "v": [[1.0, 0]]}'),
    Bad("wrong-content-type", 415, ("header", "content-type"), content=b"{}",
        headers={"content-type": "text/plain"}),
    Bad("form-content-type", 415, ("header", "content-type"), content=b"q=1",
        headers={"content-type": "application/x-www-form-urlencoded"}),
    Bad("missing-q", 422, ("body", "q"), json={"k": Q, "v": Q}),
    Bad("q-not-a-tensor", 422, ("body", "q"), json=with_(q="abc")),
    Bad("ragged-list", 422, ("body", "q"), json=with_(q=[[1.0, 2.0], [3.0]])),
    Bad("ragged-data", 422, ("body", "k", "data"),
        json=with_(k={"dtype": "float32", "data": [[1.0], [2.0, 3.0]]})),
    Bad("strings-in-data", 422, ("body", "v", "data"),
        json=with_(v={"dtype": "float32", "data": [["a", "b"]]})),
    Bad("wrong-rank-1d", 422, ("body", "q"), json=with_(q=[1.0, 2.0])),
    Bad("rank-mismatch", 422, ("body", "k"), json=with_(k=[Q])),
    Bad("d-mismatch", 422, ("body", "k"), json=with_(k=[[1.0, 0.0, 0.0]] * 3)),
    Bad("n-kv-mismatch", 422, ("body", "v"), json=with_(v=Q[:2])),
    Bad("heads-not-multiple", 422, ("body", "k"),
        json={"q": np.zeros((1, 3, 3, 2)).tolist(), "k": Q4, "v": Q4}),
    Bad("unknown-dtype", 422, ("body", "q", "dtype"),
        json=with_(q={"dtype": "float8", "shape": [3, 2], "data": Q})),
    Bad("bool-q", 422, ("body", "q", "dtype"),
        json=with_(q={"dtype": "bool", "data": [[True, False]] * 3})),
    Bad("dtype-mismatch", 422, ("body", "k"),
        json=with_(k={"dtype": "float64", "shape": [3, 2], "data": Q})),
    Bad("shape-disagrees-with-data", 422, ("body", "q", "shape"),
        json=with_(q={"dtype": "float32", "shape": [2, 3], "data": Q})),
    Bad("b64-wrong-length", 422, ("body", "q", "b64"),
        json=with_(q={"dtype": "float32", "shape": [3, 2], "b64": b64([1.0] * 5)})),
    Bad("b64-invalid", 422, ("body", "q", "b64"),
        json=with_(q={"dtype": "float32", "shape": [3, 2], "b64": "not*base64!"})),
    Bad("b64-without-shape", 422, ("body", "q"),
        json=with_(q={"dtype": "float32", "b64": b64(Q)})),
    Bad("data-and-b64", 422, ("body", "q"),
        json=with_(q={"dtype": "float32", "shape": [3, 2], "data": Q, "b64": b64(Q)})),
    Bad("nan-in-q", 422, ("body", "q"), json=with_(q=NAN)),
    Bad("inf-in-k", 422, ("body", "k"), json=with_(k=INF_K)),
    Bad("float32-overflow-in-list", 422, ("body", "v"), json=with_(v=[[1e39, 0.0]] * 3)),
    Bad("empty-tensor", 422, ("body", "q"), json=with_(q=[])),
    Bad("empty-dimension", 422, ("body", "q"), json=with_(q=[[], [], []])),
    Bad("key-lengths-too-long", 422, ("body", "key_lengths"),
        json={"q": Q4, "k": Q4, "v": Q4, "key_lengths": [4]}),
    Bad("key-lengths-negative", 422, ("body", "key_lengths"),
        json={"q": Q4, "k": Q4, "v": Q4, "key_lengths": [-1]}),
    Bad("key-lengths-wrong-count", 422, ("body", "key_lengths"),
        json={"q": Q4, "k": Q4, "v": Q4, "key_lengths": [1, 2, 3]}),
    Bad("key-lengths-not-integers", 422, ("body", "key_lengths"),
        json={"q": Q4, "k": Q4, "v": Q4, "key_lengths": [1.5]}),
    Bad("key-padding-mask-wrong-shape", 422, ("body", "key_padding_mask"),
        json={"q": Q4, "k": Q4, "v": Q4, "key_padding_mask": [[True, False]]}),
    Bad("key-padding-mask-float", 422, ("body", "key_padding_mask", "dtype"),
        json={"q": Q4, "k": Q4, "v": Q4,
              "key_padding_mask": {"dtype": "float32", "data": [[0.0, 1.0, 0.0]]}}),
    Bad("key-padding-mask-bad-bool-bytes", 422, ("body", "key_padding_mask", "b64"),
        json={"q": Q4, "k": Q4, "v": Q4, "key_padding_mask":
              {"dtype": "bool", "shape": [1, 3], "b64": b64([0, 7, 1], "u1")}}),
    Bad("key-padding-mask-numbers", 422, ("body", "key_padding_mask"),
        json={"q": Q4, "k": Q4, "v": Q4, "key_padding_mask": [[0.0, 1.0, 0.0]]}),
    Bad("key-padding-mask-bool-with-numbers", 422, ("body", "key_padding_mask", "data"),
        json={"q": Q4, "k": Q4, "v": Q4,
              "key_padding_mask": {"dtype": "bool", "data": [[0, 1, 0]]}}),
    Bad("scalar-data", 422, ("body", "q", "data"),
        json=with_(q={"dtype": "float32", "data": 0})),
    Bad("scalar-attn-mask-bias", 422, ("body", "attn_mask", "data"),
        json=with_(attn_mask={"dtype": "float32", "data": 0})),
    Bad("scalar-attn-mask-bool", 422, ("body", "attn_mask", "data"),
        json=with_(attn_mask={"dtype": "bool", "data": True})),
    Bad("scalar-key-padding-mask", 422, ("body", "key_padding_mask", "data"),
        json=with_(key_padding_mask={"dtype": "bool", "data": False})),
    Bad("zero-d-b64-attn-mask", 422, ("body", "attn_mask", "shape"),
        json=with_(attn_mask={"dtype": "float32", "shape": [], "b64": b64(0.0)})),
    Bad("attn-mask-wrong-shape", 422, ("body", "attn_mask"),
        json=with_(attn_mask=[[True, False]] * 2)),
    Bad("attn-mask-wrong-dtype", 422, ("body", "attn_mask"),
        json=with_(attn_mask={"dtype": "float16", "data": [[0.0] * 3] * 3})),
    Bad("unknown-causal", 422, ("body", "causal"), json=with_(causal="diagonal")),
    Bad("causal-as-number", 422, ("body", "causal"), json=with_(causal=1)),
    Bad("scale-not-finite", 422, ("body", "scale"), json=with_(scale="inf")),
    Bad("return-weights-not-bool", 422, ("body", "return_weights"),
        json=with_(return_weights="yes")),
    Bad("unknown-diagnostics", 422, ("body", "diagnostics"), json=with_(diagnostics="all")),
    Bad("unknown-response-encoding", 422, ("body", "response_encoding"),
        json=with_(response_encoding="xml")),
    Bad("timeout-not-positive", 422, ("body", "timeout_ms"), json=with_(timeout_ms=-5)),
    Bad("typo-casual", 422, ("body", "casual"), json=with_(casual=True)),
    Bad("unknown-tensor-field", 422, ("body", "q", "bytes"),
        json=with_(q={"dtype": "float32", "data": Q, "bytes": "x"})),
    Bad("elements-over-limit", 422, ("body", "q", "shape"),
        json=with_(q={"dtype": "float32", "shape": [70_000, 1], "b64": b64(np.zeros(70_000))})),
    Bad("shape-extent-over-limit", 422, ("body", "q", "shape"),
        json=with_(q={"dtype": "float32", "shape": [0, 2**62], "b64": ""})),
    # A dimension past int64 is refused by the schema: 3,000-digit dimensions multiplied to a
    # count that Python refused to print (a 500).
    Bad("dimension-past-int64", 422, ("body", "q", "shape", 1),
        content=b'{"q": {"dtype": "float32", "shape": [1, 1%s, 1%s], "b64": ""}, "k": [[1.0]],'
                b' "v": [[1.0]]}' % (b"0" * 3000, b"0" * 3000)),
    Bad("finite-inputs-overflowing-the-scores", 422, ("body", "scale"),
        json={"q": [[1e20, 1e20]], "k": [[1e20, 1e20]], "v": [[1.0, 2.0]]}),
    Bad("weights-over-limit", 422, ("body", "return_weights"),
        json={"q": t32(BIG_QK), "k": t32(BIG_QK), "v": t32(BIG_QK), "return_weights": True}),
    Bad("body-over-limit", 413, ("body",), content=b'{"q": [' + b"0.0," * (MAX_BODY // 4) + b"0]}"),
    Bad("analyze-without-inputs", 422, ("body",), path="/v1/analyze", json={}),
    Bad("analyze-both-sources", 422, ("body",), path="/v1/analyze",
        json={"q": Q, "k": Q, "synthetic": {"n_q": 4, "n_k": 4, "d_k": 4}}),
    Bad("analyze-unknown-strategy", 422, ("body", "strategies", 0), path="/v1/analyze",
        json={"q": Q, "k": Q, "strategies": ["sqrt"]}),
    Bad("analyze-zero-divisor", 422, ("body", "strategies", 1, "divisor"), path="/v1/analyze",
        json={"q": Q, "k": Q, "strategies": ["dk", {"name": "zero", "divisor": 0}]}),
    Bad("analyze-synthetic-over-limit", 422, ("body", "synthetic", "n_q"), path="/v1/analyze",
        json={"synthetic": {"n_q": 4096, "n_k": 4, "d_k": 64}}),
    Bad("analyze-scores-over-limit", 422, ("body", "synthetic"), path="/v1/analyze",
        json={"synthetic": {"n_q": 512, "n_k": 512, "d_k": 4}}),
    Bad("analyze-synthetic-overflows-float16", 422, ("body", "synthetic", "std"),
        path="/v1/analyze",
        json={"synthetic": {"n_q": 4, "n_k": 4, "d_k": 4, "std": 1e6, "dtype": "float16"}}),
    Bad("analyze-d-mismatch", 422, ("body", "k"), path="/v1/analyze",
        json={"q": Q, "k": [[1.0, 0.0, 0.0]]}),
    Bad("unknown-path", 404, None, path="/v1/attend", json=OK),
    Bad("wrong-method", 405, None, method="GET"),
    Bad("put-on-a-get-route", 405, None, path="/healthz", method="PUT"),
    Bad("patch-text-on-a-get-route", 405, None, path="/v1/info", method="PATCH", content=b"x",
        headers={"content-type": "text/plain"}),
    Bad("post-form-on-a-get-route", 405, None, path="/readyz", method="POST", content=b"q=1",
        headers={"content-type": "application/x-www-form-urlencoded"}),
]  # fmt: skip


def test_the_catalogue_is_large_and_distinct() -> None:
    assert len(CATALOGUE) >= 30
    assert len({bad.id for bad in CATALOGUE}) == len(CATALOGUE)


@pytest.mark.parametrize("bad", CATALOGUE, ids=[bad.id for bad in CATALOGUE])
def test_bad_request_gets_a_located_problem(client: httpx.Client, bad: Bad) -> None:
    if bad.content is not None:
        headers = {"content-type": "application/json", **(bad.headers or {})}
        response = client.request(bad.method, bad.path, content=bad.content, headers=headers)
    elif bad.method == "GET":
        response = client.get(bad.path)
    else:
        response = client.request(bad.method, bad.path, json=bad.json, headers=bad.headers)
    assert response.status_code == bad.status, response.text
    assert response.headers["content-type"] == "application/problem+json"
    problem = response.json()
    assert problem["status"] == bad.status
    assert problem["title"]
    assert problem["detail"]
    if bad.loc is not None:
        locs = [tuple(err["loc"]) for err in problem["errors"]]
        assert tuple(bad.loc) in locs, problem
        assert all(err["msg"] for err in problem["errors"])
    assert "Traceback" not in response.text
    assert client.get("/healthz").status_code == 200


def test_problem_bodies_are_json_with_the_envelope(client: httpx.Client) -> None:
    response = client.post("/v1/attention", json=with_(casual=True, scale="x"))
    problem = response.json()
    assert set(problem) == {"type", "title", "status", "detail", "errors"}
    assert {tuple(e["loc"]) for e in problem["errors"]} == {("body", "casual"), ("body", "scale")}
    json.dumps(problem)  # plain JSON all the way down


# ---- the documented schema and the server agree --------------------------------------------


def documented(doc: dict[str, Any], name: str) -> jsonschema.Draft202012Validator:
    """A validator of the served document's `name` schema (its $refs resolved in the doc)."""
    root = {"$ref": f"#/components/schemas/{name}", "components": doc["components"]}
    return jsonschema.Draft202012Validator(root)


@pytest.mark.parametrize("path", ["/v1/attention", "/v1/analyze"])
def test_the_documented_key_padding_mask_is_what_the_server_takes(
    client: httpx.Client, path: str
) -> None:
    doc = client.get("/openapi.json").json()
    schema = documented(doc, "AttentionRequest" if path == "/v1/attention" else "AnalyzeRequest")
    base: dict[str, Any] = (
        {"q": Q4, "k": Q4} if path == "/v1/analyze" else {"q": Q4, "k": Q4, "v": Q4}
    )
    numbers: list[Any] = [[[0.0, 1.0, 0.0]], {"dtype": "float32", "data": [[0.0, 1.0, 0.0]]}]
    for mask in numbers:
        body = {**base, "key_padding_mask": mask}
        assert not schema.is_valid(body), mask  # the schema says bool only ...
        assert client.post(path, json=body).status_code == 422  # ... as the server enforces
    booleans: list[Any] = [
        [[False, False, True]],
        {"dtype": "bool", "data": [[False, False, True]]},
    ]
    for mask in booleans:
        body = {**base, "key_padding_mask": mask}
        assert schema.is_valid(body), mask
        assert client.post(path, json=body).status_code == 200, mask


def test_scalar_tensor_data_is_documented_and_refused(client: httpx.Client) -> None:
    schema = documented(client.get("/openapi.json").json(), "AttentionRequest")
    for field, tensor in (("q", {"dtype": "float32", "data": 0}),
                          ("attn_mask", {"dtype": "float32", "data": 0}),
                          ("attn_mask", {"dtype": "bool", "data": True}),
                          ("key_padding_mask", {"dtype": "bool", "data": True})):  # fmt: skip
        body = with_(**{field: tensor})
        assert not schema.is_valid(body)
        response = client.post("/v1/attention", json=body)
        assert response.status_code == 422, response.text
        assert [tuple(e["loc"]) for e in response.json()["errors"]] == [("body", field, "data")]


@pytest.mark.parametrize("method", ["PUT", "PATCH", "DELETE", "POST"])
@pytest.mark.parametrize("path", ["/healthz", "/readyz", "/v1/info", "/metrics"])
@pytest.mark.parametrize("content_type", [None, "text/plain", "application/json"])
def test_a_method_the_route_lacks_is_405_with_allow(
    client: httpx.Client, method: str, path: str, content_type: str | None
) -> None:
    # Routing answers before the content type matters: not a 415 for a request that no route
    # would take.
    headers = {"content-type": content_type} if content_type else {}
    response = client.request(method, path, content=b"{}" if content_type else None,
                              headers=headers)  # fmt: skip
    assert response.status_code == 405, response.text
    assert "GET" in response.headers["allow"]
    assert response.headers["content-type"] == "application/problem+json"
    assert response.json()["status"] == 405


def test_a_compute_route_still_wants_json_and_bodies_are_still_limited(
    client: httpx.Client,
) -> None:
    for method in ("POST", "PUT"):
        response = client.request(method, "/v1/attention", content=b"{}",
                                  headers={"content-type": "text/plain"})  # fmt: skip
        # POST is the route's own method: 415. PUT is not: 405, as on any route.
        assert response.status_code == (415 if method == "POST" else 405), response.text
    # The limit comes before routing, whatever the method, path and content type.
    big = b"x" * (MAX_BODY + 1)
    for method, path, content_type in (
        ("POST", "/v1/attention", "application/json"),
        ("PUT", "/healthz", "application/json"),
        ("PUT", "/healthz", "text/plain"),
        ("POST", "/nowhere", "text/plain"),
    ):
        response = client.request(method, path, content=big, headers={"content-type": content_type})
        assert response.status_code == 413, (method, path, response.text)
