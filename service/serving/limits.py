"""Size limits checked before a request is queued (SDPA_MAX_ELEMENTS, SDPA_MAX_WEIGHTS_ELEMENTS).

Each refusal is a 422 naming the field, the limit and how to stay under it.
"""

from __future__ import annotations

from sdpa_core import InputSpec
from service.errors import FieldError, InvalidRequest
from service.settings import Settings
from service.wire.models import Synthetic

Loc = tuple[str | int, ...]


def over_limit(loc: Loc, msg: str, *, kind: str = "limit") -> InvalidRequest:
    """A 422 for one field; `kind` is the error's type."""
    return InvalidRequest(msg, errors=[FieldError(loc=loc, msg=msg, type=kind)])


def check_attention_limits(spec: InputSpec, *, return_weights: bool, settings: Settings) -> None:
    """The output, and the weights when asked for, must fit the element limits."""
    rows = spec.batch * spec.heads * spec.n_q
    out_elements = rows * spec.d_v
    if out_elements > settings.max_elements:
        raise over_limit(
            ("body", "v"),
            f"the output [..., H, N_q, D_v] would hold {out_elements} elements, above the limit "
            f"of {settings.max_elements} per tensor (SDPA_MAX_ELEMENTS); send fewer sequences, "
            "heads or queries per request",
        )
    weights = rows * spec.n_kv
    if return_weights and weights > settings.max_weights_elements:
        raise over_limit(
            ("body", "return_weights"),
            f"the attention weights [..., H, N_q, N_kv] would hold {weights} elements, above "
            f"SDPA_MAX_WEIGHTS_ELEMENTS = {settings.max_weights_elements}. Ask for diagnostics "
            'without weights instead (return_weights: false, diagnostics: "summary" or "full"): '
            "they are computed in O(N) memory. Or send fewer queries or keys per request.",
        )


def check_analysis_limits(spec: InputSpec, *, where: Loc, settings: Settings) -> None:
    """The analysis materializes the [..., H, N_q, N_kv] scores: they must fit the weights limit."""
    scores = spec.batch * spec.heads * spec.n_q * spec.n_kv
    if scores > settings.max_weights_elements:
        raise over_limit(
            where,
            f"the analysis holds the [..., H, N_q, N_kv] scores: {scores} elements, above "
            f"SDPA_MAX_WEIGHTS_ELEMENTS = {settings.max_weights_elements}; use fewer queries or "
            "keys (a few hundred of each estimate the statistics well)",
        )


def check_synthetic_limits(syn: Synthetic, settings: Settings) -> None:
    """Synthetic sizes are refused before any random number is drawn (drawing is costly)."""
    for name, n in (("n_q", syn.n_q), ("n_k", syn.n_k)):
        elements = syn.heads * n * syn.d_k
        if elements > settings.max_elements:
            raise over_limit(
                ("body", "synthetic", name),
                f"heads x {name} x d_k = {elements} elements exceed the limit of "
                f"{settings.max_elements} per tensor (SDPA_MAX_ELEMENTS)",
            )
    scores = syn.heads * syn.n_q * syn.n_k
    if scores > settings.max_weights_elements:
        raise over_limit(
            ("body", "synthetic"),
            f"heads x n_q x n_k = {scores} scores exceed the limit of "
            f"{settings.max_weights_elements} (SDPA_MAX_WEIGHTS_ELEMENTS)",
        )
