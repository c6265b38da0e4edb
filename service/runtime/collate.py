"""Stack, pad and split: a group of requests as one [B, H, N, D] call, and back.

Every request of a group is flattened to [b, H, N, D] (b = the product of its own leading
dims; a 3-D or 2-D input has b = 1) and concatenated along the batch dim. Requests of one
shape are simply stacked. Different N_q / N_kv are padded with zeros to the group's maximum:

- padded keys become invisible through key_lengths (each request's own key_lengths, or its
  length N_kv), or through a key_padding_mask [B, (H,) N_kv] when some request brings its own
  key_padding_mask; a request's attn_mask is padded with False (bool) or -inf (float);
- padded query rows are computed and sliced off on return.

Padding sits at the end of the sequence, except for causal "bottom_right", whose alignment
depends on N_kv - N_q: there both the queries and the keys are padded at the *front*, so that
in the padded batch real query i still sees exactly the real keys j <= i + N_kv - N_q (the
padded keys before them are masked), whatever the group's maximum lengths are.

Each request then gets its own slice of the output and weights, and its own diagnostics:
summarize() over its own rows of the batch's RowStats, never batch-pooled numbers. So a
request's output, weights and diagnostics equal a solo call's up to float reduction order.
"""

from __future__ import annotations

import math
from dataclasses import dataclass, replace
from typing import Literal

import torch

from sdpa_core import (
    AttentionResult,
    Diagnostics,
    InputSpec,
    Masks,
    RowStats,
    attn_mask_4d,
    key_lengths_by_head,
    key_padding,
    resolve_scale,
    summarize,
)
from service.runtime.device import results_on_host
from service.runtime.jobs import AttentionJob
from service.runtime.policy import Member


@dataclass(frozen=True, slots=True)
class Collated:
    """A group's padded inputs (CPU) and where each member's rows and keys sit in them."""

    members: tuple[Member, ...]  # with their batch offsets
    q: torch.Tensor  # [B, H, N_q, D]
    k: torch.Tensor  # [B, H_kv, N_kv, D]
    v: torch.Tensor  # [B, H_kv, N_kv, D_v]
    # The group's causal option (its first member's: the group key holds the mode) and
    # key_lengths [B] or [B, H], key_padding_mask [B, (H,) N_kv] (True = padding),
    # attn_mask [B, H|1, N_q, N_kv].
    masks: Masks
    n_q: int
    n_kv: int
    front: bool  # padded at the front (bottom-right causal)

    def q_rows(self, spec: InputSpec) -> slice:
        """A member's query rows in the padded batch."""
        return slice(self.n_q - spec.n_q, self.n_q) if self.front else slice(0, spec.n_q)

    def kv_cols(self, spec: InputSpec) -> slice:
        """A member's keys in the padded batch."""
        return slice(self.n_kv - spec.n_kv, self.n_kv) if self.front else slice(0, spec.n_kv)


def collate(batch: list[Member]) -> Collated:
    """The members of one group as one padded batch (module docstring)."""
    spec0 = batch[0].spec
    heads, kv_heads, d, d_v = spec0.heads, spec0.kv_heads, spec0.d, spec0.d_v
    front = spec0.causal == "bottom_right"
    causal_only = Masks(causal=batch[0].job.masks.causal)  # the key masks come last
    n_q = max(m.spec.n_q for m in batch)
    n_kv = max(m.spec.n_kv for m in batch)
    placed: list[Member] = []
    rows = 0
    for m in batch:
        placed.append(Member(index=m.index, job=m.job, spec=m.spec, offset=rows))
        rows += m.spec.batch

    if all(m.spec.n_q == n_q and m.spec.n_kv == n_kv for m in batch):
        q = torch.cat([m.job.q.reshape(m.spec.batch, heads, n_q, d) for m in batch])
        k = torch.cat([m.job.k.reshape(m.spec.batch, kv_heads, n_kv, d) for m in batch])
        v = torch.cat([m.job.v.reshape(m.spec.batch, kv_heads, n_kv, d_v) for m in batch])
        layout = Collated(tuple(placed), q, k, v, causal_only, n_q, n_kv, front)
    else:
        dtype = spec0.dtype
        q = torch.zeros(rows, heads, n_q, d, dtype=dtype)  # [B, H, N_q, D]
        k = torch.zeros(rows, kv_heads, n_kv, d, dtype=dtype)  # [B, H_kv, N_kv, D]
        v = torch.zeros(rows, kv_heads, n_kv, d_v, dtype=dtype)  # [B, H_kv, N_kv, D_v]
        layout = Collated(tuple(placed), q, k, v, causal_only, n_q, n_kv, front)
        for m in placed:
            s, b = m.spec, slice(m.offset, m.offset + m.spec.batch)
            q[b, :, layout.q_rows(s)] = m.job.q.reshape(s.batch, heads, s.n_q, d)
            k[b, :, layout.kv_cols(s)] = m.job.k.reshape(s.batch, kv_heads, s.n_kv, d)
            v[b, :, layout.kv_cols(s)] = m.job.v.reshape(s.batch, kv_heads, s.n_kv, d_v)

    key_lengths, key_padding_mask = _batch_key_masks(layout, rows, heads)
    masks = replace(
        causal_only,
        key_lengths=key_lengths,
        key_padding_mask=key_padding_mask,
        attn_mask=_batch_attn_mask(layout, rows, heads),
    )
    return replace(layout, masks=masks)


