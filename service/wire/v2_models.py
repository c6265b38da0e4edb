"""Wire models of the Open Inference Protocol v2 (KServe's REST protocol, with Triton's binary
tensor data extension), for the one model this service serves: "attention", version "1".

Request models validate the JSON header of an infer request: field names, parameters and their
values. Tensor payloads stay as parsed (`data` lists) or as byte counts (`binary_data_size`);
service.wire.v2_codec decodes them with numpy. No torch here.

Unknown fields and unknown request parameters are refused (a typo such as "casual" must never
be silently ignored), except the protocol's own parameters that a client sends on its own
(binary_data_output, timeout, priority) and the request fields the Open Inference Protocol's
clients send beside the URL's model: `id`, `model_name` and `model_version` (KServe's SDK puts
`model_name` in every body, InferRequest.to_rest in kserve 0.21), accepted where they name this
model; another model is refused (a 400 naming the field: the URL was this model's).
"""

from __future__ import annotations

from collections.abc import Iterable, Mapping
from itertools import islice
from typing import Annotated, Any, Final, Literal

from pydantic import BaseModel, ConfigDict, Field, ValidationError, field_validator
from pydantic_core import PydanticCustomError

from service.errors import (
    MAX_LISTED_ERRORS,
    MAX_LOC_TEXT,
    FieldError,
    InvalidRequest,
    and_more,
    clip,
)
from service.wire.json_arrays import Path, Slot
from service.wire.models import (
    MAX_DIM,
    MAX_RANK,
    Causal,
    DataList,
    DiagnosticsLevel,
    RequestModel,
    unknown_field_hint,
)

MODEL_NAME: Final = "attention"
MODEL_VERSION: Final = "1"
SERVER_NAME: Final = "sdpa-service"
# What GET /v2 lists: the protocol's own extensions this server implements.
EXTENSIONS: Final = ("binary_tensor_data", "parameters")

FLOAT_DATATYPES: Final = ("FP16", "BF16", "FP32", "FP64")
INT_DATATYPES: Final = ("INT32", "INT64")
DATATYPES: Final = (*FLOAT_DATATYPES, "BOOL", *INT_DATATYPES)
Datatype = Literal["FP16", "BF16", "FP32", "FP64", "BOOL", "INT32", "INT64"]

# The inputs, and the datatypes each may have.
INPUT_DATATYPES: Final[dict[str, tuple[str, ...]]] = {
    "q": FLOAT_DATATYPES,
    "k": FLOAT_DATATYPES,
    "v": FLOAT_DATATYPES,
    "key_lengths": INT_DATATYPES,
    "key_padding_mask": ("BOOL",),
    "attn_mask": ("BOOL", *FLOAT_DATATYPES),
}
REQUIRED_INPUTS: Final = ("q", "k", "v")

# The most outputs a request may name: each output once (service.serving.prepare_v2 refuses a
# name twice), with room for statistics to come; a test holds it above the number of outputs.
MAX_OUTPUTS: Final = 64

# A tag labels the request's health metrics (the same rule as v1's tag field).
TAG_PATTERN: Final = r"^[A-Za-z0-9_.:/-]{1,64}$"
# Deadlines up to an hour, in microseconds as tritonclient sends them (0: the server's default).
MAX_TIMEOUT_US: Final = 3_600_000_000


class InputParameters(RequestModel):
    binary_data_size: int | None = Field(
        default=None,
        ge=0,
        le=MAX_DIM,
        description="Binary tensor data extension: the input's bytes follow the JSON header "
        "(little-endian, row-major), in the order of the inputs.",
    )


class InferInput(RequestModel):
    """One input tensor: its data as a JSON list (flat or nested, row-major) or as binary data."""

    name: str = Field(description="q, k, v, key_lengths, key_padding_mask or attn_mask.")
    shape: list[Annotated[int, Field(ge=0, le=MAX_DIM)]] = Field(min_length=1, max_length=MAX_RANK)
    datatype: str = Field(
        description="q, k, v: FP16 | BF16 | FP32 | FP64 (BF16 as binary data only); "
        "key_lengths: INT32 | INT64; key_padding_mask: BOOL (true = padding); "
        "attn_mask: BOOL (true = attend) or a float datatype (additive)."
    )
    parameters: InputParameters | None = None
    data: DataList | None = Field(
        default=None, description="Row-major values, flat or nested (absent with binary data)."
    )


