"""Wire models of the HTTP API (pydantic v2; no torch here).

Request models validate the JSON envelope only: field names (extra="forbid", so a typo such as
"casual" is a 422 and never silently ignored), option values, scalar bounds. Tensor payloads
stay as the parsed JSON (`data` lists, `b64` strings) and are decoded by service.wire.codec with
numpy, so pydantic never walks a tensor's elements.

Response models exist for the OpenAPI document (and the schema-driven tests): the routes build
their JSON directly (service.wire.codec.dumps) instead of validating their own output.

Strict mode everywhere: `true` is not 1, "3" is not 3, and non-finite floats are refused.
"""

from __future__ import annotations

import difflib
from collections.abc import Collection, Iterable, Mapping, Sequence
from itertools import islice
from typing import Annotated, Any, Final, Literal, TypeVar, get_args

from pydantic import (
    AfterValidator,
    BaseModel,
    BeforeValidator,
    ConfigDict,
    Discriminator,
    Field,
    GetPydanticSchema,
    Tag,
    ValidationError,
    ValidatorFunctionWrapHandler,
    WithJsonSchema,
    model_validator,
)
from pydantic_core import PydanticCustomError, core_schema

from service.errors import (
    MAX_LISTED_ERRORS,
    MAX_LOC_TEXT,
    FieldError,
    InvalidRequest,
    and_more,
    clip,
)
from service.wire.json_arrays import Path, Slot, SlotOf
from service.wire.number_lists import NumberArray

# Highest tensor rank on the wire: [B1, B2, B3, H, N, D], three leading batch dimensions, more than
# any use we know of. It keeps the documented schema finite, and small enough that schema-driven
# generation stays fast (each level of nesting multiplies the cost of generating a body).
MAX_RANK: Final = 6

FloatDType = Literal["float16", "bfloat16", "float32", "float64"]
WireDType = Literal["float16", "bfloat16", "float32", "float64", "bool"]
Encoding = Literal["json", "base64"]
DiagnosticsLevel = Literal["none", "summary", "full"]
StrategyName = Literal["none", "sqrt_dk", "dk", "dk_quarter", "two_sqrt_dk"]

# Discriminator tags: they name the branch of a union in pydantic's error locations, which is
# noise to a client; field_errors() drops them so that locs name the client's own fields.
_TAG_TENSOR_OBJECT: Final = "tensor_object"
_TAG_NESTED_LIST: Final = "nested_list"
_TAG_STRATEGY_NAME: Final = "strategy_name"
_TAG_CUSTOM_STRATEGY: Final = "custom_strategy"
_UNION_TAGS: Final = frozenset(
    {_TAG_TENSOR_OBJECT, _TAG_NESTED_LIST, _TAG_STRATEGY_NAME, _TAG_CUSTOM_STRATEGY}
)


def nested_list_schema(leaf: Mapping[str, Any], *, depth: int = MAX_RANK) -> dict[str, Any]:
    """JSON schema of a nested list of `leaf` values, `depth` levels at most (rank >= 1)."""
    inner: dict[str, Any] = {"type": "array", "items": dict(leaf)}
    for _ in range(depth - 1):
        inner = {"type": "array", "items": {"anyOf": [dict(leaf), inner]}}
    return inner


_NUMBER_OR_BOOL: Final = {"type": ["number", "boolean"]}
_BOOLEAN: Final = {"type": "boolean"}
# Responses write a non-finite value (a fully masked row's lse = -inf) as null: JSON has no inf.
_NUMBER_OR_NULL: Final = {"type": ["number", "null"]}
_INTEGER: Final = {"type": "integer"}

NESTED_INPUT_SCHEMA: Final = nested_list_schema(_NUMBER_OR_BOOL)
# q, k and v: numbers only (the codec refuses booleans in them).
NESTED_FLOAT_SCHEMA: Final = nested_list_schema({"type": "number"})
# An attn_mask's leaves: booleans, or numbers with null for -inf (JSON has no infinity).
NESTED_MASK_SCHEMA: Final = nested_list_schema({"type": ["number", "boolean", "null"]})
# A key padding mask is bool only: the codec refuses numbers in it (and a float dtype).
NESTED_BOOL_SCHEMA: Final = nested_list_schema(_BOOLEAN)
NESTED_OUTPUT_SCHEMA: Final = nested_list_schema(_NUMBER_OR_NULL)
# key_lengths are per sequence or per head: at most q's rank minus 2.
NESTED_INT_SCHEMA: Final = nested_list_schema(_INTEGER, depth=MAX_RANK - 2)


