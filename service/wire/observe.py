"""POST /v1/health/observe's body: attention statistics computed elsewhere (the tap's local
mode, sdpa_client.tap), recorded into the health metrics as a computed request's would be.

    {"observations": [
        {"tag": "minilm/layer0", "n_q": 128, "visible_keys_max": 128,
         "per_head": {"entropy": [[...]], "normalized_entropy": [[...]], "max_weight": [[...]],
                      "sink_share": [[...]], "score_abs_max_scaled": [[...]],
                      "saturated_fraction": [[...]], "masked_rows": [[...]]}}]}

Each per-head value is [B, H] (sequences x heads): a nested list of numbers, or a packed
array {"dtype": "float32" | "float64", "shape": [B, H], "b64": ...} (little-endian, row-major;
what the tap sends: 4 bytes a value). Everything is checked before anything is recorded: the
shapes agree, B x H and the number of observations are bounded, every value is finite and in
its statistic's range; each refusal is a 422 whose loc names the observation and the field.
"""

from __future__ import annotations

import binascii
import math
from typing import Annotated, Any, Final

import numpy as np
import numpy.typing as npt
from pydantic import AfterValidator, BaseModel, ConfigDict, Field, WithJsonSchema
from pydantic_core import PydanticCustomError

from service.errors import FieldError, InvalidRequest
from service.wire.models import B64_PATTERN, RequestModel, validate_request

# One body: at most this many observations (a 256-layer model's sampled forward), each of at
# most MAX_OBSERVED_HEADS (sequences x heads) values per statistic, and MAX_BODY_HEADS in all.
MAX_OBSERVATIONS: Final = 256
MAX_OBSERVED_HEADS: Final = 65_536
MAX_BODY_HEADS: Final = 262_144
# The largest key count a report may claim (int32's): bounds log(visible keys) and exp(H).
MAX_VISIBLE_KEYS: Final = 2**31 - 1
# Rounding room on a bound that the statistic reaches exactly (a float32 report of a
# normalized entropy of 1 may read 1.0000001).
SLACK: Final = 1e-5

Array = npt.NDArray[np.float64]

# name -> (lowest, highest); None: bounded by the observation (entropy by log(visible keys),
# masked rows by n_q), or not at all.
RANGES: Final[dict[str, tuple[float, float | None]]] = {
    "entropy": (0.0, None),
    "normalized_entropy": (0.0, 1.0),
    "max_weight": (0.0, 1.0),
    "sink_share": (0.0, 1.0),
    "saturated_fraction": (0.0, 1.0),
    "score_abs_max_scaled": (0.0, None),
    "masked_rows": (0.0, None),
}
REQUIRED: Final = ("entropy", "normalized_entropy", "max_weight", "sink_share",
                   "score_abs_max_scaled")  # fmt: skip

_PACKED_DTYPES: Final[dict[str, np.dtype[Any]]] = {
    "float32": np.dtype("<f4"),
    "float64": np.dtype("<f8"),
}
_NESTED_2D: Final = {"type": "array", "items": {"type": "array", "items": {"type": "number"}}}
_PACKED: Final = {
    "type": "object",
    "required": ["dtype", "shape", "b64"],
    "additionalProperties": False,
    "properties": {
        "dtype": {"enum": list(_PACKED_DTYPES)},
        "shape": {
            "type": "array",
            "items": {"type": "integer", "minimum": 1},
            "minItems": 2,
            "maxItems": 2,
        },
        "b64": {"type": "string", "pattern": B64_PATTERN, "contentEncoding": "base64"},
    },
}


def _refuse(kind: str, message: str, **context: Any) -> PydanticCustomError:
    return PydanticCustomError(kind, message, context)


def _nested(value: list[Any]) -> Array:
    if not value or not all(isinstance(row, list) for row in value):
        raise _refuse("per_head_shape", "must be [sequences, heads]: a list of lists of numbers")
    width = len(value[0])
    if width == 0 or any(len(row) != width for row in value):
        raise _refuse("per_head_shape", "rows must be non-empty and of one length (heads)")
    if len(value) * width > MAX_OBSERVED_HEADS:
        raise _refuse("per_head_size", "at most {limit} values (sequences x heads)",
                      limit=f"{MAX_OBSERVED_HEADS:,}")  # fmt: skip
    for row in value:
        for x in row:
            if isinstance(x, bool) or not isinstance(x, int | float):
                raise _refuse("per_head_number", "values must be numbers")
    try:
        return np.asarray(value, dtype=np.float64)
    except OverflowError:  # an integer past float64's range (JSON allows any)
        raise _refuse("finite", "values must be finite (no NaN or Inf)") from None


