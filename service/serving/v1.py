"""The v1 JSON API's doors: POST /v1/attention and POST /v1/analyze, as Doors of the serving
pipeline (service.serving.pipeline): their bodies decode with service.serving.prepare and their
answers encode with service.serving.encode."""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

from service.runtime.jobs import AnalyzeOutcome, AttentionOutcome
from service.runtime.policy import CostModel
from service.serving.encode import attention_numbers, encode_analyze, encode_attention
from service.serving.offload import decode_inline, encode_inline
from service.serving.prepare import PreparedRequest, prepare_analyze, prepare_attention
from service.settings import Settings
from service.wire.json_arrays import Pieces


@dataclass(frozen=True, slots=True)
class AttentionDoor:
    """POST /v1/attention: a JSON body -> output, weights and diagnostics as JSON."""

    body: bytes

    @property
    def outcome_type(self) -> type[AttentionOutcome]:
        return AttentionOutcome

    def decode_inline(self) -> bool:
        return decode_inline(self.body)

    def decode(
        self, settings: Settings, cost: CostModel, *, pieces: Pieces | None
    ) -> PreparedRequest:
        return prepare_attention(self.body, settings, cost, pieces=pieces)

    def prepared(self, decoded: PreparedRequest) -> PreparedRequest:
        return decoded

    def encode_inline(self, outcome: AttentionOutcome, decoded: PreparedRequest) -> bool:
        tensors, statistics = attention_numbers(outcome, return_output=decoded.return_output)
        as_json = decoded.encoding == "json"
        return encode_inline(
            json_numbers=statistics + (tensors if as_json else 0),
            base64_numbers=0 if as_json else tensors,
        )

    def encode(
        self, outcome: AttentionOutcome, decoded: PreparedRequest, *, meta: dict[str, Any]
    ) -> bytes:
        return encode_attention(
            outcome, encoding=decoded.encoding, meta=meta, return_output=decoded.return_output
        )

    def answer_bytes(self, answer: bytes) -> int:
        return len(answer)


@dataclass(frozen=True, slots=True)
class AnalyzeDoor:
    """POST /v1/analyze: a JSON body -> the scaling report."""

    body: bytes

    @property
    def outcome_type(self) -> type[AnalyzeOutcome]:
        return AnalyzeOutcome

    def decode_inline(self) -> bool:
        # Always off the loop: synthetic inputs are generated here, and analysis is not a hot
        # path.
        return False

    def decode(
        self, settings: Settings, cost: CostModel, *, pieces: Pieces | None
    ) -> PreparedRequest:
        return prepare_analyze(self.body, settings, cost, pieces=pieces)

    def prepared(self, decoded: PreparedRequest) -> PreparedRequest:
        return decoded

    def encode_inline(self, outcome: AnalyzeOutcome, decoded: PreparedRequest) -> bool:
        return True  # a report of a few strategies: a few hundred numbers

    def encode(
        self, outcome: AnalyzeOutcome, decoded: PreparedRequest, *, meta: dict[str, Any]
    ) -> bytes:
        return encode_analyze(outcome, meta=meta)

    def answer_bytes(self, answer: bytes) -> int:
        return len(answer)