def _as_parsed(value: Any, handler: ValidatorFunctionWrapHandler) -> Any:
    # A nested list parsed in pieces (service.wire.json_arrays) stands where the list was and
    # is taken as it; anything else is validated as a list, with a list's own errors.
    return value if isinstance(value, NumberArray) else handler(value)


# A tensor's data: a nested list, or a NumberArray in a body parsed in pieces. Validated (and
# documented) as list[Any].
DataList = Annotated[
    list[Any] | NumberArray,
    GetPydanticSchema(
        lambda _source, handler: core_schema.no_info_wrap_validator_function(
            _as_parsed, handler.generate_schema(list[Any])
        )
    ),
]
NestedFloat = Annotated[DataList, WithJsonSchema(NESTED_FLOAT_SCHEMA)]
NestedMask = Annotated[DataList, WithJsonSchema(NESTED_MASK_SCHEMA)]
NestedBool = Annotated[DataList, WithJsonSchema(NESTED_BOOL_SCHEMA)]
NestedOutput = Annotated[list[Any], WithJsonSchema(NESTED_OUTPUT_SCHEMA)]
# Per-head statistics of a 2-D request (one head, no head dim) are scalars.
ScalarOrNested = Annotated[Any, WithJsonSchema({"anyOf": [_NUMBER_OR_NULL, NESTED_OUTPUT_SCHEMA]})]


B64_PATTERN: Final = r"^(?:[A-Za-z0-9+/]{4})*(?:[A-Za-z0-9+/]{2}==|[A-Za-z0-9+/]{3}=)?$"


# An object may carry this many unknown fields, each refused in an error of its own with a
# "did you mean" hint; with more, the object is refused whole in one error that names the first
# few (few_unknown_fields). pydantic has no way to stop collecting errors: a body of 90,000
# unknown fields cost 2.5 s of errors and hints, and answered 7.4 MB.
MAX_UNKNOWN_FIELDS: Final = 8
_UNKNOWN_NAMED: Final = 3
# The largest dimension a tensor's shape may name (int64's): no limit allows more, and a shape's
# element count stays a number Python can write (int() refuses to print 4,300 digits or more).
MAX_DIM: Final = 2**63 - 1


def few_unknown_fields(data: Any, fields: Collection[str]) -> Any:
    """A model's "before" check of its raw input: an object with more than MAX_UNKNOWN_FIELDS
    keys outside `fields` is refused in one error, before pydantic walks its keys. The work is
    bounded by the model's own field count, whatever the object holds."""
    if not isinstance(data, dict) or len(data) <= MAX_UNKNOWN_FIELDS:
        return data
    unknown = len(data) - sum(1 for name in fields if name in data)
    if unknown <= MAX_UNKNOWN_FIELDS:
        return data
    # The first keys that are not fields: at most len(fields) + _UNKNOWN_NAMED steps.
    first = islice((key for key in data if key not in fields), _UNKNOWN_NAMED)
    names = ", ".join(repr(clip(key, MAX_LOC_TEXT)) for key in first)
    raise PydanticCustomError(
        "too_many_unknown_fields",
        "{count} unknown fields ({names}, ...); this object takes {fields}",
        {"count": f"{unknown:,}", "names": names, "fields": ", ".join(fields)},
    )


class RequestModel(BaseModel):
    """A request model of either protocol: strict (`true` is not 1, "3" is not 3), frozen, no
    non-finite floats, and unknown fields refused, many of them in one error before pydantic
    walks their keys (few_unknown_fields)."""

    model_config = ConfigDict(extra="forbid", strict=True, allow_inf_nan=False, frozen=True)

    @model_validator(mode="before")
    @classmethod
    def _few_unknown_fields(cls, data: Any) -> Any:
        # The common case first, without reading model_fields (a descriptor: 1 µs a read).
        if isinstance(data, dict) and len(data) > MAX_UNKNOWN_FIELDS:
            few_unknown_fields(data, cls.model_fields)
        return data


def _nested_list_data(value: Any) -> Any:
    # No tensor on the wire is 0-d (q, k and v have rank >= 2, masks rank >= 1: a scalar mask
    # would carry nothing per key), so `data` is always a list, as the schema says: a bare 0 or
    # true is refused here rather than decoded into a 0-d tensor that broadcasts.
    if value is None or isinstance(value, list | NumberArray):
        return value
    raise PydanticCustomError(
        "tensor_data",
        "'data' must be a nested list (a tensor has at least one dimension); write a single "
        "value as [x]",
    )


