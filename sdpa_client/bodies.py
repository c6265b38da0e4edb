"""The pieces of a request body: tensors, masks, strategies, as the service's v1 API reads them.

The endpoints (`sdpa_client.calls`) assemble whole bodies from these pieces.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from typing import Any, Literal, TypeAlias

import numpy as np

from sdpa_client.codec import Encoding, encode_tensor, is_torch_tensor, to_numpy

Causal: TypeAlias = bool | Literal["top_left", "bottom_right"]
"""False; True (= "top_left": query i sees keys j <= i); "bottom_right" (j <= i + N_kv - N_q)."""

DiagnosticsLevel: TypeAlias = Literal["none", "summary", "full"]
"""How much the server reports about the attention it computed."""

StrategySpec: TypeAlias = str | tuple[str, float]
"""A standard strategy's name ("none", "sqrt_dk", "dk", ...) or a custom (name, divisor)."""


def tensors(encoding: Encoding, **named: object) -> dict[str, dict[str, Any]]:
    """Each named tensor as its wire object (the name also names it in error messages)."""
    return {name: encode_tensor(x, encoding=encoding, param=name) for name, x in named.items()}


def mask_fields(
    key_lengths: object | None,
    key_padding_mask: object | None,
    attn_mask: object | None,
    encoding: Encoding,
) -> dict[str, Any]:
    """The three mask fields, None where not given.

    Raises:
        TypeError: key_lengths not integers, or key_padding_mask not boolean.
    """
    return {
        "key_lengths": None if key_lengths is None else _int_list(key_lengths),
        "key_padding_mask": None
        if key_padding_mask is None
        else _bool_mask(key_padding_mask, encoding=encoding),
        "attn_mask": None
        if attn_mask is None
        else encode_tensor(attn_mask, encoding=encoding, param="attn_mask"),
    }


def _int_list(x: object) -> Any:
    if is_torch_tensor(x):
        return x.tolist()  # type: ignore[attr-defined]
    arr = np.asarray(x)
    if arr.dtype.kind not in "iu":
        raise TypeError(f"key_lengths: expected integers, got dtype {arr.dtype}")
    return arr.tolist()


def _bool_mask(x: object, *, encoding: Encoding) -> dict[str, Any]:
    wire, _ = to_numpy(x, param="key_padding_mask")
    if wire != "bool":
        raise TypeError(f"key_padding_mask: expected a boolean mask, got dtype {wire}")
    return encode_tensor(x, encoding=encoding, param="key_padding_mask")


def strategy_list(strategies: Sequence[StrategySpec]) -> list[str | dict[str, Any]]:
    """Names as they are; custom pairs as {"name", "divisor"}."""
    return [s if isinstance(s, str) else {"name": s[0], "divisor": float(s[1])} for s in strategies]


def optional_float(x: float | None) -> float | None:
    """float(x), or None."""
    return None if x is None else float(x)


def checked_priority(priority: object) -> int:
    """A request's priority level as sent: Triton's convention, 1 the highest level, larger
    numbers lower, 0 the server's default level. The server refuses a level above its
    SDPA_PRIORITY_LEVELS (a 422 that names the field); only the type and sign are checked here.

    Raises:
        TypeError: not an integer (a bool is refused: True is not a level).
        ValueError: a negative number.
    """
    if isinstance(priority, bool | np.bool_) or not isinstance(priority, int | np.integer):
        raise TypeError(
            f"priority: expected a non-negative int (1 = highest, 0 = the server's default), "
            f"got {type(priority).__name__} {priority!r}"
        )
    if priority < 0:
        raise ValueError(
            f"priority: expected a non-negative int (1 = highest, 0 = the server's default), "
            f"got {priority}"
        )
    return int(priority)


def priority_field(priority: object | None) -> dict[str, int]:
    """{"priority": level} for a v1 body, or nothing for None (the server's default level; a
    server older than the field still takes the request).

    Raises:
        TypeError, ValueError: as `checked_priority`.
    """
    return {} if priority is None else {"priority": checked_priority(priority)}


def analyze_inputs(
    q: object | None, k: object | None, synthetic: Mapping[str, Any] | None, encoding: Encoding
) -> dict[str, Any]:
    """The q/k or synthetic fields of an analyze body.

    Raises:
        ValueError: only one of q and k, or neither q/k nor synthetic.
    """
    if (q is None) != (k is None):
        raise ValueError("analyze: give both q and k, or neither (with synthetic=...)")
    if q is None and synthetic is None:
        raise ValueError("analyze: give q and k, or synthetic={'n_q': ..., 'd_k': ...}")
    fields: dict[str, Any] = {} if q is None else tensors(encoding, q=q, k=k)
    if synthetic is not None:
        fields["synthetic"] = dict(synthetic)
    return fields