def split(collated: Collated, result: AttentionResult) -> list[AttentionResult]:
    """Each member's own slice of a batch's result (CPU), with its own diagnostics."""
    # output [B, H, N_q, D_v], weights [B, H, N_q, N_kv], row_stats [B, H, N_q]
    output, weights, row_stats = results_on_host(result.output, result.weights, result.row_stats)
    d_v = output.shape[-1]
    results: list[AttentionResult] = []
    for m in collated.members:
        s, b = m.spec, slice(m.offset, m.offset + m.spec.batch)
        rq, ck = collated.q_rows(s), collated.kv_cols(s)
        own_rows: RowStats | None = None
        if row_stats is not None:
            own_rows = row_stats.index((b, slice(None), rq)).reshape(s.row_shape)
        results.append(
            AttentionResult(
                output=output[b, :, rq].reshape(*s.row_shape, d_v),
                weights=None
                if weights is None
                else weights[b, :, rq, ck].reshape(*s.row_shape, s.n_kv),
                diagnostics=member_diagnostics(own_rows, m.job, s),
                row_stats=own_rows,
                path=result.path,
                backend=result.backend,
            )
        )
    return results


def member_diagnostics(
    rs: RowStats | None, job: AttentionJob, spec: InputSpec
) -> Diagnostics | None:
    """A request's diagnostics from its own rows, at the level it asked for."""
    if rs is None or job.diagnostics == "none":
        return None
    level: Literal["summary", "full"] = "full" if job.diagnostics == "full" else "summary"
    return summarize(rs, scale=resolve_scale(job.scale, spec.d), level=level)


def _batch_key_masks(
    layout: Collated, rows: int, heads: int
) -> tuple[torch.Tensor | None, torch.Tensor | None]:
    """The batch's key visibility: key_lengths [B] or [B, H] when every request's padding is a
    suffix (end padding, no key_padding_mask), else a key_padding_mask [B, (H,) N_kv]."""
    placed, n_kv = layout.members, layout.n_kv
    given = [m.job.masks for m in placed]  # each member's own
    needs = any(
        m.spec.n_kv < n_kv or masks.key_lengths is not None or masks.key_padding_mask is not None
        for m, masks in zip(placed, given, strict=True)
    )
    if not needs:
        return None, None
    if not layout.front and all(masks.key_padding_mask is None for masks in given):
        own_lengths = [
            None if masks.key_lengths is None else key_lengths_by_head(m.spec, masks.key_lengths)
            for m, masks in zip(placed, given, strict=True)
        ]  # each [b, H|1]
        width = heads if any(o is not None and o.shape[-1] > 1 for o in own_lengths) else 1
        lengths = torch.empty(rows, width, dtype=torch.int64)  # [B, H|1]
        for m, own in zip(placed, own_lengths, strict=True):
            lengths[m.offset : m.offset + m.spec.batch] = m.spec.n_kv if own is None else own
        return (lengths if width > 1 else lengths[:, 0]), None

    own_padding = [
        key_padding(m.spec, key_lengths=masks.key_lengths, key_padding_mask=masks.key_padding_mask)
        for m, masks in zip(placed, given, strict=True)
    ]  # each [b|1, H|1, n_kv] or None
    width = heads if any(o is not None and o.shape[1] > 1 for o in own_padding) else 1
    padding = torch.ones(rows, width, n_kv, dtype=torch.bool)  # [B, H|1, N_kv], all padding
    for m, own in zip(placed, own_padding, strict=True):
        b = slice(m.offset, m.offset + m.spec.batch)
        padding[b, :, layout.kv_cols(m.spec)] = False if own is None else own
    return None, (padding if width > 1 else padding[:, 0])


def _batch_attn_mask(layout: Collated, rows: int, heads: int) -> torch.Tensor | None:
    """Every request's attn_mask placed in a [B, H|1, N_q, N_kv] mask; padding False / -inf."""
    placed = layout.members
    if all(m.job.masks.attn_mask is None for m in placed):
        return None
    own_masks: list[torch.Tensor] = []
    for m in placed:
        mask = m.job.masks.attn_mask
        if mask is None:  # cannot happen within one group (the mask kind is in the key)
            raise RuntimeError("a group mixes requests with and without attn_mask")
        own_masks.append(attn_mask_4d(mask, m.spec))  # [b|1, H|1, n_q|1, n_kv|1]
    width = heads if any(own.shape[1] > 1 for own in own_masks) else 1
    dtype = own_masks[0].dtype
    fill: bool | float = False if dtype == torch.bool else -math.inf
    out = torch.full((rows, width, layout.n_q, layout.n_kv), fill, dtype=dtype)
    for m, own in zip(placed, own_masks, strict=True):
        s = m.spec
        b = slice(m.offset, m.offset + s.batch)
        out[b, :, layout.q_rows(s), layout.kv_cols(s)] = own  # broadcast [b|1, H|1, ...]
    return out  # [B, H|1, N_q, N_kv]
