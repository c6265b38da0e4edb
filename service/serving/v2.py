"""The Open Inference Protocol's REST door: POST /v2/models/attention/infer as a Door of the
serving pipeline (service.serving.pipeline). Its body is a JSON header, with Triton's binary
tensor data after it when Inference-Header-Content-Length says where the header ends
(service.serving.prepare_v2); its answer, the JSON header and the binary outputs' buffers
(service.serving.encode_v2)."""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

from service.runtime.jobs import AttentionOutcome
from service.runtime.policy import CostModel
from service.serving.encode_v2 import InferAnswer, encode_infer, json_output_numbers
from service.serving.offload import decode_inline, encode_inline
from service.serving.prepare import PreparedRequest
from service.serving.prepare_v2 import PreparedInfer, prepare_infer
from service.settings import Settings
from service.wire.json_arrays import Pieces
from service.wire.lengths import parse_length


@dataclass(frozen=True, slots=True)
class InferDoor:
    """A v2 REST infer body and its Inference-Header-Content-Length (None: all JSON)."""

    body: bytes
    header_length: str | None

    @property
    def outcome_type(self) -> type[AttentionOutcome]:
        return AttentionOutcome

    def decode_inline(self) -> bool:
        # The binary data after the JSON header costs a copy: the estimate counts the header's
        # JSON (an invalid length is refused while decoding; the whole body counts until then).
        json_bytes = None if self.header_length is None else parse_length(self.header_length)
        if json_bytes is not None and json_bytes > len(self.body):
            json_bytes = None
        return decode_inline(self.body, json_bytes=json_bytes)

    def decode(
        self, settings: Settings, cost: CostModel, *, pieces: Pieces | None
    ) -> PreparedInfer:
        return prepare_infer(self.body, self.header_length, settings, cost, pieces=pieces)

    def prepared(self, decoded: PreparedInfer) -> PreparedRequest:
        return decoded.request

    def encode_inline(self, outcome: AttentionOutcome, decoded: PreparedInfer) -> bool:
        # Binary outputs cost no encoding: they are sent from the result tensors.
        return encode_inline(json_numbers=json_output_numbers(outcome, decoded))

    def encode(
        self, outcome: AttentionOutcome, decoded: PreparedInfer, *, meta: dict[str, Any]
    ) -> InferAnswer:
        return encode_infer(outcome, decoded, meta=meta)

    def answer_bytes(self, answer: InferAnswer) -> int:
        return answer.size