class OutputParameters(RequestModel):
    binary_data: bool | None = Field(
        default=None, description="This output as binary data (true) or a JSON list (false)."
    )


class RequestedOutput(RequestModel):
    name: str = Field(
        description="output, weights, a per-row statistic (entropy, normalized_entropy, "
        "max_weight, effective_keys, sink_share, lse, visible_keys: [..., H, N_q]), or a "
        "per-head one, <stat>_per_head for each statistic of the summary (entropy_per_head, "
        "masked_rows_per_head, ...: [..., H]; with diagnostics summary or full)."
    )
    parameters: OutputParameters | None = None


class RequestParameters(RequestModel):
    """The request's parameters: attention options and the protocol's own."""

    causal: Causal = False
    scale: float | None = Field(default=None, description="Absent: 1/sqrt(D).")
    temperature: float | None = Field(
        default=None, gt=0, description="T > 0: scale = 1/(T·sqrt(D)). Not together with scale."
    )
    diagnostics: DiagnosticsLevel = Field(
        default="none",
        description="summary: the summary statistics as response parameters; full: also the "
        "per-row statistics as outputs.",
    )
    tag: str | None = Field(
        default=None, pattern=TAG_PATTERN, description="Labels the health metrics."
    )
    timeout: int | None = Field(
        default=None,
        ge=0,
        le=MAX_TIMEOUT_US,
        description="Deadline in microseconds (as tritonclient sends it); 0 or absent: the "
        "server's SDPA_REQUEST_TIMEOUT_MS.",
    )
    priority: int | None = Field(
        default=None,
        ge=0,
        le=2**31 - 1,
        description="As tritonclient sends it: the request's place among its tenant's own "
        "waiting requests, 1 the highest level, larger values lower; 0 or absent: "
        "SDPA_DEFAULT_PRIORITY. At most SDPA_PRIORITY_LEVELS.",
    )
    binary_data_output: bool = Field(
        default=False, description="Every output as binary data unless it says otherwise."
    )


class InferRequest(RequestModel):
    """POST /v2/models/attention/infer: the JSON body, or the JSON header of a binary one."""

    id: str | None = Field(default=None, max_length=256)
    model_name: str | None = Field(
        default=None,
        description=f"As KServe's SDK sends it: absent, null or {MODEL_NAME!r} (the URL's model).",
    )
    model_version: str | None = Field(
        default=None,
        description=f"Absent, null, empty or {MODEL_VERSION!r}.",
    )
    parameters: RequestParameters | None = None
    inputs: list[InferInput] = Field(min_length=1, max_length=len(INPUT_DATATYPES))
    outputs: list[RequestedOutput] | None = Field(
        default=None,
        max_length=MAX_OUTPUTS,
        description="What to compute and return (a list without output: no output in the "
        "answer); absent: output (and the per-row statistics with diagnostics full), never the "
        "weights.",
    )

    @field_validator("model_name")
    @classmethod
    def _this_model(cls, name: str | None) -> str | None:
        if name is not None and name != MODEL_NAME:
            raise PydanticCustomError(
                "unknown_model",
                "no model {name}: this server serves the model {ours}",
                {"name": repr(clip(name, MAX_LOC_TEXT)), "ours": repr(MODEL_NAME)},
            )
        return name

    @field_validator("model_version")
    @classmethod
    def _this_version(cls, version: str | None) -> str | None:
        if version not in (None, "", MODEL_VERSION):
            raise PydanticCustomError(
                "unknown_model",
                "no version {version} of the model {ours}: it has version {one}",
                {
                    "version": repr(clip(version or "", MAX_LOC_TEXT)),
                    "ours": repr(MODEL_NAME),
                    "one": repr(MODEL_VERSION),
                },
            )
        return version


# ---- responses (documentation and schema checks) -------------------------------------------


class _Out(BaseModel):
    model_config = ConfigDict(frozen=True)


class ServerMetadata(_Out):
    name: str
    version: str
    extensions: list[str]


class ServerLive(_Out):
    live: bool


class ServerReady(_Out):
    ready: bool


class ModelReady(_Out):
    name: str
    ready: bool


class TensorMetadata(_Out):
    name: str
    datatype: str
    shape: list[int] = Field(description="-1 for a variable dimension.")


class ModelMetadata(_Out):
    name: str
    versions: list[str]
    platform: str
    inputs: list[TensorMetadata]
    outputs: list[TensorMetadata]


