"""The cases the v2 (Open Inference Protocol) end-to-end tests send, and their float64 truth.

Each case is numpy inputs and options; `expected()` computes what the server must answer with
the independent float64 reference of tests/core/reference.py (nothing from sdpa_core). The
tritonclient tests and the sdpa_client tests send the same cases through their own clients.
"""

from __future__ import annotations

import math
from dataclasses import dataclass, field
from typing import Any

import numpy as np
import numpy.typing as npt
import torch

from tests.core.reference import RefRows, reference_attention, reference_rows, visibility

# The datatypes of q, k and v, by v2 name.
FLOAT_DATATYPES = ("FP16", "BF16", "FP32", "FP64")
TORCH_OF = {
    "FP16": torch.float16,
    "BF16": torch.bfloat16,
    "FP32": torch.float32,
    "FP64": torch.float64,
}
# Error bounds against the float64 reference: the dtype's rounding of the output, a few times
# over (softmax accumulates in float32; the result is rounded once to the input dtype).
TOLERANCE = {"FP16": 4e-3, "BF16": 3e-2, "FP32": 2e-5, "FP64": 1e-10}


def numpy_dtype(datatype: str) -> Any:
    if datatype == "BF16":
        import ml_dtypes  # tritonclient's BF16 type; a dependency of tritonclient[http]

        return ml_dtypes.bfloat16
    return {"FP16": np.float16, "FP32": np.float32, "FP64": np.float64}[datatype]


@dataclass
class Case:
    """One attention request: inputs as numpy arrays and the request's options."""

    q: npt.NDArray[Any]
    k: npt.NDArray[Any]
    v: npt.NDArray[Any]
    datatype: str = "FP32"
    causal: bool | str = False
    key_lengths: npt.NDArray[Any] | None = None  # int32 or int64
    key_padding_mask: npt.NDArray[np.bool_] | None = None
    attn_mask: npt.NDArray[Any] | None = None  # bool, or the inputs' float dtype
    scale: float | None = None
    temperature: float | None = None
    parameters: dict[str, Any] = field(default_factory=dict)

    def inputs(self) -> list[tuple[str, npt.NDArray[Any], str]]:
        """(name, array, v2 datatype) of every input the case sends."""
        out = [(name, getattr(self, name), self.datatype) for name in ("q", "k", "v")]
        if self.key_lengths is not None:
            dt = "INT32" if self.key_lengths.dtype == np.int32 else "INT64"
            out.append(("key_lengths", self.key_lengths, dt))
        if self.key_padding_mask is not None:
            out.append(("key_padding_mask", self.key_padding_mask, "BOOL"))
        if self.attn_mask is not None:
            dt = "BOOL" if self.attn_mask.dtype == np.bool_ else self.datatype
            out.append(("attn_mask", self.attn_mask, dt))
        return out

    def request_parameters(self) -> dict[str, Any]:
        params = dict(self.parameters)
        if self.causal is not False:
            params["causal"] = self.causal
        if self.scale is not None:
            params["scale"] = self.scale
        if self.temperature is not None:
            params["temperature"] = self.temperature
        return params


def make_case(
    shape_q: tuple[int, ...],
    shape_kv: tuple[int, ...] | None = None,
    *,
    datatype: str = "FP32",
    seed: int = 0,
    **options: Any,
) -> Case:
    """Random inputs, exactly representable in `datatype` (so the reference sees what the
    server sees)."""
    rng = np.random.default_rng(seed)
    shape_kv = shape_kv or shape_q
    dt = numpy_dtype(datatype)
    q, k, v = (
        rng.standard_normal(shape, dtype=np.float64).astype(dt)
        for shape in (shape_q, shape_kv, shape_kv)
    )
    return Case(q=q, k=k, v=v, datatype=datatype, **options)


@dataclass(frozen=True)
class Expected:
    output: npt.NDArray[np.float64]  # [B, H, N_q, D_v]
    weights: npt.NDArray[np.float64]  # [B, H, N_q, N_kv]
    rows: RefRows
    scale: float