_NULL: Final = {"type": "null"}

# A tensor object's `data`: a nested list (null, as when absent, with b64).
TensorData = Annotated[
    Any,
    AfterValidator(_nested_list_data),
    WithJsonSchema({"anyOf": [NESTED_INPUT_SCHEMA, _NULL]}),
]
MaskTensorData = Annotated[
    Any,
    AfterValidator(_nested_list_data),
    WithJsonSchema({"anyOf": [NESTED_MASK_SCHEMA, _NULL]}),
]
FloatTensorData = Annotated[
    Any,
    AfterValidator(_nested_list_data),
    WithJsonSchema({"anyOf": [NESTED_FLOAT_SCHEMA, _NULL]}),
]
BoolTensorData = Annotated[
    Any,
    AfterValidator(_nested_list_data),
    WithJsonSchema({"anyOf": [NESTED_BOOL_SCHEMA, _NULL]}),
]


class WireTensor(RequestModel):
    """A tensor: {"dtype", "shape", "data"} (nested lists) or {"dtype", "shape", "b64"}."""

    model_config = ConfigDict(
        json_schema_extra={
            "examples": [
                {"dtype": "float32", "shape": [2, 2], "data": [[1.0, 0.0], [0.0, 1.0]]},
                {"dtype": "float32", "shape": [2], "b64": "AACAPwAAAEA="},
            ]
        }
    )

    dtype: WireDType = Field(
        description="Element type. bool is for masks only; bfloat16 travels as raw 2-byte "
        "values in b64 and as ordinary numbers in data."
    )
    shape: list[Annotated[int, Field(ge=0, le=MAX_DIM)]] | None = Field(
        default=None,
        # At least one dimension: no tensor on the wire is 0-d (see _nested_list_data).
        min_length=1,
        max_length=MAX_RANK,
        description="Dimensions, row-major. Required with b64; inferred from data when omitted.",
    )
    data: TensorData = Field(
        default=None, description="Nested lists of numbers (or booleans for a bool mask)."
    )
    b64: str | None = Field(
        default=None,
        description="Base64 of the little-endian row-major bytes: prod(shape) x itemsize bytes.",
        # Documented, and enforced by the codec while decoding (a regex over megabytes here
        # would cost more than the decoding itself).
        json_schema_extra={"pattern": B64_PATTERN, "contentEncoding": "base64"},
    )

    @model_validator(mode="after")
    def _one_payload(self) -> WireTensor:
        if (self.data is None) == (self.b64 is None):
            raise PydanticCustomError(
                "tensor_payload", "a tensor carries exactly one of 'data' or 'b64'"
            )
        if self.b64 is not None and self.shape is None:
            raise PydanticCustomError("tensor_shape", "'shape' is required with 'b64'")
        return self


def _float_only(value: str) -> str:
    # The same refusal (type and words) as the codec's, at the schema's level.
    if value == "bool":
        raise PydanticCustomError("dtype", "must be a floating-point tensor, not bool")
    return value


class FloatTensor(WireTensor):
    """q, k or v: {"dtype": a float type, "shape", "data" | "b64"}."""

    dtype: Annotated[
        WireDType,
        AfterValidator(_float_only),
        WithJsonSchema({"enum": list(get_args(FloatDType)), "type": "string"}),
    ] = Field(
        description="float16, bfloat16, float32 or float64; bfloat16 travels as raw 2-byte "
        "values in b64 and as ordinary numbers in data."
    )
    data: FloatTensorData = Field(default=None, description="Nested lists of numbers.")


def _bool_only(value: str) -> str:
    # The same refusal (type and words) as the codec's for a bare list of numbers.
    if value != "bool":
        raise PydanticCustomError(
            "dtype", "must be a bool tensor (true = padding), not {dtype}", {"dtype": value}
        )
    return value


class BoolTensor(WireTensor):
    """A bool tensor (a key padding mask): {"dtype": "bool", "shape", "data" | "b64"}."""

    model_config = ConfigDict(
        json_schema_extra={
            "examples": [
                {"dtype": "bool", "shape": [1, 3], "data": [[False, False, True]]},
                {"dtype": "bool", "shape": [3], "b64": "AAAB"},
            ]
        }
    )

    dtype: Annotated[
        WireDType, AfterValidator(_bool_only), WithJsonSchema({"const": "bool", "type": "string"})
    ] = Field(description="Always bool.")
    data: BoolTensorData = Field(default=None, description="Nested lists of booleans.")
    # b64 (inherited): one byte per element, 0 or 1.


