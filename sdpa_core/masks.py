"""Every mask option -> one boolean visibility (True = the query may attend to the key).

Masks combine by logical AND, as booleans, never by adding large negative numbers (fp16
overflow, -inf + -inf; kernel-anchors pitfall 4). A float attn_mask is kept as an additive
bias for the visible entries; its -inf entries become "not visible".

The plan keeps each part in its smallest broadcastable 4-D shape (key lengths are
[B, 1|H, 1, N_kv], causal is generated from indices) so that the chunked path can build one
[.., tile_q, tile_k] block at a time and never holds an N_q x N_kv matrix.
"""

from __future__ import annotations

import math
from dataclasses import dataclass

import torch

from sdpa_core.shapes import CausalMode, InputSpec, as_key_lengths


@dataclass(frozen=True, slots=True)
class MaskPlan:
    """The visibility of a normalized [B, H, N_q, N_kv] score matrix, kept in parts."""

    n_q: int
    n_kv: int
    causal: CausalMode
    parts: tuple[torch.Tensor, ...]  # bool, each broadcastable to [B, H, N_q, N_kv]
    bias: torch.Tensor | None  # float attn_mask as 4-D, broadcastable; -inf where masked
    device: torch.device

    @property
    def is_empty(self) -> bool:
        """True when every key is visible to every query and there is no bias."""
        return self.causal == "none" and not self.parts and self.bias is None

    @property
    def has_visibility(self) -> bool:
        """True when some (query, key) pair may be invisible."""
        return self.causal != "none" or bool(self.parts)

    @property
    def causal_offset(self) -> int:
        """Query i sees keys j <= i + offset (top_left: 0; bottom_right: N_kv - N_q)."""
        return self.n_kv - self.n_q if self.causal == "bottom_right" else 0

    def causal_block(self, q0: int, q1: int, k0: int, k1: int) -> torch.Tensor | None:
        """Causal visibility of rows [q0, q1) x keys [k0, k1): [1, 1, q1-q0, k1-k0] or None."""
        if self.causal == "none":
            return None
        rows = torch.arange(q0, q1, device=self.device).unsqueeze(-1)  # [tq, 1]
        cols = torch.arange(k0, k1, device=self.device)  # [tk]
        return (cols <= rows + self.causal_offset)[None, None]  # [1, 1, tq, tk]

    def block(self, q0: int, q1: int, k0: int, k1: int) -> torch.Tensor | None:
        """Combined visibility of one tile, broadcastable to [B, H, q1-q0, k1-k0]; None = all."""
        mask = self.causal_block(q0, q1, k0, k1)
        for part in self.parts:
            piece = _tile(part, q0, q1, k0, k1)
            mask = piece if mask is None else mask & piece
        return mask

    def bias_block(self, q0: int, q1: int, k0: int, k1: int) -> torch.Tensor | None:
        """The float bias of one tile (broadcastable), or None."""
        return None if self.bias is None else _tile(self.bias, q0, q1, k0, k1)

    def full(self) -> torch.Tensor | None:
        """Combined visibility of the whole score matrix (smallest broadcast shape) or None."""
        return self.block(0, self.n_q, 0, self.n_kv)

    def batch_slice(self, b0: int, b1: int) -> MaskPlan:
        """The plan of sequences [b0, b1) of the normalized batch."""

        def cut(x: torch.Tensor) -> torch.Tensor:
            return x if x.shape[0] == 1 else x[b0:b1]

        return MaskPlan(
            n_q=self.n_q,
            n_kv=self.n_kv,
            causal=self.causal,
            parts=tuple(cut(p) for p in self.parts),
            bias=None if self.bias is None else cut(self.bias),
            device=self.device,
        )

    def causal_only_top_left(self) -> bool:
        """True when the only mask is causal aligned top-left (bottom_right with N_q = N_kv
        is the same mask): torch's is_causal expresses it without materializing a mask."""
        aligned = self.causal == "top_left" or (
            self.causal == "bottom_right" and self.n_q == self.n_kv
        )
        return aligned and not self.parts and self.bias is None


def _tile(x: torch.Tensor, q0: int, q1: int, k0: int, k1: int) -> torch.Tensor:
    """Slice dims 2 (N_q) and 3 (N_kv) of a broadcastable 4-D tensor, keeping size-1 dims."""
    if x.shape[2] != 1 and (q0, q1) != (0, x.shape[2]):
        x = x[:, :, q0:q1]
    if x.shape[3] != 1 and (k0, k1) != (0, x.shape[3]):
        x = x[:, :, :, k0:k1]
    return x


def _to_4d_mask(mask: torch.Tensor, spec: InputSpec) -> torch.Tensor:
    """A mask broadcastable to q.shape[:-1] + (N_kv,) as a 4-D [B|1, H|1, N_q|1, N_kv|1]."""
    full_rank = len(spec.row_shape) + 1
    m = mask.reshape((1,) * (full_rank - mask.dim()) + tuple(mask.shape))
    if spec.two_d:
        return m.reshape(1, 1, *m.shape[-2:])
    lead = m.shape[:-3]
    if all(s == 1 for s in lead):
        return m.reshape(1, *m.shape[-3:])
    m = m.expand(*spec.batch_shape, *m.shape[-3:])
    return m.reshape(spec.batch, *m.shape[-3:])


def build_mask_plan(
    spec: InputSpec,
    *,
    key_lengths: torch.Tensor | list[int] | tuple[int, ...] | int | None,
    key_padding_mask: torch.Tensor | None,
    attn_mask: torch.Tensor | None,
    device: torch.device,
) -> MaskPlan:
    """Turn every (validated) mask option into a MaskPlan."""
    parts: list[torch.Tensor] = []
    bias: torch.Tensor | None = None
    n_batch_dims = len(spec.batch_shape)

    if key_lengths is not None:
        kl = as_key_lengths(key_lengths, device)
        per_head = kl.dim() > n_batch_dims and not spec.two_d
        if kl.dim() == 0:  # one length for every sequence
            kl4 = kl.reshape(1, 1, 1, 1)
        else:
            kl4 = kl.reshape(spec.batch, spec.heads if per_head else 1, 1, 1)  # [B, H|1, 1, 1]
        keys = torch.arange(spec.n_kv, device=device)  # [N_kv]
        # A length equal to N_kv masks nothing; skip the part then (cheaper fused calls).
        if int(kl.min()) < spec.n_kv:
            parts.append(keys < kl4)  # [B, H|1, 1, N_kv]

    if key_padding_mask is not None:
        per_head = key_padding_mask.dim() - 1 > n_batch_dims and not spec.two_d
        kpm = key_padding_mask.reshape(spec.batch, spec.heads if per_head else 1, 1, spec.n_kv)
        parts.append(~kpm)  # [B, H|1, 1, N_kv]; True = padding in the MHA convention

    if attn_mask is not None:
        m4 = _to_4d_mask(attn_mask, spec)  # [B|1, H|1, N_q|1, N_kv|1]
        if m4.dtype == torch.bool:
            parts.append(m4)
        else:
            bias = m4
            invisible = m4 == -math.inf
            if bool(invisible.any()):
                parts.append(~invisible)

    return MaskPlan(
        n_q=spec.n_q,
        n_kv=spec.n_kv,
        causal=spec.causal,
        parts=tuple(parts),
        bias=bias,
        device=device,
    )
