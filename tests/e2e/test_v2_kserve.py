"""KServe's own Python SDK (kserve 0.21, unchanged) against a real `sdpa-service serve` on
loopback: InferenceRESTClient with JSON and with binary tensors, and InferenceGRPCClient on the
gRPC door (SDPA_GRPC_PORT, a free port here).

KServe's REST client puts `id` and `model_name` in every v2 body (InferRequest.to_rest): the
server takes them where they name this model, refuses another model by name (400 on REST,
NOT_FOUND on gRPC) and still refuses a typo. The truth is the float64 reference of
tests/core/reference.py (tests.support.v2_cases). API keys are configured: every call carries one.
"""

from __future__ import annotations

import asyncio
from collections.abc import Iterator
from typing import Any

import grpc
import httpx
import numpy as np
import pytest

from tests.support.app import API_SERVER_ENV
from tests.support.live_server import LiveServer, free_port, live_server
from tests.support.v2_cases import Case, assert_close, expected, make_case, mask_cases

kserve = pytest.importorskip("kserve")
infer_type = pytest.importorskip("kserve.protocol.infer_type")

pytestmark = pytest.mark.xdist_group("v2-kserve")

API_KEY = "v2-kserve-key"
AUTH = {"Authorization": f"Bearer {API_KEY}"}
GRPC_AUTH = (("authorization", f"Bearer {API_KEY}"),)


class Door:
    """A live server: its HTTP base URL and its gRPC target."""

    def __init__(self, server: LiveServer, grpc_port: int) -> None:
        self.server = server
        self.url = server.url
        self.target = f"127.0.0.1:{grpc_port}"


@pytest.fixture(scope="module")
def door(tmp_path_factory: pytest.TempPathFactory) -> Iterator[Door]:
    port = free_port()
    env = {**API_SERVER_ENV, "SDPA_API_KEYS": API_KEY, "SDPA_GRPC_PORT": str(port)}
    with live_server(env, tmp_path=tmp_path_factory.mktemp("v2-kserve")) as server:
        yield Door(server, port)


def kserve_request(
    case: Case, *, binary: bool, outputs: tuple[str, ...], binary_outputs: bool = False
) -> Any:
    """The case as KServe's InferRequest, as its users build one."""
    inputs = []
    for name, array, datatype in case.inputs():
        tensor = kserve.InferInput(name=name, shape=list(array.shape), datatype=datatype)
        tensor.set_data_from_numpy(array, binary_data=binary)
        inputs.append(tensor)
    requested = [
        infer_type.RequestedOutput(
            name, parameters={"binary_data": True} if binary_outputs else None
        )
        for name in outputs
    ]
    return kserve.InferRequest(
        model_name="attention",
        infer_inputs=inputs,
        request_outputs=requested or None,
        parameters=case.request_parameters() or None,
    )


def rest_infer(door: Door, request: Any) -> Any:
    async def call() -> Any:
        client = kserve.InferenceRESTClient(kserve.RESTConfig(protocol="v2", timeout=60))
        try:
            # A copy: for binary data the client writes its header-length header into the
            # caller's dict (kserve 0.21, InferenceRESTClient.infer), and the next JSON call
            # would carry it.
            headers = dict(AUTH)
            return await client.infer(door.url, request, model_name="attention", headers=headers)
        finally:
            await client.close()

    return asyncio.run(call())


def grpc_infer(door: Door, request: Any) -> Any:
    async def call() -> Any:
        client = kserve.InferenceGRPCClient(door.target, timeout=60)
        try:
            return await client.infer(request, headers=GRPC_AUTH)
        finally:
            await client.close()

    return asyncio.run(call())


def outputs_of(response: Any) -> dict[str, np.ndarray]:
    return {output.name: output.as_numpy() for output in response.outputs}


def check(case: Case, got: dict[str, np.ndarray], datatype: str) -> None:
    want = expected(case)
    assert_close(got["output"], want.output, datatype)
    if "weights" in got:
        assert_close(got["weights"], want.weights, datatype)
    if "entropy" in got:
        np.testing.assert_allclose(got["entropy"], want.rows.entropy, atol=1e-4)
    if "visible_keys" in got:
        np.testing.assert_array_equal(got["visible_keys"], want.rows.visible_keys)


# ---- REST: JSON and binary -----------------------------------------------------------------


@pytest.mark.parametrize("datatype", ["FP32", "FP64"])
def test_rest_json(door: Door, datatype: str) -> None:
    case = make_case((2, 2, 5, 8), datatype=datatype, causal=True)
    response = rest_infer(
        door, kserve_request(case, binary=False, outputs=("output", "entropy", "weights"))
    )
    assert response.model_name == "attention"
    check(case, outputs_of(response), datatype)


