"""Encode a v2 infer outcome for the gRPC door: a serialized ModelInferResponse whose outputs
travel in raw_output_contents, in the order the request named them.

The same outputs, datatypes and response parameters as the REST door's (service.serving
.encode_v2): the meta fields and, with diagnostics "summary" or "full", the summary statistics
under their v1 names, each as an InferParameter of its type. One difference: a summary
statistic that is not finite (NaN with no active row) travels as itself in a double, where
JSON has to write null.
"""

from __future__ import annotations

from typing import Any

from sdpa_core import AttentionResult
from service.runtime.jobs import AttentionOutcome
from service.serving.encode_v2 import infer_parameters, output_tensor
from service.serving.prepare_v2 import PreparedInfer
from service.wire.grpc_codec import RawOutput, encode_infer_response
from service.wire.v2_codec import encode_output


def output_bytes(outcome: AttentionOutcome, prepared: PreparedInfer) -> int:
    """The bytes of the answer's raw outputs (what encoding it copies)."""
    stat_dtype = prepared.request.prepared.spec.accum_dtype
    return sum(
        output_tensor(outcome.result, name, stat_dtype=stat_dtype).nbytes
        for name, _ in prepared.outputs
    )


def _parameters(
    result: AttentionResult, *, summary: bool, meta: dict[str, Any]
) -> dict[str, bool | int | float | str]:
    # A protobuf double carries a non-finite statistic itself, where JSON writes null.
    return infer_parameters(result, summary=summary, meta=meta, finite_only=False)


def encode_grpc_infer(
    outcome: AttentionOutcome, prepared: PreparedInfer, *, meta: dict[str, Any]
) -> bytes:
    """The serialized ModelInferResponse answering a gRPC infer request."""
    result = outcome.result
    stat_dtype = prepared.request.prepared.spec.accum_dtype
    outputs = []
    for name, _ in prepared.outputs:  # every output is raw over gRPC (grpc_codec)
        encoded = encode_output(
            name, output_tensor(result, name, stat_dtype=stat_dtype), binary=True
        )
        if encoded.data is None:  # binary=True always gives the tensor's bytes
            raise RuntimeError(f"output {name!r} has no binary data")
        entry = encoded.entry
        outputs.append(
            RawOutput(
                name=name,
                datatype=entry["datatype"],
                shape=tuple(entry["shape"]),
                data=encoded.data,
            )
        )
    return encode_infer_response(
        request_id=prepared.id,
        parameters=_parameters(result, summary=prepared.summary, meta=meta),
        outputs=outputs,
    )
