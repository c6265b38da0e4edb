"""Every message a door returns names only what that door accepts.

sdpa_core words its refusals for a Python caller of attention(); the service's three doors (v1
JSON, the Open Inference Protocol over REST and over gRPC) each take their own fields. A piece
of advice a client cannot follow ("pass allow_nonfinite=True": no door takes it) is worse than
none. The core's messages are walked through each door:

- every error message the core can raise, read from its source (each SdpaError call's message
  and `expected`), plus those it raises for a request on the paths only a Python caller picks,
  is turned into the client error the doors answer (service.errors.InvalidInput.from_core)
  and worded by each door's own code (v1's problem+json, v2 REST's {"error"}, the gRPC door's
  status message);
- requests that the core refuses are sent to a real app over each door (httpx to its ASGI app,
  tritonclient.grpc to its gRPC door on a loopback port), and the answers are read.

The truth, for each door: its request model's fields (v1), or the protocol's inputs, outputs,
parameters and request fields (v2, both doors). Advice is every identifier a message names
(snake_case, or `name=`; not a value in double quotes): each must be one of them.
"""

from __future__ import annotations

import ast
import base64
import json
import re
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import numpy as np
import pytest
import torch

import sdpa_core
from sdpa_core import SdpaError
from service.api.grpc import _Refusal
from service.errors import InvalidInput, ServiceError
from service.http_errors import error_response
from service.routes import Envelope
from service.serving.prepare_v2 import OUTPUT_NAMES
from service.wire.models import AnalyzeRequest, AttentionRequest, CustomStrategy, Synthetic
from service.wire.v2_models import (
    INPUT_DATATYPES,
    InferInput,
    InferRequest,
    InputParameters,
    OutputParameters,
    RequestedOutput,
    RequestParameters,
)

CORE = Path(sdpa_core.__file__).parent
# Parameters of the core's refusals that no door can reach: the engine chooses the path itself
# (service.runtime.engine never passes path=), and the doors decode every input into a tensor.
NO_DOOR_PASSES = {"path"}

V1_WORDS = frozenset(
    name
    for model in (AttentionRequest, AnalyzeRequest, Synthetic, CustomStrategy)
    for name in model.model_fields
)
V2_WORDS = frozenset(
    {
        *INPUT_DATATYPES,
        *OUTPUT_NAMES,
        *(
            name
            for model in (
                InferRequest,
                InferInput,
                InputParameters,
                RequestedOutput,
                OutputParameters,
                RequestParameters,
            )
            for name in model.model_fields
        ),
    }
)
# A snake_case identifier, or a name given a value (`allow_nonfinite=True`).
ADVICE = re.compile(r"\b([a-z][a-z0-9]*(?:_[a-z0-9]+)+)\b|\b([A-Za-z_]\w*)=")


# A value, as JSON spells it ("top_left"): no name to set.
VALUE = re.compile(r'"[^"]*"')


def advice(message: str) -> set[str]:
    return {a or b for a, b in ADVICE.findall(VALUE.sub("", message))}


def doors(exc: ServiceError) -> dict[str, tuple[str, frozenset[str]]]:
    """What each door answers for `exc`: its message, by that door's own wording code, and the
    words it accepts."""
    v1 = json.loads(bytes(error_response(exc, Envelope.PROBLEM).body))
    v2 = json.loads(bytes(error_response(exc, Envelope.V2).body))
    return {
        "v1": (" ".join([v1["detail"], *(e["msg"] for e in v1["errors"])]), V1_WORDS),
        "v2 REST": (v2["error"], V2_WORDS),
        "gRPC": (_Refusal.of(exc).message, V2_WORDS),
    }


# ---- the core's messages, from its source ------------------------------------------------------


def _text(node: ast.expr) -> str | None:
    """A string literal's text; an f-string's with its fields as "1" (numbers, shapes)."""
    if isinstance(node, ast.Constant) and isinstance(node.value, str):
        return node.value
    if isinstance(node, ast.JoinedStr):
        return "".join(
            v.value if isinstance(v, ast.Constant) else "1"
            for v in node.values
            if isinstance(v, ast.Constant | ast.FormattedValue)
        )
    return None


