"""The Open Inference Protocol's gRPC door, as the serving pipeline sees it: a serialized
ModelInferRequest -> the same PreparedInfer as the REST door's, and the Door that runs it
(service.serving.pipeline).

The message becomes its REST twin (service.wire.grpc_codec: the payload REST's JSON header would
parse to, and raw_input_contents as Triton's binary data) and then goes the REST door's way
(service.serving.prepare_v2.prepare_parsed): one validation and one set of limits for both, with
the same messages. The answer is every output in raw_output_contents
(service.serving.encode_grpc).

Nothing here knows gRPC's server: the servicer (service.api.grpc) hands over the message's bytes
and sends back the answer's.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any, Final

from service.runtime.jobs import AttentionOutcome
from service.runtime.policy import CostModel
from service.serving.encode_grpc import encode_grpc_infer, output_bytes
from service.serving.offload import INLINE_MAX_BYTES
from service.serving.prepare import PreparedRequest
from service.serving.prepare_v2 import PreparedInfer, prepare_parsed
from service.settings import Settings
from service.wire.grpc_codec import decode_infer_request, infer_payload
from service.wire.json_arrays import Pieces
from service.wire.v2_models import parse_infer_request

# An answer's raw outputs are copied once into the message: on the event loop up to this size,
# above it on a worker thread. The copy runs at memory speed: joining a W3 answer (2 MiB) took
# 0.08 ms on the loop and 0.26-0.30 ms through a worker thread (the hop and the GIL's handoff)
# on the 2-core development machine under load, so up to 8 MiB (about 0.4 ms there) the loop
# does it, well within its few-millisecond budget (service.serving.offload).
ENCODE_INLINE_MAX_BYTES: Final = 8 << 20


def prepare_grpc_infer(raw: bytes, settings: Settings, cost: CostModel) -> PreparedInfer:
    """A serialized inference.ModelInferRequest -> a prepared request within every limit, as
    the REST door prepares its twin. Raises ServiceError (a client's mistake: the message names
    the input, parameter or field; UnknownModel for another model) or sdpa_core's SdpaError;
    anything else is a bug of ours."""
    decoded = infer_payload(decode_infer_request(raw))
    request = parse_infer_request(decoded.payload)
    return prepare_parsed(request, decoded.body, 0, settings, cost)


@dataclass(frozen=True, slots=True)
class GrpcInferDoor:
    """ModelInfer's message, serialized (the servicer receives it undecoded, so that a large
    one is parsed off the event loop)."""

    raw: bytes

    @property
    def outcome_type(self) -> type[AttentionOutcome]:
        return AttentionOutcome

    def decode_inline(self) -> bool:
        # Parsing protobuf and copying raw_input_contents run at memory speed; only a message
        # of typed `contents` (numpy reads them element by element) costs more, a few
        # milliseconds at this size. Larger messages always leave the loop, as REST's bodies do.
        return len(self.raw) <= INLINE_MAX_BYTES

    def decode(
        self, settings: Settings, cost: CostModel, *, pieces: Pieces | None
    ) -> PreparedInfer:
        # `pieces` is for JSON lists of numbers: a protobuf message holds none.
        return prepare_grpc_infer(self.raw, settings, cost)

    def prepared(self, decoded: PreparedInfer) -> PreparedRequest:
        return decoded.request

    def encode_inline(self, outcome: AttentionOutcome, decoded: PreparedInfer) -> bool:
        return output_bytes(outcome, decoded) <= ENCODE_INLINE_MAX_BYTES

    def encode(
        self, outcome: AttentionOutcome, decoded: PreparedInfer, *, meta: dict[str, Any]
    ) -> bytes:
        return encode_grpc_infer(outcome, decoded, meta=meta)

    def answer_bytes(self, answer: bytes) -> int:
        return len(answer)