class MaskTensor(WireTensor):
    """An attn_mask: bool (True = may attend), or float (an additive bias; null in `data` is
    -inf, not visible)."""

    data: MaskTensorData = Field(
        default=None,
        description="Nested lists of booleans, or of numbers with null for -inf.",
    )


def _tensor_kind(value: Any) -> str | None:
    if isinstance(value, dict | WireTensor):
        return _TAG_TENSOR_OBJECT
    if isinstance(value, list | NumberArray):
        return _TAG_NESTED_LIST
    return None


# q, k and v: float tensors, or nested lists of numbers.
FloatTensorIn = Annotated[
    Annotated[FloatTensor, Tag(_TAG_TENSOR_OBJECT)] | Annotated[NestedFloat, Tag(_TAG_NESTED_LIST)],
    Discriminator(
        _tensor_kind,
        custom_error_type="tensor_type",
        custom_error_message="expected a tensor object {dtype, shape, data | b64} or a nested "
        "list of numbers",
    ),
]


# key_padding_mask: documented (and checked) as bool only, in both forms.
BoolTensorIn = Annotated[
    Annotated[BoolTensor, Tag(_TAG_TENSOR_OBJECT)] | Annotated[NestedBool, Tag(_TAG_NESTED_LIST)],
    Discriminator(
        _tensor_kind,
        custom_error_type="tensor_type",
        custom_error_message="expected a bool tensor object {dtype: 'bool', shape, data | b64} "
        "or a nested list of booleans",
    ),
]


# attn_mask: a float mask may write -inf as null.
MaskTensorIn = Annotated[
    Annotated[MaskTensor, Tag(_TAG_TENSOR_OBJECT)] | Annotated[NestedMask, Tag(_TAG_NESTED_LIST)],
    Discriminator(
        _tensor_kind,
        custom_error_type="tensor_type",
        custom_error_message="expected a tensor object {dtype, shape, data | b64} or a nested "
        "list of booleans, or of numbers with null for -inf",
    ),
]


def _no_numbers_for_causal(value: Any) -> Any:
    # Literal[True] alone would accept 1 and 1.0 (they hash equal to True).
    if not isinstance(value, bool | str):
        raise PydanticCustomError(
            "literal_error", "Input should be false, true, 'top_left' or 'bottom_right'"
        )
    return value


Causal = Annotated[
    Literal[False, True, "top_left", "bottom_right"],
    BeforeValidator(_no_numbers_for_causal),
    Field(
        description="false; true (= 'top_left': query i sees keys j <= i); 'bottom_right' "
        "(query i sees keys j <= i + N_kv - N_q, as in KV-cache decoding)."
    ),
]


def _list_or_integer(value: Any) -> Any:
    # One error at the field itself rather than one per union member.
    if isinstance(value, list | NumberArray) or (
        isinstance(value, int) and not isinstance(value, bool)
    ):
        return value
    raise PydanticCustomError(
        "key_lengths_type", "expected an integer or a nested list of integers"
    )


KeyLengths = Annotated[
    # A bare integer serves a 2-D q (one sequence, one head: key_lengths of shape []).
    Any,
    AfterValidator(_list_or_integer),
    WithJsonSchema(
        {
            "anyOf": [_INTEGER, NESTED_INT_SCHEMA],
            "description": "Valid keys per sequence ([B]) or per head ([B, H]), or one integer "
            "for a 2-D q; keys j >= length are padding.",
        }
    ),
]


class _MaskFields(RequestModel):
    causal: Causal = False
    key_lengths: KeyLengths | None = None
    key_padding_mask: BoolTensorIn | None = Field(
        default=None,
        description="bool, True = padding; shape [..., N_kv] per sequence or [..., H, N_kv].",
    )
    attn_mask: MaskTensorIn | None = Field(
        default=None,
        description="bool (True = may attend) or float (additive bias; null in JSON lists is "
        "-inf, not visible), broadcastable to [..., H, N_q, N_kv].",
    )
    timeout_ms: float | None = Field(
        default=None,
        ge=1,
        le=3_600_000,
        description="Deadline for this request; null = the server's SDPA_REQUEST_TIMEOUT_MS.",
    )
    priority: int | None = Field(
        default=None,
        ge=0,
        le=2**31 - 1,
        description="Its place among this tenant's own waiting requests (Triton's convention): 1 "
        "is the highest level, larger values lower; 0 or null = SDPA_DEFAULT_PRIORITY. At most "
        "SDPA_PRIORITY_LEVELS. It never puts one tenant before another.",
    )