def _packed(value: dict[str, Any]) -> Array:
    unknown = sorted(set(value) - {"dtype", "shape", "b64"})
    if unknown:
        raise _refuse("per_head_packed", "unknown field {name!r} in a packed array "
                      "(it takes dtype, shape, b64)", name=unknown[0][:64])  # fmt: skip
    dtype, shape, b64 = value.get("dtype"), value.get("shape"), value.get("b64")
    if not isinstance(dtype, str) or dtype not in _PACKED_DTYPES:
        raise _refuse("per_head_packed", "'dtype' must be float32 or float64")
    if (
        not isinstance(shape, list)
        or len(shape) != 2
        or not all(type(n) is int and n >= 1 for n in shape)
    ):
        raise _refuse("per_head_shape", "'shape' must be [sequences, heads], each >= 1")
    if shape[0] * shape[1] > MAX_OBSERVED_HEADS:
        raise _refuse("per_head_size", "at most {limit} values (sequences x heads)",
                      limit=f"{MAX_OBSERVED_HEADS:,}")  # fmt: skip
    if not isinstance(b64, str):
        raise _refuse("per_head_packed", "'b64' must be a base64 string")
    itemsize = _PACKED_DTYPES[dtype].itemsize
    want = shape[0] * shape[1] * itemsize
    if len(b64) != 4 * math.ceil(want / 3):  # checked before decoding anything
        raise _refuse("per_head_bytes", "'b64' must hold {want} bytes (shape x {size})",
                      want=want, size=itemsize)  # fmt: skip
    try:
        raw = binascii.a2b_base64(b64.encode("ascii"), strict_mode=True)
    except (binascii.Error, UnicodeEncodeError):
        raise _refuse("per_head_b64", "'b64' is not base64") from None
    if len(raw) != want:
        raise _refuse("per_head_bytes", "'b64' must hold {want} bytes (shape x {size})",
                      want=want, size=itemsize)  # fmt: skip
    array = np.frombuffer(raw, dtype=_PACKED_DTYPES[dtype]).reshape(shape)
    return np.asarray(array, dtype=np.float64)


def _as_array(value: Any) -> Array:
    """A per-head value: a finite [B, H] array of float64."""
    if isinstance(value, list):
        array = _nested(value)
    elif isinstance(value, dict):
        array = _packed(value)
    else:
        raise _refuse("per_head_type", "must be [[...]] (sequences x heads) or a packed array")
    if not np.isfinite(array).all():
        raise _refuse("finite", "values must be finite (no NaN or Inf)")
    return array


PerHeadArray = Annotated[
    Any,
    AfterValidator(_as_array),
    WithJsonSchema({"anyOf": [_NESTED_2D, _PACKED]}),
]


class ObservedHeads(RequestModel):
    """Per-head statistics, each [sequences, heads], as sdpa_core's diagnostics define them."""

    entropy: PerHeadArray = Field(description="Mean row entropy (nats), in [0, log keys].")
    normalized_entropy: PerHeadArray = Field(description="H / log(visible keys), in [0, 1].")
    max_weight: PerHeadArray = Field(description="Mean of the rows' largest weight, [0, 1].")
    sink_share: PerHeadArray = Field(
        description="Mean weight on the first SDPA_HEALTH_SINK_TOKENS keys, in [0, 1]."
    )
    score_abs_max_scaled: PerHeadArray = Field(description="Largest |scaled score|, >= 0.")
    saturated_fraction: PerHeadArray | None = Field(
        default=None, description="Share of rows whose max weight is >= 0.99, in [0, 1]."
    )
    masked_rows: PerHeadArray | None = Field(
        default=None, description="Rows that saw no key: integers in [0, n_q]; needs n_q."
    )


class Observation(RequestModel):
    """One attention call's statistics (a layer of a sampled forward)."""

    tag: str = Field(
        pattern=r"^[A-Za-z0-9_.:/-]{1,64}$",
        description="The health metrics' tag (1-64 of A-Z a-z 0-9 _ . : / -), as a request's.",
    )
    visible_keys_max: int = Field(
        ge=1, le=MAX_VISIBLE_KEYS, description="The most keys any row saw (bounds the entropy)."
    )
    n_q: int | None = Field(
        default=None, ge=1, le=MAX_VISIBLE_KEYS, description="Query rows per head."
    )
    per_head: ObservedHeads


OBSERVE_EXAMPLE: Final[dict[str, Any]] = {
    "observations": [
        {
            "tag": "minilm/layer0",
            "visible_keys_max": 3,
            "n_q": 3,
            "per_head": {
                "entropy": [[0.95, 1.02]],
                "normalized_entropy": [[0.86, 0.93]],
                "max_weight": [[0.52, 0.44]],
                "sink_share": [[1.0, 1.0]],
                "score_abs_max_scaled": [[2.1, 1.4]],
                "saturated_fraction": [[0.0, 0.0]],
                "masked_rows": [[0, 0]],
            },
        }
    ]
}


