"""Prepare a v2 infer request: body bytes -> the same validated, limit-checked job as v1's,
plus what the v2 response needs (which outputs, in which form).

The output rule: what the request names in `outputs` is what is computed and returned (naming
"weights" asks for the weights, naming a per-row statistic asks for diagnostics "full", and a
list without "output" leaves the output out of the answer); with no `outputs`, the response
holds "output" (and the per-row statistics when diagnostics is "full"), never the n^2 weights.
The per-head statistics ("<stat>_per_head", [..., H]) are part of the summary: a request names
them with diagnostics "summary" or "full".
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Final

import torch

from sdpa_core import PER_HEAD_FIELDS, PER_ROW_FIELDS, Masks
from service.errors import MAX_LOC_TEXT, FieldError, InvalidRequest, clip
from service.runtime.jobs import AttentionJob
from service.runtime.policy import CostModel
from service.serving.limits import check_priority
from service.serving.prepare import PreparedRequest, prepare_attention_job, temperature_scale
from service.settings import Settings
from service.wire.codec import loads_request
from service.wire.json_arrays import Pieces
from service.wire.v2_codec import decode_inputs, split_header
from service.wire.v2_models import InferRequest, RequestParameters, array_slot, parse_infer_request

# The per-row statistics a request may name as outputs (diagnostics "full"), the per-head ones
# (diagnostics "summary" or "full"; output name -> statistic), then all outputs.
PER_ROW_OUTPUTS: Final = PER_ROW_FIELDS
PER_HEAD_SUFFIX: Final = "_per_head"
PER_HEAD_OUTPUTS: Final[dict[str, str]] = {
    f"{name}{PER_HEAD_SUFFIX}": name for name in PER_HEAD_FIELDS
}
OUTPUT_NAMES: Final = ("output", "weights", *PER_ROW_OUTPUTS, *PER_HEAD_OUTPUTS)
_KNOWN_OUTPUTS: Final = (
    f"the model computes output, weights, the per-row statistics {', '.join(PER_ROW_OUTPUTS)}, "
    f"and <stat>{PER_HEAD_SUFFIX} for each per-head statistic {', '.join(PER_HEAD_FIELDS)}"
)


@dataclass(frozen=True, slots=True)
class PreparedInfer:
    """A prepared v2 request: the serving layer's job and the response's shape."""

    request: PreparedRequest
    id: str | None  # the request's own "id", echoed in the response
    outputs: tuple[tuple[str, bool], ...]  # (name, as binary data), in response order
    summary: bool  # the summary statistics go back as response parameters


def _invalid(message: str, *where: str) -> InvalidRequest:
    return InvalidRequest(message, errors=[FieldError(loc=("v2", *where), msg=message)])


def _outputs(req: InferRequest, params: RequestParameters) -> tuple[tuple[str, bool], ...]:
    default_binary = params.binary_data_output
    if not req.outputs:  # absent (or empty): the defaults
        names = ("output", *(PER_ROW_FIELDS if params.diagnostics == "full" else ()))
        return tuple((name, default_binary) for name in names)
    seen: set[str] = set()
    plan: list[tuple[str, bool]] = []
    for out in req.outputs:
        if out.name not in OUTPUT_NAMES:
            name = clip(out.name, MAX_LOC_TEXT)
            raise _invalid(f"unknown output {name!r}: {_KNOWN_OUTPUTS}", "outputs", name)
        if out.name in seen:
            raise _invalid(f"output {out.name!r} is requested twice", "outputs", out.name)
        if out.name in PER_HEAD_OUTPUTS and params.diagnostics == "none":
            raise _invalid(
                f"output {out.name!r} is a per-head statistic of the summary: it needs "
                'parameter \'diagnostics\' "summary" or "full", not "none"',
                "outputs",
                out.name,
            )
        seen.add(out.name)
        binary = None if out.parameters is None else out.parameters.binary_data
        plan.append((out.name, default_binary if binary is None else binary))
    return tuple(plan)


def prepare_infer(
    body: bytes,
    header_length: str | None,
    settings: Settings,
    cost: CostModel,
    *,
    pieces: Pieces | None = None,
) -> PreparedInfer:
    """A v2 REST infer body (and its Inference-Header-Content-Length) -> a prepared request
    within every limit. Raises InvalidRequest / SdpaError (a 400 on v2). With `pieces`, the
    JSON's big lists of numbers are parsed in pieces (service.wire.json_arrays); the answer is
    the same."""
    header, offset = split_header(body, header_length)
    if pieces is None:
        payload = loads_request(header, allow_inf_nan=True)
    else:
        payload = loads_request(header, allow_inf_nan=True, slot_of=array_slot, pieces=pieces)
    return prepare_parsed(parse_infer_request(payload), body, offset, settings, cost)


def prepare_parsed(
    req: InferRequest, body: bytes, offset: int, settings: Settings, cost: CostModel
) -> PreparedInfer:
    """A v2 infer request, its JSON part parsed (from REST's header, or from gRPC's message),
    and its binary data: `body[offset:]`, each input's bytes in the order of the inputs ->
    a prepared request within every limit."""
    params = req.parameters or RequestParameters()
    if params.scale is not None and params.temperature is not None:
        raise _invalid(
            "parameters 'scale' and 'temperature': give one, not both (temperature T means "
            "scale 1/(T·sqrt(D)))",
            "parameters",
            "temperature",
        )
    outputs = _outputs(req, params)
    named = {name for name, _ in outputs}
    tensors = decode_inputs(req, body, offset, max_elements=settings.max_elements)
    q = tensors["q"]
    for name, binary in outputs:
        # BF16 results travel as binary data only (tritonclient cannot read BF16 JSON); the
        # per-row and per-head statistics are float32 or wider.
        if not binary and name in ("output", "weights") and q.dtype == torch.bfloat16:
            raise _invalid(
                f"output {name!r}: BF16 travels only as binary data; ask for it with "
                "binary_data (or binary_data_output)",
                "outputs",
                name,
            )
    diagnostics = params.diagnostics
    if named & set(PER_ROW_FIELDS):
        diagnostics = "full"  # a per-row statistic was named: compute it
    scale = params.scale
    if params.temperature is not None:
        scale = temperature_scale(params.temperature, q)
    job = AttentionJob(
        q=q,
        k=tensors["k"],
        v=tensors["v"],
        masks=Masks(
            causal=params.causal,
            key_lengths=tensors.get("key_lengths"),
            key_padding_mask=tensors.get("key_padding_mask"),
            attn_mask=tensors.get("attn_mask"),
        ),
        scale=scale,
        return_weights="weights" in named,
        diagnostics=diagnostics,
    )
    all_binary = all(binary for _, binary in outputs)
    prepared = prepare_attention_job(
        job,
        encoding="base64" if all_binary else "json",
        # Binary outputs are sent as they sit in memory; a mix is sized as JSON (from above).
        sized_as="binary" if all_binary else "json",
        timeout_ms=params.timeout / 1000.0 if params.timeout else None,
        settings=settings,
        cost=cost,
        tag=params.tag,
        return_output="output" in named,
        priority=check_priority(
            params.priority, settings=settings, loc=("v2", "parameters", "priority")
        ),
    )
    return PreparedInfer(
        request=prepared,
        id=req.id,
        outputs=outputs,
        summary=params.diagnostics in ("summary", "full"),
    )
