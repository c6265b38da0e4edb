"""What the fuzzers (fuzz/, `make fuzz`) found answered with a 500, each answered now with the
client error it is. Each finding's input is also kept in its harness's corpus
(fuzz/corpus/<harness>/finding-*), which test_fuzz_corpus.py replays through the harness.
"""

from __future__ import annotations

import base64
import json
from typing import Any

import pytest

from sdpa_core.errors import ShapeError
from service.runtime.policy import CostModel
from service.serving.prepare_v2 import prepare_infer
from service.wire.v2_codec import decode_inputs, split_header
from service.wire.v2_models import parse_infer_request
from tests.support.app import small_settings

# ---- binary inputs of no element (grpc_infer, then v2_framing) ---------------------------
# Every input binary, each of a shape with a 0 in it, so binary_data_size 0 and no byte after
# the JSON header: decode_inputs asserted that a binary input has bytes after the header
# (AssertionError, a 500) where it must decode empty tensors, which sdpa_core refuses as
# empty. Over gRPC the same request is three empty raw_input_contents.

EMPTY_SHAPES = {"q": [1, 0, 3, 4], "k": [1, 0, 5, 4], "v": [1, 0, 5, 4]}


def _empty_binary_header() -> bytes:
    inputs: list[dict[str, Any]] = [
        {"name": name, "shape": shape, "datatype": "FP32", "parameters": {"binary_data_size": 0}}
        for name, shape in EMPTY_SHAPES.items()
    ]
    return json.dumps({"inputs": inputs}).encode()


def test_binary_inputs_of_no_element_decode_as_empty_tensors() -> None:
    body = _empty_binary_header()
    header, offset = split_header(body, str(len(body)))
    request = parse_infer_request(json.loads(header))
    tensors = decode_inputs(request, body, offset, max_elements=1 << 16)
    assert {name: list(t.shape) for name, t in tensors.items()} == EMPTY_SHAPES


def test_a_rest_request_of_empty_binary_inputs_is_refused_as_empty() -> None:
    body = _empty_binary_header()
    with pytest.raises(ShapeError, match="empty dimension"):
        prepare_infer(body, str(len(body)), small_settings(), CostModel.uncalibrated())


# The fuzzer's own message: model "attention", inputs q [1, 0, 3, 4], k and v [0, 2, 5, 4]
# (FP32), three empty raw_input_contents.
EMPTY_RAW_CONTENTS = base64.b64decode(
    "CglhdHRlbnRpb24qDwoBcRIERlAzMhoEAQADBCoPCgFrEgRGUDMyGgQAAgUEKg8KAXYSBEZQMzIaBAACBQQ6ADoAOgA="
)


def test_a_grpc_request_of_empty_raw_input_contents_is_refused_as_empty() -> None:
    prepare_grpc = pytest.importorskip("service.serving.prepare_grpc")
    with pytest.raises(ShapeError, match="empty dimension"):
        prepare_grpc.prepare_grpc_infer(
            EMPTY_RAW_CONTENTS, small_settings(), CostModel.uncalibrated()
        )