_SMALL_Q = [[1.0, 0.0], [0.0, 1.0], [1.0, 1.0]]

ATTENTION_EXAMPLE: Final[dict[str, Any]] = {
    "q": {"dtype": "float32", "shape": [1, 3, 2], "data": [_SMALL_Q]},
    "k": {"dtype": "float32", "shape": [1, 3, 2], "data": [_SMALL_Q]},
    "v": {"dtype": "float32", "shape": [1, 3, 2], "data": [[[1.0, 2.0], [3.0, 4.0], [5.0, 6.0]]]},
    "causal": True,
    "return_weights": True,
    "diagnostics": "summary",
    "response_encoding": "json",
}


class AttentionRequest(_MaskFields):
    """POST /v1/attention: softmax(q k^T * scale + mask) v, with optional weights/diagnostics."""

    model_config = ConfigDict(json_schema_extra={"examples": [ATTENTION_EXAMPLE]})

    q: FloatTensorIn = Field(description="Queries [..., H, N_q, D].")
    k: FloatTensorIn = Field(description="Keys [..., H_kv, N_kv, D]; H % H_kv == 0 (GQA/MQA).")
    v: FloatTensorIn = Field(description="Values [..., H_kv, N_kv, D_v].")
    scale: float | None = Field(default=None, description="null = 1/sqrt(D).")
    temperature: float | None = Field(
        default=None,
        gt=0,
        description="T > 0: scale = 1/(T·sqrt(D)) (T > 1 flattens the weights). Not together "
        "with scale.",
    )
    return_weights: bool = Field(
        default=False,
        description="Return the [..., H, N_q, N_kv] weights (bounded by "
        "SDPA_MAX_WEIGHTS_ELEMENTS); diagnostics alone need O(N) memory.",
    )
    diagnostics: DiagnosticsLevel = "summary"
    return_output: bool = Field(
        default=True,
        description="false: the answer's output is null, neither encoded nor sent (for a "
        "caller that wants the diagnostics or weights alone); the response-size limit then "
        "counts no output bytes.",
    )
    response_encoding: Encoding | None = Field(
        default=None, description="null = the encoding q came in ('data'/list: json, b64: base64)."
    )
    tag: str | None = Field(
        default=None,
        pattern=r"^[A-Za-z0-9_.:/-]{1,64}$",
        description="Labels this request's attention-health metrics (1-64 characters of "
        'A-Z a-z 0-9 _ . : / -); null = "default". Past SDPA_HEALTH_MAX_TAGS distinct tags the '
        'rest are counted as "other".',
    )

    @model_validator(mode="after")
    def _scale_or_temperature(self) -> AttentionRequest:
        if self.scale is not None and self.temperature is not None:
            raise PydanticCustomError(
                "scale_and_temperature",
                "give scale or temperature, not both (temperature T means scale 1/(T·sqrt(D)))",
            )
        return self


class Synthetic(RequestModel):
    """Seeded q and k drawn from N(0, std^2)."""

    n_q: int = Field(ge=1, le=1 << 20)
    n_k: int = Field(ge=1, le=1 << 20)
    d_k: int = Field(ge=1, le=1 << 16)
    heads: int = Field(default=1, ge=1, le=4096)
    std: float = Field(default=1.0, gt=0, le=1e6)
    seed: int = Field(default=0, ge=0, le=2**63 - 1)
    dtype: FloatDType = "float32"


class CustomStrategy(RequestModel):
    """A scaling strategy of your own: scores are divided by `divisor`."""

    name: str = Field(min_length=1, max_length=64)
    divisor: float = Field(gt=0, le=1e30)


def _strategy_kind(value: Any) -> str | None:
    if isinstance(value, str):
        return _TAG_STRATEGY_NAME
    if isinstance(value, dict | CustomStrategy):
        return _TAG_CUSTOM_STRATEGY
    return None


StrategyIn = Annotated[
    Annotated[StrategyName, Tag(_TAG_STRATEGY_NAME)]
    | Annotated[CustomStrategy, Tag(_TAG_CUSTOM_STRATEGY)],
    Discriminator(
        _strategy_kind,
        custom_error_type="strategy_type",
        custom_error_message="expected a strategy name or {name, divisor}",
    ),
]