def core_source_errors() -> Iterator[tuple[str, SdpaError]]:
    """(where, error) for every SdpaError-family call in sdpa_core with a literal message."""
    for path in sorted(CORE.glob("*.py")):
        for node in ast.walk(ast.parse(path.read_text(encoding="utf-8"))):
            if not (
                isinstance(node, ast.Call)
                and isinstance(node.func, ast.Name)
                and node.func.id.endswith("Error")
            ):
                continue
            keywords = {k.arg: k.value for k in node.keywords if k.arg is not None}
            if "param" not in keywords or not node.args:
                continue
            message = _text(node.args[0])
            if message is None:
                continue
            param = _text(keywords["param"]) or "q"  # a name passed in: one of the inputs
            expected = _text(keywords["expected"]) if "expected" in keywords else None
            yield (
                f"{path.name}:{node.lineno}",
                SdpaError(message, param=param, expected=expected, got="1"),
            )


def core_raised_errors() -> Iterator[tuple[str, SdpaError]]:
    """Refusals the core words from tables, raised for real (the paths a Python caller picks,
    the non-finite inputs)."""
    x = torch.ones(1, 2, 4, 8)
    nan = x.clone()
    nan[0, 0, 0, 0] = float("nan")
    calls: dict[str, dict[str, Any]] = {
        "fused with diagnostics": {"path": "fused", "diagnostics": "summary"},
        "chunked with weights": {"path": "chunked", "return_weights": True},
        "dense over budget": {"path": "dense", "memory_budget_bytes": 1},
        "weights over budget": {"return_weights": True, "memory_budget_bytes": 1},
        "NaN in q": {"q": nan},
        "NaN in v": {"v": nan},
    }
    for name, kwargs in calls.items():
        qkv = {"q": x, "k": x, "v": x}
        qkv.update({key: kwargs.pop(key) for key in ("q", "v") if key in kwargs})
        with pytest.raises(SdpaError) as info:
            sdpa_core.attention(qkv["q"], qkv["k"], qkv["v"], **kwargs)
        yield name, info.value


CORE_ERRORS = [*core_source_errors(), *core_raised_errors()]


def test_the_walk_reads_the_core_s_messages() -> None:
    """The walk finds the core's refusals (a rename of SdpaError must not empty it)."""
    messages = " | ".join(str(exc) for _, exc in CORE_ERRORS)
    assert len(CORE_ERRORS) >= 40, messages
    assert "pass allow_nonfinite=True" in messages  # the core's advice to its Python callers
    assert "when return_weights is true" in messages


# The refusals a door can meet: those about a parameter no door passes (a forced path: its advice
# names sdpa_core's Python API, for the Python caller who forced it) never reach one.
DOOR_ERRORS = [(where, exc) for where, exc in CORE_ERRORS if exc.param not in NO_DOOR_PASSES]


def test_only_the_forced_paths_refusals_are_out_of_the_doors_reach() -> None:
    out_of_reach = {exc.param for _, exc in CORE_ERRORS} - {exc.param for _, exc in DOOR_ERRORS}
    assert out_of_reach == NO_DOOR_PASSES
    assert len(DOOR_ERRORS) >= 35


@pytest.mark.parametrize(("where", "exc"), DOOR_ERRORS, ids=[w for w, _ in DOOR_ERRORS])
def test_every_core_message_advises_only_what_each_door_accepts(where: str, exc: SdpaError) -> None:
    refusal = InvalidInput.from_core(exc)
    for door, (message, accepted) in doors(refusal).items():
        names = advice(message)
        assert names <= accepted, f"{door} answers {message!r}: {names - accepted} is no field"
        assert exc.message.split(" (pass ")[0] in message  # the core's own words still say it


def test_a_nan_input_is_refused_without_the_core_s_keyword() -> None:
    x = torch.ones(3, 2)
    x[1, 0] = float("nan")
    with pytest.raises(SdpaError) as info:
        sdpa_core.attention(x, torch.ones(3, 2), torch.ones(3, 2))
    worded = doors(InvalidInput.from_core(info.value))
    assert worded["v1"][0].startswith("q: contains NaN or Inf; expected finite values; got 1")
    assert worded["v2 REST"][0] == "input 'q': contains NaN or Inf; expected finite values; " + (
        "got 1 non-finite of 6"
    )
    assert worded["gRPC"][0] == worded["v2 REST"][0]


def test_v2_asks_for_the_weights_by_its_output() -> None:
    x = torch.ones(1, 1, 2, 2)
    with pytest.raises(SdpaError) as info:
        sdpa_core.attention(x, x, x, path="chunked", return_weights=True)
    worded = doors(InvalidInput.from_core(info.value))
    assert "when return_weights is true" in worded["v1"][0]
    assert "when the output 'weights' is requested" in worded["v2 REST"][0]
    assert "return_weights" not in worded["gRPC"][0]


# ---- the doors of a real app ------------------------------------------------------------------