@pytest.mark.parametrize("datatype", ["FP16", "FP32", "FP64"])
def test_rest_binary(door: Door, datatype: str) -> None:
    case = make_case((1, 4, 6, 8), (1, 4, 9, 8), datatype=datatype, causal="bottom_right")
    request = kserve_request(
        case, binary=True, outputs=("output", "visible_keys"), binary_outputs=True
    )
    got = outputs_of(rest_infer(door, request))
    assert got["output"].dtype == case.q.dtype
    check(case, got, datatype)


@pytest.mark.parametrize("name", ["key_lengths_int32", "key_padding_mask", "fully_masked"])
def test_rest_masks(door: Door, name: str) -> None:
    case = mask_cases()[name]
    got = outputs_of(rest_infer(door, kserve_request(case, binary=True, outputs=("output",))))
    check(case, got, "FP32")


def test_rest_id_is_echoed(door: Door) -> None:
    case = make_case((1, 1, 3, 4))
    request = kserve_request(case, binary=False, outputs=("output",))
    request.id = "kserve-request-7"
    response = rest_infer(door, request)
    assert response.id == "kserve-request-7"
    check(case, outputs_of(response), "FP32")


# ---- gRPC ----------------------------------------------------------------------------------


@pytest.mark.parametrize("datatype", ["FP16", "FP32", "FP64"])
def test_grpc(door: Door, datatype: str) -> None:
    case = make_case((2, 2, 5, 8), datatype=datatype, causal=True)
    response = grpc_infer(
        door, kserve_request(case, binary=True, outputs=("output", "entropy", "visible_keys"))
    )
    assert response.model_name == "attention"
    check(case, outputs_of(response), datatype)


def test_grpc_json_contents(door: Door) -> None:
    """InferInput data as a list (no raw bytes): KServe sends typed `contents`."""
    case = make_case((1, 2, 4, 8))
    inputs = [
        kserve.InferInput(name=n, shape=list(a.shape), datatype="FP32", data=a.ravel().tolist())
        for n, a, _ in case.inputs()
    ]
    request = kserve.InferRequest(model_name="attention", infer_inputs=inputs)
    check(case, outputs_of(grpc_infer(door, request)), "FP32")


# ---- another model, a typo ------------------------------------------------------------------


def _body(**fields: Any) -> dict[str, Any]:
    case = make_case((1, 1, 2, 4))
    inputs = [
        {"name": n, "shape": list(a.shape), "datatype": "FP32", "data": a.ravel().tolist()}
        for n, a, _ in case.inputs()
    ]
    return {"inputs": inputs, **fields}


def _post(door: Door, body: dict[str, Any]) -> httpx.Response:
    return httpx.post(f"{door.url}/v2/models/attention/infer", json=body, headers=AUTH, timeout=30)


def test_rest_fields_naming_this_model_are_taken(door: Door) -> None:
    for fields in (
        {"model_name": "attention"},
        {"model_name": "attention", "model_version": "1", "id": "a"},
        {"model_name": None, "model_version": ""},
    ):
        response = _post(door, _body(**fields))
        assert response.status_code == 200, (fields, response.text)


@pytest.mark.parametrize(
    ("fields", "words"),
    [
        ({"model_name": "bert"}, "model_name: no model 'bert': this server serves the model"),
        ({"model_version": "2"}, "model_version: no version '2' of the model 'attention'"),
        ({"model_nme": "attention"}, "unknown field 'model_nme'; did you mean 'model_name'?"),
    ],
)
def test_rest_another_model_or_a_typo_is_a_400(
    door: Door, fields: dict[str, Any], words: str
) -> None:
    response = _post(door, _body(**fields))
    assert response.status_code == 400, response.text
    assert words in response.json()["error"]


def test_kserve_rest_client_naming_another_model_is_refused(door: Door) -> None:
    case = make_case((1, 1, 2, 4))
    request = kserve_request(case, binary=False, outputs=("output",))
    request.model_name = "bert"
    with pytest.raises(httpx.HTTPStatusError) as info:
        rest_infer(door, request)  # KServe's URL names the model in the body: attention
    assert info.value.response.status_code == 400
    assert "no model 'bert'" in info.value.response.text


def test_grpc_another_model_is_not_found(door: Door) -> None:
    case = make_case((1, 1, 2, 4))
    request = kserve_request(case, binary=True, outputs=("output",))
    request.model_name = "bert"
    with pytest.raises(grpc.aio.AioRpcError) as info:
        grpc_infer(door, request)
    assert info.value.code() == grpc.StatusCode.NOT_FOUND
    assert "no model 'bert'" in (info.value.details() or "")