class ObserveRequest(RequestModel):
    """POST /v1/health/observe: one or more attention calls' per-head statistics."""

    observations: list[Observation] = Field(min_length=1, max_length=MAX_OBSERVATIONS)


class ObserveResponse(BaseModel):
    """What was recorded: how many observations, and each one's tag as labelled ("other" past
    the tenant's share of SDPA_HEALTH_MAX_TAGS)."""

    model_config = ConfigDict(frozen=True)

    recorded: int
    tags: list[str]


OBSERVE_REQUEST_MODELS: Final[tuple[type[BaseModel], ...]] = (ObserveRequest,)
OBSERVE_RESPONSE_MODELS: Final[tuple[type[BaseModel], ...]] = (ObserveResponse,)


def _where(index: int, name: str) -> tuple[str | int, ...]:
    return ("body", "observations", index, "per_head", name)


def _check(index: int, observation: Observation) -> list[FieldError]:
    """The cross-field rules pydantic's field checks cannot see: one shape, each value in its
    range (entropy up to log(visible_keys_max), masked rows whole and up to n_q)."""
    heads = observation.per_head
    arrays: dict[str, Array] = {
        name: getattr(heads, name) for name in RANGES if getattr(heads, name) is not None
    }
    errors: list[FieldError] = []
    shape = arrays["entropy"].shape
    for name, array in arrays.items():
        if array.shape != shape:
            msg = f"shape {list(array.shape)} differs from entropy's {list(shape)}"
            errors.append(FieldError(loc=_where(index, name), msg=msg, type="per_head_shape"))
            continue
        low, high = RANGES[name]
        if name == "entropy":
            high = math.log(observation.visible_keys_max)
        elif name == "masked_rows":
            if observation.n_q is None:
                msg = "masked_rows needs n_q (the rows per head they are counted among)"
                errors.append(FieldError(loc=_where(index, name), msg=msg, type="missing"))
                continue
            high = float(observation.n_q)
            if not np.array_equal(array, np.round(array)):
                msg = "masked_rows must be whole numbers"
                errors.append(FieldError(loc=_where(index, name), msg=msg, type="integer"))
                continue
        slack = 0.0 if name == "masked_rows" else SLACK * max(1.0, high or 1.0)
        below = array < low - slack
        above = np.zeros_like(below) if high is None else array > high + slack
        if below.any() or above.any():
            bad = float(array[below | above].flat[0])
            upper = "" if high is None else f", at most {high:.6g}"
            msg = f"values must be at least {low:g}{upper}; got {bad:.6g}"
            errors.append(FieldError(loc=_where(index, name), msg=msg, type="range"))
    return errors


def parse_observe(payload: Any) -> ObserveRequest:
    """The parsed JSON body as an ObserveRequest whose every value is in range, or
    InvalidRequest (422) naming every bad field.

    Two forms: {"observations": [...]} (the tap's, one body per sampled forward) and one
    observation as the whole body ({"tag", "per_head", "visible_keys_max"}, the design's), whose
    errors name its fields as they stand in that body."""
    if isinstance(payload, dict) and "observations" not in payload:
        try:
            return _parse_batch({"observations": [payload]})
        except InvalidRequest as error:
            raise _as_single(error) from None
    return _parse_batch(payload)


def _as_single(error: InvalidRequest) -> InvalidRequest:
    """A one-observation body's error, its locations without the batch's wrapping."""
    wrapped = ("body", "observations", 0)

    def strip(loc: tuple[str | int, ...]) -> tuple[str | int, ...]:
        return ("body", *loc[3:]) if loc[:3] == wrapped else loc

    errors = [FieldError(loc=strip(e.loc), msg=e.msg, type=e.type) for e in error.errors]
    detail = error.detail.removeprefix("observations.0.")
    return InvalidRequest(detail, errors=errors)


def _parse_batch(payload: Any) -> ObserveRequest:
    request = validate_request(payload, ObserveRequest)
    errors: list[FieldError] = []
    total = 0
    for index, observation in enumerate(request.observations):
        errors.extend(_check(index, observation))
        total += observation.per_head.entropy.size
    if total > MAX_BODY_HEADS:
        msg = f"at most {MAX_BODY_HEADS:,} heads in one body (all observations); got {total:,}"
        errors.append(FieldError(loc=("body", "observations"), msg=msg, type="too_many_heads"))
    if errors:
        first = errors[0]
        where = ".".join(str(p) for p in first.loc[1:])
        raise InvalidRequest(f"{where}: {first.msg}", errors=errors)
    return request