class OutputTensorParameters(_Out):
    binary_data_size: int | None = None


class InferOutput(_Out):
    name: str
    datatype: str
    shape: list[int]
    parameters: OutputTensorParameters | None = None
    data: list[float | int | bool | None] | None = Field(
        default=None, description="Flat, row-major; null where a value is not finite (lse)."
    )


class InferResponse(_Out):
    model_name: str
    model_version: str
    id: str | None = None
    parameters: dict[str, float | int | str | bool | None] = Field(
        description="The meta fields (path, device, batch_size, queue_ms, compute_ms) and, with "
        "diagnostics summary or full, the summary statistics under their v1 names."
    )
    outputs: list[InferOutput]


class InferError(_Out):
    """Every v2 error: {"error": "<message naming the input or parameter>"}."""

    error: str


V2_REQUEST_MODELS: Final[tuple[type[BaseModel], ...]] = (InferRequest,)
V2_RESPONSE_MODELS: Final[tuple[type[BaseModel], ...]] = (
    ServerMetadata,
    ServerLive,
    ServerReady,
    ModelReady,
    ModelMetadata,
    InferResponse,
    InferError,
)

# ---- where a request's lists are read (service.wire.json_arrays) ----------------------------


def array_slot(path: Path) -> Slot:
    """What reads a list at each place of an infer request: the codec where an input's data
    stands, numpy inside it, the list fields (inputs, outputs, an input's shape) by their
    length and items; elsewhere the models refuse a list whatever it holds."""
    if not path or path[0] not in ("inputs", "outputs"):
        return Slot.ANY
    rest = path[1:]
    if not rest:
        return Slot.LIST
    if path[0] == "outputs" or len(rest) < 2 or not isinstance(rest[0], int):
        return Slot.ANY
    field, inner = rest[1], rest[2:]
    if field == "data":
        if not inner:
            return Slot.TENSOR
        return Slot.IN_TENSOR if all(isinstance(part, int) for part in inner) else Slot.ANY
    if field == "shape" and not inner:
        return Slot.LIST
    return Slot.ANY


# ---- parsing -------------------------------------------------------------------------------

_KNOWN_NAMES: Final = sorted(
    {
        name
        for model in (InferRequest, InferInput, InputParameters, RequestedOutput, RequestParameters)
        for name in model.model_fields
    }
)


def _where(loc: Iterable[str | int]) -> str:
    """A pydantic loc as the request's own words: parameter 'causal', inputs[0].shape."""
    parts = [clip(part, MAX_LOC_TEXT) if isinstance(part, str) else part for part in loc]
    if len(parts) >= 2 and parts[0] == "parameters" and isinstance(parts[1], str):
        return f"parameter {parts[1]!r}"
    out = ""
    for part in parts:
        out += f"[{part}]" if isinstance(part, int) else (f".{part}" if out else part)
    return out or "request"


def _message(err: Mapping[str, Any]) -> tuple[str, tuple[str | int, ...]]:
    loc = tuple(err.get("loc", ()))
    msg = str(err.get("msg", "invalid value"))
    if err.get("type") == "extra_forbidden" and loc and isinstance(loc[-1], str):
        close = unknown_field_hint(loc[-1], _KNOWN_NAMES)
        hint = f"; did you mean {close!r}?" if close else ""
        what = "parameter" if len(loc) == 2 and loc[0] == "parameters" else "field"
        return f"unknown {what} {clip(loc[-1], MAX_LOC_TEXT)!r}{hint}", loc
    return f"{_where(loc)}: {msg}", loc


def parse_infer_request(payload: Any) -> InferRequest:
    """The parsed JSON header as an InferRequest, or InvalidRequest naming the first bad field,
    input or parameter (a 400 on v2); the first MAX_LISTED_ERRORS are listed."""
    try:
        return InferRequest.model_validate(payload)
    except ValidationError as exc:
        errors = list(islice(exc.errors(include_url=False, include_input=False), MAX_LISTED_ERRORS))
        messages = [_message(err) for err in errors]
        first, _ = messages[0]
        raise InvalidRequest(
            first + and_more(exc.error_count(), listed=len(messages)),
            errors=[
                FieldError(loc=("v2", *loc), msg=msg, type=str(err.get("type", "value_error")))
                for (msg, loc), err in zip(messages, errors, strict=True)
            ],
        ) from None
