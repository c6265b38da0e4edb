"""KServe's own Python SDK (kserve 0.21, unchanged) against a real `sdpa-service serve` on
loopback: InferenceRESTClient with JSON and with binary tensors, and InferenceGRPCClient on the
gRPC door (SDPA_GRPC_PORT, a free port here).

KServe's REST client puts `id` and `model_name` in every v2 body (InferRequest.to_rest): the
server takes them where they name this model, refuses another model by name (400 on REST,
NOT_FOUND on gRPC) and still refuses a typo. The truth is the float64 reference of
tests/core/reference.py (tests.support.v2_cases). API keys are configured: every call carries one.

kserve runs in a spawned process of its own (tests.support.kserve_calls says why): this module
never imports it.
"""

from __future__ import annotations

import importlib.util
import multiprocessing
from collections.abc import Callable, Iterator
from concurrent.futures import ProcessPoolExecutor
from typing import Any

import httpx
import numpy as np
import pytest

from tests.support import kserve_calls
from tests.support.app import API_SERVER_ENV
from tests.support.kserve_calls import Answer, Refused
from tests.support.live_server import LiveServer, free_port, live_server
from tests.support.v2_cases import Case, assert_close, expected, make_case, mask_cases

if importlib.util.find_spec("kserve") is None:
    pytest.skip("kserve is not installed", allow_module_level=True)

pytestmark = pytest.mark.xdist_group("v2-kserve")

API_KEY = "v2-kserve-key"
AUTH = {"Authorization": f"Bearer {API_KEY}"}


class Door:
    """A live server (HTTP base URL, gRPC target) and the process that runs kserve's calls."""

    def __init__(self, server: LiveServer, grpc_port: int, pool: ProcessPoolExecutor) -> None:
        self.server = server
        self.url = server.url
        self.target = f"127.0.0.1:{grpc_port}"
        self.pool = pool

    def run(self, call: Callable[..., Answer | Refused], *args: Any, **kw: Any) -> Any:
        return self.pool.submit(call, *args, key=API_KEY, **kw).result(timeout=120)

    def rest(self, case: Case, **kw: Any) -> Answer | Refused:
        return self.run(kserve_calls.rest_infer, self.url, case, **kw)

    def grpc(self, case: Case, **kw: Any) -> Answer | Refused:
        return self.run(kserve_calls.grpc_infer, self.target, case, **kw)


@pytest.fixture(scope="module")
def door(tmp_path_factory: pytest.TempPathFactory) -> Iterator[Door]:
    port = free_port()
    env = {**API_SERVER_ENV, "SDPA_API_KEYS": API_KEY, "SDPA_GRPC_PORT": str(port)}
    spawn = multiprocessing.get_context("spawn")
    with (
        live_server(env, tmp_path=tmp_path_factory.mktemp("v2-kserve")) as server,
        ProcessPoolExecutor(max_workers=1, mp_context=spawn) as pool,
    ):
        yield Door(server, port, pool)


def answered(result: Answer | Refused) -> Answer:
    assert isinstance(result, Answer), result
    assert result.model_name == "attention"
    return result


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
    result = answered(door.rest(case, outputs=("output", "entropy", "weights")))
    check(case, result.outputs, datatype)


@pytest.mark.parametrize("datatype", ["FP16", "FP32", "FP64"])
def test_rest_binary(door: Door, datatype: str) -> None:
    case = make_case((1, 4, 6, 8), (1, 4, 9, 8), datatype=datatype, causal="bottom_right")
    result = answered(
        door.rest(case, binary=True, outputs=("output", "visible_keys"), binary_outputs=True)
    )
    assert result.outputs["output"].dtype == case.q.dtype
    check(case, result.outputs, datatype)


@pytest.mark.parametrize("name", ["key_lengths_int32", "key_padding_mask", "fully_masked"])
def test_rest_masks(door: Door, name: str) -> None:
    case = mask_cases()[name]
    check(case, answered(door.rest(case, binary=True, outputs=("output",))).outputs, "FP32")


def test_rest_id_is_echoed(door: Door) -> None:
    case = make_case((1, 1, 3, 4))
    result = answered(door.rest(case, outputs=("output",), request_id="kserve-request-7"))
    assert result.id == "kserve-request-7"
    check(case, result.outputs, "FP32")


# ---- gRPC ----------------------------------------------------------------------------------


@pytest.mark.parametrize("datatype", ["FP16", "FP32", "FP64"])
def test_grpc(door: Door, datatype: str) -> None:
    """Numpy inputs: raw_input_contents, each input keeping REST's binary_data_size."""
    case = make_case((2, 2, 5, 8), datatype=datatype, causal=True)
    result = answered(door.grpc(case, outputs=("output", "entropy", "visible_keys")))
    check(case, result.outputs, datatype)


def test_grpc_contents(door: Door) -> None:
    """InferInput data as a list (no raw bytes): KServe sends typed `contents`."""
    case = make_case((1, 2, 4, 8))
    check(case, answered(door.grpc(case, as_lists=True)).outputs, "FP32")


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


def test_kserve_naming_another_model_is_refused_on_rest_and_grpc(door: Door) -> None:
    case = make_case((1, 1, 2, 4))
    # KServe's URL names the model the client is given (attention), its body `bert`.
    rest = door.rest(case, outputs=("output",), model_name="bert")
    assert isinstance(rest, Refused)
    assert rest.status == 400
    assert "no model 'bert'" in rest.text
    grpc = door.grpc(case, outputs=("output",), model_name="bert")
    assert isinstance(grpc, Refused)
    assert grpc.status == "NOT_FOUND"
    assert "no model 'bert'" in grpc.text