def _as_float64(arr: npt.NDArray[Any]) -> torch.Tensor:
    return torch.from_numpy(np.asarray(arr).astype(np.float64))


def expected(case: Case) -> Expected:
    """The float64 truth of a 4-D case."""
    q, k, v = (_as_float64(x) for x in (case.q, case.k, case.v))
    b, h, n_q, d = q.shape
    n_kv = k.shape[-2]
    causal = {False: "none", True: "top_left"}.get(case.causal, case.causal)  # type: ignore[call-overload]
    lengths = None if case.key_lengths is None else case.key_lengths.astype(np.int64).tolist()
    pad = None if case.key_padding_mask is None else torch.from_numpy(case.key_padding_mask)
    mask: torch.Tensor | None = None
    bias: torch.Tensor | None = None
    if case.attn_mask is not None:
        if case.attn_mask.dtype == np.bool_:
            mask = torch.from_numpy(case.attn_mask)
        else:
            mask = bias = _as_float64(case.attn_mask)
    visible = visibility(
        b=b, h=h, n_q=n_q, n_kv=n_kv, causal=str(causal), key_lengths=lengths,
        key_padding_mask=pad, attn_mask=mask,
    )  # fmt: skip
    scale = case.scale if case.scale is not None else 1.0 / math.sqrt(d)
    if case.temperature is not None:
        scale = 1.0 / (case.temperature * math.sqrt(d))
    ref = reference_attention(q, k, v, visible, scale=scale, bias=bias)
    rows = reference_rows(ref, scale=scale, bias=bias)
    return Expected(output=ref.out.numpy(), weights=ref.weights.numpy(), rows=rows, scale=scale)


def assert_close(got: npt.NDArray[Any], want: npt.NDArray[np.float64], datatype: str) -> None:
    """got (the server's, in `datatype`) against the float64 truth."""
    tol = TOLERANCE[datatype]
    np.testing.assert_allclose(
        np.asarray(got).astype(np.float64), want, rtol=tol, atol=tol * max(1.0, np.abs(want).max())
    )


def mask_cases() -> dict[str, Case]:
    """Every mask option, GQA, and fully masked rows, on small FP32 inputs."""
    q4 = (2, 4, 6, 8)
    rng = np.random.default_rng(7)
    bias = rng.standard_normal((1, 1, 6, 6)).astype(np.float32)
    bias[..., 0, 3:] = -np.inf  # the first query sees only its first three keys
    return {
        "causal_true": make_case(q4, causal=True),
        "top_left": make_case(q4, causal="top_left"),
        "bottom_right": make_case((2, 4, 3, 8), (2, 4, 6, 8), causal="bottom_right"),
        "key_lengths_int32": make_case(q4, key_lengths=np.array([4, 6], dtype=np.int32)),
        "key_lengths_per_head_int64": make_case(
            q4, key_lengths=np.array([[1, 2, 3, 6], [6, 5, 4, 3]], dtype=np.int64)
        ),
        "key_padding_mask": make_case(
            q4, key_padding_mask=np.array([[0, 0, 0, 1, 1, 1], [0] * 6], dtype=np.bool_)
        ),
        "attn_mask_bool": make_case(q4, attn_mask=np.tril(np.ones((6, 6), dtype=np.bool_))),
        "attn_mask_float": make_case(q4, attn_mask=bias),
        "gqa": make_case((2, 4, 6, 8), (2, 2, 6, 8), causal=True),
        "mqa_cross": make_case((1, 4, 5, 8), (1, 1, 7, 8)),
        # The second sequence sees no key at all: output 0, lse -inf, 4 x 6 masked rows.
        "fully_masked": make_case(q4, key_lengths=np.array([5, 0], dtype=np.int64)),
        "scale": make_case(q4, scale=0.05),
        "temperature": make_case(q4, temperature=2.5),
    }