ANALYZE_EXAMPLE: Final[dict[str, Any]] = {
    "synthetic": {"n_q": 64, "n_k": 64, "d_k": 512, "std": 1.0, "seed": 0},
    "strategies": ["none", "sqrt_dk", "dk", {"name": "temperature_8", "divisor": 8.0}],
}


class AnalyzeRequest(_MaskFields):
    """POST /v1/analyze: compare divisors of the raw scores on given or synthetic q and k."""

    model_config = ConfigDict(json_schema_extra={"examples": [ANALYZE_EXAMPLE]})

    q: FloatTensorIn | None = Field(default=None, description="Queries [..., H, N_q, D].")
    k: FloatTensorIn | None = Field(default=None, description="Keys [..., H_kv, N_kv, D].")
    synthetic: Synthetic | None = Field(default=None, description="Instead of q and k.")
    strategies: list[StrategyIn] | None = Field(
        default=None,
        min_length=1,
        max_length=32,
        description="null = none, sqrt_dk, dk, dk_quarter, two_sqrt_dk.",
    )

    @model_validator(mode="after")
    def _one_source(self) -> AnalyzeRequest:
        given = self.q is not None or self.k is not None
        if self.synthetic is not None and given:
            raise PydanticCustomError("analyze_source", "give either q and k, or synthetic")
        if self.synthetic is None and (self.q is None or self.k is None):
            raise PydanticCustomError("analyze_source", "give both q and k, or synthetic")
        return self


# ---- responses (documentation and schema checks) -------------------------------------------


class _Out(BaseModel):
    model_config = ConfigDict(frozen=True)


class TensorOut(_Out):
    """A tensor in the response: the request's dtype, with 'data' or 'b64' as asked."""

    dtype: FloatDType
    shape: list[int]
    data: NestedOutput | None = None
    b64: str | None = None


MaybeFloat = Annotated[float | None, Field(description="null when not finite")]


class SummaryOut(_Out):
    entropy: MaybeFloat
    normalized_entropy: MaybeFloat
    effective_keys: MaybeFloat
    max_weight: MaybeFloat
    saturated_fraction: MaybeFloat
    sink_share: MaybeFloat
    score_mean_raw: MaybeFloat
    score_variance_raw: MaybeFloat
    score_variance_scaled: MaybeFloat
    score_abs_max_scaled: MaybeFloat
    grad_health: MaybeFloat
    jacobian_fro: MaybeFloat
    masked_rows: int


class DiagnosticsOut(_Out):
    summary: SummaryOut
    per_head: dict[str, ScalarOrNested] = Field(
        description="Each statistic as [..., H] (a number for a 2-D request)."
    )
    per_row: dict[str, NestedOutput] | None = Field(
        description="diagnostics='full': entropy, normalized_entropy, max_weight, "
        "effective_keys, sink_share, lse, visible_keys as [..., H, N_q]."
    )


class AttentionMeta(_Out):
    path: Literal["fused", "dense", "chunked", "flash"]
    backend: str | None = None
    device: str
    dtype: FloatDType
    batch_size: int
    queue_ms: float
    compute_ms: float
    request_id: str


class AttentionResponse(_Out):
    output: TensorOut | None = Field(
        description="[..., H, N_q, D_v]; null with return_output false."
    )
    weights: TensorOut | None
    diagnostics: DiagnosticsOut | None
    meta: AttentionMeta


class StrategyOut(_Out):
    name: str
    divisor: MaybeFloat
    score_variance: MaybeFloat
    entropy: MaybeFloat
    normalized_entropy: MaybeFloat
    max_weight: MaybeFloat
    saturated_fraction: MaybeFloat
    grad_health: MaybeFloat


class AnalyzeMeta(_Out):
    device: str
    dtype: FloatDType
    batch_size: int
    queue_ms: float
    compute_ms: float
    request_id: str


class AnalyzeResponse(_Out):
    d_k: int
    raw_score_variance: MaybeFloat
    recommended_divisor: MaybeFloat
    strategies: list[StrategyOut]
    meta: AnalyzeMeta


class HealthOut(_Out):
    status: Literal["ok", "ready"]