tritongrpc = pytest.importorskip("tritonclient.grpc")
tritonutils = pytest.importorskip("tritonclient.utils")
tritonhttp = pytest.importorskip("tritonclient.http")


# Requests the service lets through to the core, which refuses them: (inputs, parameters).
def _refused_requests() -> dict[str, tuple[dict[str, np.ndarray], dict[str, Any]]]:
    ones = np.ones((1, 2, 4, 8), dtype=np.float32)
    nan = ones.copy()
    nan[0, 1, 2, 3] = np.nan
    inf = ones.copy()
    inf[0, 0, 0, 0] = np.inf
    big = np.full((1, 1, 2, 2), 1e20, dtype=np.float32)
    return {
        "NaN in q": ({"q": nan, "k": ones, "v": ones}, {}),
        "Inf in k": ({"q": ones, "k": inf, "v": ones}, {}),
        "NaN in v": ({"q": ones, "k": ones, "v": nan}, {}),
        "scores overflow": ({"q": big, "k": big, "v": big[..., :1]}, {}),
    }


REFUSED = _refused_requests()


@pytest.fixture(scope="module")
def door() -> Iterator[Any]:
    from tests.service.api.test_grpc_servicer import InProcessDoor
    from tests.support.app import small_settings

    with InProcessDoor(small_settings()) as running:
        yield running


def _post(door: Any, path: str, content: bytes, headers: dict[str, str]) -> Any:
    import httpx

    async def post() -> httpx.Response:
        transport = httpx.ASGITransport(app=door.app)
        async with httpx.AsyncClient(transport=transport, base_url="http://app") as http:
            return await http.post(path, content=content, headers=headers)

    return door.run(post)


def _v1(door: Any, inputs: dict[str, np.ndarray], parameters: dict[str, Any]) -> str:
    body = {
        name: {
            "dtype": "float32",
            "shape": list(array.shape),
            "b64": base64.b64encode(array.astype("<f4").tobytes()).decode(),
        }
        for name, array in inputs.items()
    } | parameters
    headers = {"content-type": "application/json"}
    response = _post(door, "/v1/attention", json.dumps(body).encode(), headers)
    assert response.status_code == 422, response.text
    problem = response.json()
    return " ".join([problem["detail"], *(e["msg"] for e in problem["errors"])])


def _v2(door: Any, inputs: dict[str, np.ndarray], parameters: dict[str, Any]) -> str:
    from tritonclient.http._utils import _get_inference_request

    request = []
    for name, array in inputs.items():
        item = tritonhttp.InferInput(name, list(array.shape), "FP32")
        item.set_data_from_numpy(array, binary_data=True)
        request.append(item)
    body, json_size = _get_inference_request(
        inputs=request, request_id="", outputs=None, sequence_id=0, sequence_start=False,
        sequence_end=False, priority=0, timeout=None, custom_parameters=parameters or None,
    )  # fmt: skip
    headers = {"Inference-Header-Content-Length": str(json_size)}
    response = _post(door, "/v2/models/attention/infer", body, headers)
    assert response.status_code == 400, response.text
    return str(response.json()["error"])


def _grpc(door: Any, inputs: dict[str, np.ndarray], parameters: dict[str, Any]) -> str:
    request = []
    for name, array in inputs.items():
        item = tritongrpc.InferInput(name, list(array.shape), "FP32")
        item.set_data_from_numpy(array)
        request.append(item)
    client = door.client()
    try:
        with pytest.raises(tritonutils.InferenceServerException) as info:
            client.infer("attention", request, parameters=parameters or None)
    finally:
        client.close()
    assert info.value.status() == "StatusCode.INVALID_ARGUMENT", info.value.message()
    return str(info.value.message())


@pytest.mark.parametrize("case", sorted(REFUSED))
def test_each_door_of_a_real_app_advises_only_its_own_fields(door: Any, case: str) -> None:
    inputs, parameters = REFUSED[case]
    answers = {
        "v1": (_v1(door, inputs, parameters), V1_WORDS),
        "v2 REST": (_v2(door, inputs, parameters), V2_WORDS),
        "gRPC": (_grpc(door, inputs, parameters), V2_WORDS),
    }
    for name, (message, accepted) in answers.items():
        assert advice(message) <= accepted, f"{name} answers {message!r}"
        assert "allow_nonfinite" not in message
    if case.startswith(("NaN", "Inf")):
        field = case.split()[-1]
        assert answers["v1"][0].startswith(f"{field}: contains NaN or Inf; expected finite")
        assert answers["v2 REST"][0].startswith(f"input '{field}': contains NaN or Inf;")
        assert answers["gRPC"][0] == answers["v2 REST"][0]