class LimitsOut(_Out):
    max_body_bytes: int
    max_elements: int
    max_weights_elements: int
    request_timeout_ms: float
    max_request_flops: float = Field(
        description="The work one request may cost, in the cost model's fused-equivalent FLOPs "
        "(SDPA_MAX_REQUEST_FLOPS; auto = what the device does in max_compute_s)."
    )
    max_compute_s: float
    max_response_bytes: int
    max_inflight_bytes: int
    read_timeout_s: float
    send_timeout_s: float
    max_connections: int
    max_header_bytes: int = Field(description="A request's line and header lines together.")
    max_headers: int = Field(description="Header lines of one request.")
    max_pipelined_requests: int = Field(
        description="Requests of one connection read and not yet answered."
    )
    min_body_rate: int = Field(
        description="Bytes per second a body must keep up past read_timeout_s (0: no rate)."
    )


class PathCostOut(_Out):
    gflops_per_second: float = Field(description="Measured above the head-dim floor.")
    d_floor: int = Field(description="Head dims below it cost as much as it does.")
    overhead_ms: float = Field(description="The fixed cost of one call.")


class CostModelOut(_Out):
    """The device's cost per path, measured at warm-up (a slow CPU's figures before)."""

    calibrated: bool
    paths: dict[str, PathCostOut]


class BatchingOut(_Out):
    max_batch_size: int
    max_batch_delay_ms: float
    max_queue: int
    slice_ms: float = Field(
        description="Estimated device time of one tile of a long request: a request that "
        "needs more runs alone in tiles, between which its deadline and client are checked "
        "and short requests run (SDPA_SLICE_MS)."
    )
    backlog_seconds: float = Field(
        description="Estimated seconds to work off the queue and the batch on the device (the "
        "cost model over the measured throughput; what Retry-After says)."
    )


class TenantOut(_Out):
    name: str
    weight: float = Field(description="Its weight in the fair shares (SDPA_TENANT_WEIGHTS).")
    share: float = Field(
        description="Its share of the device when every tenant has work waiting: its weight "
        "over all the weights."
    )
    backlog_seconds: float = Field(
        description="Estimated seconds to work off its queued and running work at its fair "
        "share now (what its 429's Retry-After says)."
    )


class TenantsOut(_Out):
    max_queue_share: float = Field(
        description="The share of max_queue one tenant may hold; past it, 429 "
        "(SDPA_TENANT_MAX_QUEUE_SHARE)."
    )
    max_queue_per_tenant: int
    priority_levels: int = Field(description="1 is the highest (SDPA_PRIORITY_LEVELS).")
    default_priority: int = Field(description="A request's level when it names none, or 0.")
    tenants: list[TenantOut] = Field(
        description='The configured tenants (the API keys\' names; "anonymous" without keys). '
        "Never the keys."
    )


class FlashKernelOut(_Out):
    device: str = Field(description='Whose tensors it takes: "cuda" or "cpu".')
    available: bool
    reason: str = Field(description='Why it cannot run here ("" when it can).')


class InfoOut(_Out):
    version: str
    device: str
    torch_version: str
    diagnostics_kernel: str = Field(
        description='How the statistics of diagnostics run on the chunked path: "compiled" '
        '(a kernel compiled at warm-up, SDPA_COMPILE_KERNELS) or "eager" (with the reason '
        "when compiling failed)."
    )
    kernels: dict[str, FlashKernelOut] = Field(
        description='The flash path\'s kernels ("triton", "cpu_flash"): whether each runs in '
        "this process and why not. Diagnostics without weights take the flash path wherever "
        "one runs the device's tensors (the CPU kernel is built at warm-up with "
        "SDPA_COMPILE_KERNELS), else the chunked path."
    )
    dtypes: list[str]
    limits: LimitsOut
    cost_model: CostModelOut
    batching: BatchingOut
    tenants: TenantsOut
    auth: bool = Field(description="True when an API key is required.")


class ProblemFieldErrorOut(_Out):
    loc: list[str | int]
    msg: str
    type: str


class Problem(_Out):
    """RFC 9457 problem details, with field-level errors."""

    type: str
    title: str
    status: int
    detail: str
    errors: list[ProblemFieldErrorOut]


REQUEST_MODELS: Final[tuple[type[BaseModel], ...]] = (AttentionRequest, AnalyzeRequest)
RESPONSE_MODELS: Final[tuple[type[BaseModel], ...]] = (
    AttentionResponse,
    AnalyzeResponse,
    HealthOut,
    InfoOut,
    Problem,
)

# ---- where a request's lists are read (service.wire.json_arrays) ----------------------------

# The fields that hold a tensor: a nested list, or an object whose `data` is one.
TENSOR_FIELDS: Final = frozenset({"q", "k", "v", "key_padding_mask", "attn_mask"})
# A tensor object's field whose list is read for its items (each an integer).
_LIST_FIELDS_OF_TENSORS: Final = frozenset({"shape"})


def _all_indices(path: Path) -> bool:
    return all(isinstance(part, int) for part in path)


def array_slots(model: type[BaseModel]) -> SlotOf:
    """What reads a list at each place of a v1 request to `model`: the codec where a tensor's
    data stands (bare, or as a tensor object's `data`; key_lengths), numpy inside such a list,
    the model's list fields (strategies, a tensor object's shape) by their length and items;
    elsewhere (unknown fields, the places of numbers, strings and objects) the models refuse a
    list whatever it holds."""
    fields = frozenset(model.model_fields)

    def slot_of(path: Path) -> Slot:
        if not path or path[0] not in fields:
            return Slot.ANY
        key, rest = path[0], path[1:]
        if key == "strategies":
            return Slot.LIST if not rest else Slot.ANY
        if key != "key_lengths" and key not in TENSOR_FIELDS:
            return Slot.ANY
        if not rest:
            return Slot.TENSOR
        if _all_indices(rest):
            return Slot.IN_TENSOR
        if key == "key_lengths" or isinstance(rest[0], int):
            return Slot.ANY  # an object where numbers go: np.asarray reads it as one object
        if rest[0] == "data":
            if len(rest) == 1:
                return Slot.TENSOR
            return Slot.IN_TENSOR if _all_indices(rest[1:]) else Slot.ANY
        if rest[0] in _LIST_FIELDS_OF_TENSORS and len(rest) == 1:
            return Slot.LIST
        return Slot.ANY

    return slot_of


# ---- parsing requests ----------------------------------------------------------------------

_FIELD_MODELS: Final[tuple[type[BaseModel], ...]] = (
    *REQUEST_MODELS,
    WireTensor,
    BoolTensor,
    MaskTensor,
    Synthetic,
    CustomStrategy,
)
_KNOWN_FIELDS: Final = sorted({name for model in _FIELD_MODELS for name in model.model_fields})


# A key over twice the longest field name's length is no typo of one: no hint is looked for
# (difflib's cost grows with the key's length, and a key can be megabytes long).
_HINT_MAX_KEY: Final = 2 * max(len(name) for name in _KNOWN_FIELDS)


def unknown_field_hint(key: str, known: Sequence[str]) -> str | None:
    """The field name in `known` that `key` is most likely a typo of, or None."""
    if len(key) > _HINT_MAX_KEY:
        return None
    close = difflib.get_close_matches(key, known, n=1, cutoff=0.75)
    return close[0] if close else None


def field_errors(
    errors: Iterable[Mapping[str, Any]], *, prefix: Sequence[str | int] = ("body",)
) -> list[FieldError]:
    """pydantic error dicts -> our FieldErrors: union tags dropped, unknown fields explained.
    Only the first MAX_LISTED_ERRORS are converted (the work per error is bounded, and more are
    never listed: service.errors).

    Never copies an error's `input` (it can be a whole tensor).
    """
    out: list[FieldError] = []
    for err in islice(errors, MAX_LISTED_ERRORS):
        loc = tuple(
            clip(part, MAX_LOC_TEXT) if isinstance(part, str) else part
            for part in err.get("loc", ())
            if part not in _UNION_TAGS
        )
        msg = str(err.get("msg", "invalid value"))
        kind = str(err.get("type", "value_error"))
        if kind == "extra_forbidden" and loc and isinstance(loc[-1], str):
            key = loc[-1]
            close = unknown_field_hint(key, _KNOWN_FIELDS)
            if close == key:  # a field of another endpoint ("scale" on analyze)
                msg = f"unknown field {key!r}: this endpoint does not take it"
            else:
                hint = f"; did you mean {close!r}?" if close else ""
                msg = f"unknown field {key!r}{hint}"
        out.append(FieldError(loc=(*prefix, *loc), msg=msg, type=kind))
    return out


M = TypeVar("M", bound=BaseModel)


def validate_request(payload: Any, model: type[M]) -> M:
    """The parsed JSON body as `model`, or InvalidRequest (422) naming every bad field."""
    try:
        return model.model_validate(payload)
    except ValidationError as exc:
        errors = field_errors(exc.errors(include_url=False, include_input=False))
        first = errors[0]
        where = ".".join(str(p) for p in first.loc[1:]) or "body"
        more = and_more(exc.error_count(), listed=len(errors))
        raise InvalidRequest(f"{where}: {first.msg}{more}", errors=errors) from None
