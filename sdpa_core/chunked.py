"""Tiled attention with an online (log-sum-exp) softmax and streaming row statistics.

Queries are processed in tiles and keys in blocks of `block_size`, so the largest buffers are
three [B, H, tile_q, block] scratch tiles: O(N) memory in the sequence length. Per row the
online state is (m, l, t, a2, a3, acc), updated for each key block of scores s_j:

    m' = max(m, max_j s_j);  alpha = e^(m - m')
    t  <- alpha (t + l (m - m')) + sum e^(s_j - m') (s_j - m')   (shifted first moment)
    l  <- alpha l + sum e^(s_j - m');  a2 <- alpha^2 a2 + sum e^(2(s_j - m'));  a3 likewise
    acc <- alpha acc + sum e^(s_j - m') v_j

and, finally, H = log l - t / l, max p = 1 / l, sum p^2 = a2 / l^2, sum p^3 = a3 / l^3,
||J||_F^2 = S2 - 2 S3 + S2^2, LSE = m + log l. The statistics keep l, a2, a3 as "rest" sums
that leave out one row max (which contributes exactly 1 to each): on a saturated row
(p_max -> 1) 1 + tiny rounds to 1 in fp32 and S2 - 2 S3 + S2^2 cancels, while the rest sums
keep every digit (see the finalize step). Raw-score moments (count, mean, M2) are exact
two-pass moments per block merged across blocks with Chan's formula.

The dense path is the same routine (attend_tiles_steps) with one key block, keeping the normalized
exponentials as the weights, so both paths share every formula. Which (query, key) pairs are
visible, tile by tile, comes from the MaskPlan (masks.py), never from this module.

Allocation matters on CPU: a fresh multi-MiB buffer costs page faults that exceed the
arithmetic on it, so the tiles are allocated once and reused (matmul/exp with out=).
"""

from __future__ import annotations

import dataclasses
import math
from collections.abc import Generator
from dataclasses import dataclass

import torch

from sdpa_core.diagnostics import DEFAULT_SINK_TOKENS, ROW_STATS_FIELDS, RowStats
from sdpa_core.masks import MaskPlan
from sdpa_core.stats_kernel import initial_state, kernel_ready, run_update

DEFAULT_BLOCK_SIZE = 512
# Elements of one [B, H, tile_q, block] scratch tile (three live at once): 2^20 fp32 = 4 MiB.
# Each elementwise op on a tile is one OpenMP parallel region, and the server's idle workers
# sleep (OMP_WAIT_POLICY=PASSIVE), so every region pays their wake-up: 2^20 runs the chunked
# and dense paths 1.3-1.5x faster than 2^19 under PASSIVE, and as fast with spinning workers.
# 2^21 was 0.9-1.3x as fast as 2^20 (faster under PASSIVE, mixed with spinning workers) for
# twice the scratch, and 2^22 slower (bench/cpu_threads.py, BENCHMARKS.md).
TILE_ELEMENTS = 1 << 20


def group_queries(x: torch.Tensor, kv_heads: int) -> torch.Tensor:
    """[B, H, N, X] -> [B, H_kv, G*N, X]: query head h uses kv head h // G (GQA).

    Heads h = h_kv*G + g are adjacent in memory, so one matmul per kv head covers its whole
    group without copying k or v (the repeat_interleave semantics of torch's enable_gqa).
    """
    b, h, n, d = x.shape
    return x.reshape(b, kv_heads, (h // kv_heads) * n, d)


@dataclass(slots=True)
class _RowState:
    """Online state of one query tile; every tensor is [B, H, tq] except acc."""

    m: torch.Tensor
    denom: torch.Tensor  # l: sum of exps relative to m
    sink: torch.Tensor  # the part of l on the first sink_tokens keys
    acc: torch.Tensor  # [B, H, tq, D_v]
    t: torch.Tensor
    rest1: torch.Tensor  # sum of e^{s'} over every visible key but one row max
    rest2: torch.Tensor  # ... of e^{2 s'}
    rest3: torch.Tensor  # ... of e^{3 s'}
    count: torch.Tensor
    mean: torch.Tensor
    m2: torch.Tensor
    abs_max: torch.Tensor
    ref: torch.Tensor | None  # [B, H, tq, 1]: the per-row shift of the raw scores


def _new_state(zero: torch.Tensor, neg_inf: torch.Tensor) -> _RowState:
    """The state of a tile that has seen no key: 0-d tensors (broadcast where read). A row's
    first visible block replaces every field with its own [B, H, tq] tensors before anything
    updates one in place, so the shared scalars are never written."""
    return _RowState(
        m=neg_inf,
        denom=zero,
        sink=zero,
        acc=zero,
        t=zero,
        rest1=zero,
        rest2=zero,
        rest3=zero,
        count=zero,
        mean=zero,
        m2=zero,
        abs_max=zero,
        ref=None,
    )


class KeyBlocks:
    """k^T one key block at a time, each block a contiguous [B, H_kv, D, w] copy made once and
    kept for every query tile (together one O(N D) copy of k). MKL's q k^T is slower on a block
    sliced out of one contiguous k^T (its rows N_kv apart: 32 GFLOP/s) than on a contiguous
    block (50) or a transposed view of k (49) ([8, 256, 64] x [64, 512], one thread, torch
    2.13, CPU)."""

    def __init__(self, k4: torch.Tensor, dtype: torch.dtype) -> None:
        self._k = k4
        self._dtype = dtype
        self._blocks: dict[tuple[int, int], torch.Tensor] = {}

    def block(self, k0: int, k1: int) -> torch.Tensor:
        """k^T of keys [k0, k1): [B, H_kv, D, k1 - k0]."""
        kT = self._blocks.get((k0, k1))
        if kT is None:
            kT = self._k[:, :, k0:k1].to(self._dtype).transpose(-1, -2).contiguous()
            self._blocks[(k0, k1)] = kT
        return kT


def _finish_rows(
    *,
    m: torch.Tensor,
    denom: torch.Tensor,
    t: torch.Tensor,
    rest: tuple[torch.Tensor, torch.Tensor, torch.Tensor],
    moments: tuple[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor],
    sink: torch.Tensor,
    ref: torch.Tensor,
    fold: bool,
    scale: float,
) -> dict[str, torch.Tensor]:
    """The row statistics of a query tile from its online state, keyed by RowStats field
    (every value [..., tq], or 0-d for a tile that saw no key): the eager loop's and the
    compiled kernel's (stats_kernel.py) common last step.

    rest: the "rest" power sums (rest1, rest2, rest3); moments: (count, mean, M2, abs max) of
    the scores in the units they were taken in (times the scale when it was folded into q);
    ref: the per-row shift of the softmax's scores in the same units.
    """
    rest1, rest2, rest3 = rest
    count, mean, m2, abs_max = moments
    zero = torch.zeros((), dtype=denom.dtype, device=denom.device)
    active = denom > 0
    safe_l = torch.where(active, denom, 1.0)
    m_safe = torch.where(active, m, zero)
    # l = 1 + rest1 (the max's e^0 plus the others); p_max = 1 / l; r_k are the others'
    # power sums of p. In these terms ||J||_F^2 = S2 - 2 S3 + S2^2 and 1 - S2 have no
    # cancellation when p_max -> 1.
    full_l = 1.0 + rest1
    p_max = 1.0 / full_l
    r1 = rest1 / full_l  # 1 - p_max
    r2 = rest2 / (full_l * full_l)
    r3 = rest3 / (full_l * full_l * full_l)
    jac_sq = p_max * p_max * r1 * r1 + r2 * (1.0 + 2.0 * p_max * p_max) - 2.0 * r3
    jac = torch.sqrt((jac_sq + r2 * r2).clamp(min=0.0))
    one_minus_s2 = r1 * (1.0 + p_max) - r2  # 1 - sum p^2
    cnt_safe = count.clamp(min=1.0)
    entropy = torch.log1p(rest1) - t / full_l
    # The sink's exps are a subset of l's, summed in another order: clamp the rounding.
    sink_share = (sink / safe_l).clamp(max=1.0)
    # ref is a shift of the (scaled, when folded) scores; moments were taken on the same
    # scores, so convert both back to raw q.k units here.
    ref_scaled = ref if fold else scale * ref
    unit = 1.0 / scale if fold else 1.0
    lse = torch.where(active, m_safe + torch.log(safe_l) + ref_scaled, -math.inf)
    return {
        "visible_keys": count,
        "entropy": torch.where(active, entropy.clamp(min=0.0), zero),
        "max_weight": torch.where(active, p_max, zero),
        "sink_share": torch.where(active, sink_share, zero),
        "lse": lse,
        "grad_health": torch.where(active, (one_minus_s2 / cnt_safe).clamp(min=0.0), zero),
        "jacobian_fro": torch.where(active, jac, zero),
        "score_mean_raw": torch.where(active, mean * unit, zero),
        "score_m2_raw": torch.where(active, m2 * (unit * unit), zero),
        "score_abs_max_raw": torch.where(active, abs_max * abs(unit), zero),
    }


def attend_tiles_steps(
    q4: torch.Tensor,
    k4: torch.Tensor,
    v4: torch.Tensor,
    plan: MaskPlan,
    *,
    scale: float,
    accum_dtype: torch.dtype,
    need_stats: bool,
    block_size: int,
    tile_q: int,
    keep_weights: bool = False,
    sink_tokens: int = DEFAULT_SINK_TOKENS,
    sink_cols: torch.Tensor | None = None,
) -> Generator[None, None, tuple[torch.Tensor, torch.Tensor | None, RowStats | None]]:
    """Attention over [B, H, N, D] inputs in (tile_q x block_size) tiles, as a generator that
    yields between the (query tile x key block) steps it computes and returns the results: a
    caller can stop between blocks (a long request's deadline) and go on later
    (AttentionRun).

    Returns output [B, H, N_q, D_v], the weights [B, H, N_q, N_kv] (only with keep_weights,
    which needs block_size >= N_kv) and RowStats [B, H, N_q] when need_stats; all in
    accum_dtype. sink_share in RowStats is the weight on the keys of sink_cols (bool
    [B|1, H|1, N_kv], diagnostics.sink_keys) or, without it, on positions [0, sink_tokens).
    """
    b, h, n_q, _ = q4.shape
    h_kv, n_kv, d_v = k4.shape[1], k4.shape[2], v4.shape[-1]
    dev = q4.device
    bk = min(block_size, n_kv)
    if keep_weights and bk < n_kv:
        raise ValueError("keep_weights needs a single key block")
    tq_max = min(tile_q, n_q)
    # Fold the scale into q unless it is 0 (it could not be divided back out of the moments)
    # or so extreme that scaled squared deviations would leave fp32's normal range.
    fold = 1e-6 <= abs(scale) <= 1e6

    kT = KeyBlocks(k4, accum_dtype)
    vf = v4.to(accum_dtype)  # [B, H_kv, N_kv, D_v]
    neg_inf = torch.tensor(-math.inf, dtype=accum_dtype, device=dev)
    zero = torch.zeros((), dtype=accum_dtype, device=dev)
    fmin = torch.finfo(accum_dtype).min
    # Where the sink's keys end: blocks past it add nothing to the sink.
    sink_end = min(sink_tokens, n_kv)
    sink_w: torch.Tensor | None = None
    if need_stats and sink_cols is not None:
        sink_w = sink_cols.to(accum_dtype).unsqueeze(-2)  # [B|1, H|1, 1, N_kv]
        hits = sink_cols.reshape(-1, n_kv).any(0).nonzero()
        sink_end = int(hits.max()) + 1 if hits.numel() else 0

    # One query tile (every small request, every dense row that fits a tile): the results are
    # the tile's own tensors; several: each tile is copied into preallocated results.
    single = tq_max >= n_q
    out = torch.empty(0) if single else torch.empty(b, h, n_q, d_v, dtype=accum_dtype, device=dev)
    # The weights are written tile by tile straight into the matrix we hand out.
    weights = torch.empty(b, h, n_q, n_kv, dtype=accum_dtype, device=dev) if keep_weights else None
    rows: dict[str, torch.Tensor] = {}
    if need_stats and not single:
        rows = {
            name: torch.empty(b, h, n_q, dtype=accum_dtype, device=dev)  # [B, H, N_q]
            for name in ROW_STATS_FIELDS
        }

    def put(name: str, q0: int, q1: int, value: torch.Tensor) -> None:
        """A tile's row statistic ([B, H, tq], or 0-d for a tile that saw no key)."""
        if single:
            shape = (b, h, q1 - q0)
            rows[name] = value if value.shape == shape else value.expand(shape).contiguous()
        else:
            rows[name][:, :, q0:q1] = value

    buffers: dict[tuple[str, int, int], torch.Tensor] = {}

    def scratch(name: str, tq: int, w: int) -> torch.Tensor:
        key = (name, tq, w)
        if key not in buffers:
            buffers[key] = torch.empty(b, h, tq, w, dtype=accum_dtype, device=dev)
        return buffers[key]

    stepped = False
    for q0 in range(0, n_q, tq_max):
        q1 = min(q0 + tq_max, n_q)
        tq = q1 - q0
        # The scale is folded into the query tile (one O(tq D) multiply instead of a pass over
        # every score tile); score moments are divided back to raw q.k units at the end.
        q_tile = q4[:, :, q0:q1].to(accum_dtype)
        if fold:
            q_tile = q_tile * scale
        qg = group_queries(q_tile, h_kv)  # [B, H_kv, G*tq, D]
        st = _new_state(zero, neg_inf)
        wrote_weights = False
        for k0 in range(0, n_kv, bk):
            k1 = min(k0 + bk, n_kv)
            w = k1 - k0
            skip, vis = plan.sparse_block(q0, q1, k0, k1)
            if skip:
                continue
            # A step ends before each block but the first: the last block's step finishes
            # the results too (no step of its own for them).
            if stepped:
                yield
            stepped = True
            # The row's first visible block starts the online state rather than merging into
            # it: the same numbers (every merge term is an exact 0 then), a third fewer torch
            # calls, which dominate small requests and every single-block (dense) row.
            first = not wrote_weights
            wrote_weights = True
            s = scratch("s", tq, w)
            # q.k [B, H, tq, w], times the scale when folded
            torch.matmul(qg, kT.block(k0, k1), out=s.view(b, h_kv, -1, w))

            if need_stats:
                keep = None if vis is None else vis.to(accum_dtype)  # 1 visible, 0 not
                if keep is not None:
                    s.mul_(keep)
                    # expand first: a mask without a key dim ([..., tq, 1]) covers w keys.
                    cnt = keep.expand(b, h, tq, w).sum(-1)
                else:
                    cnt = torch.full((b, h, tq), float(w), dtype=accum_dtype, device=dev)
                cnt_safe = cnt.clamp(min=1.0)
                # amax and amin, not aminmax(dim=-1): the latter is ~20x slower on CPU
                # (torch 2.13)
                bmax = torch.maximum(s.amax(-1).abs(), s.amin(-1).abs())  # zeros never win
                shift = (s.sum(-1) / cnt_safe).unsqueeze(-1)  # [B, H, tq, 1]
                s.sub_(shift)
                if keep is not None:
                    s.mul_(keep)
                resid = s.sum(-1)
                sq = torch.linalg.vector_norm(s, 2, -1)
                bm2 = (sq * sq - resid * resid / cnt_safe).clamp(min=0.0)
                bmean = shift.squeeze(-1) + resid / cnt_safe
                has = cnt > 0
                bmean = torch.where(has, bmean, zero)
                bm2 = torch.where(has, bm2, zero)
                if first:
                    st.count, st.mean, st.m2 = cnt, bmean, bm2
                    st.abs_max = torch.where(has, bmax, zero)
                else:  # Chan merge of (count, mean, M2) with this block's.
                    n_new = st.count + cnt
                    frac = cnt / n_new.clamp(min=1.0)
                    delta = bmean - st.mean
                    st.m2 += bm2 + delta * delta * st.count * frac
                    st.mean += delta * frac
                    st.count = n_new
                    st.abs_max = torch.maximum(st.abs_max, torch.where(has, bmax, zero))
                # Scores relative to one per-row reference (the first block's mean): the
                # softmax needs one shift per row, and a centred row keeps fp32 digits.
                if st.ref is None:
                    st.ref = shift
                else:
                    s.add_(shift - st.ref)

            if not fold:
                s.mul_(scale)
            bias = plan.bias_block(q0, q1, k0, k1)
            if bias is not None:
                s.add_(bias.to(accum_dtype))
            if vis is not None:
                s.add_(torch.where(vis, zero, neg_inf))  # exact 0 / -inf, never a big finite

            blk_max = s.amax(-1)  # [B, H, tq]
            m_new = blk_max if first else torch.maximum(st.m, blk_max)
            m_safe = torch.where(m_new == -math.inf, zero, m_new)
            # 0 while the row has seen nothing (unused on the first block)
            alpha = zero if first else torch.exp(st.m - m_safe)
            s.sub_(m_safe.unsqueeze(-1))  # s' <= 0
            if weights is not None:
                e = torch.exp(s, out=weights[:, :, q0:q1])  # a strided view of the weights
            else:
                e = torch.exp(s, out=scratch("e", tq, w))
            # The sink's part of this block's exps, before the statistics below reshape e.
            sink_blk = None
            if need_stats and k0 < sink_end:
                if sink_w is None:
                    sink_blk = e[..., : sink_end - k0].sum(-1)
                else:
                    sink_blk = (e * sink_w[..., k0:k1]).sum(-1)
            if e.is_contiguous():
                pv = (group_queries(e, h_kv) @ vf[:, :, k0:k1]).view(b, h, tq, d_v)
            else:  # [B, H_kv, G, tq, w] @ [B, H_kv, 1, w, D_v]: no copy of e
                g = h // h_kv
                pv = (e.view(b, h_kv, g, tq, w) @ vf[:, :, None, k0:k1]).reshape(b, h, tq, d_v)
            if first:
                st.acc = pv
            else:
                st.acc.mul_(alpha.unsqueeze(-1))
                st.acc += pv

            if not need_stats:
                l_blk = e.sum(-1)
            else:
                if vis is not None:
                    s.clamp_(min=fmin)  # -inf -> finite, so that 0 * s' stays 0
                # Sums over every key but one row max ("rest" sums): the max contributes
                # exactly e^0 = 1, and adding the others to that 1 in fp32 would lose them on
                # saturated rows (p_max -> 1), which is where the Jacobian and gradient health
                # matter most. floor(e) is 1 exactly where e == 1 (the max and its ties) and 0
                # elsewhere: a cheap, vectorized way to set those entries aside (comparisons
                # and masked_fill are several times slower on CPU, torch 2.13).
                ones = torch.floor(e, out=scratch("o", tq, w))
                e.sub_(ones)
                n_ones = ones.sum(-1)
                rest_blk = e.sum(-1)
                s.mul_(e)
                t_blk = s.sum(-1)  # the entries set aside have s' = 0: nothing lost
                torch.mul(e, e, out=s)
                a2_blk = s.sum(-1)
                s.mul_(e)
                a3_blk = s.sum(-1)
                if keep_weights:
                    e.add_(ones)
                l_blk = rest_blk + n_ones
                if first:
                    holds = blk_max > -math.inf  # the row max is in this block
                    back = n_ones - holds.to(accum_dtype)  # ties of the max go to the rest
                    st.t = t_blk
                    st.rest1, st.rest2, st.rest3 = rest_blk + back, a2_blk + back, a3_blk + back
                else:
                    holds = (blk_max == m_new) & (st.m < m_new)  # this block has the new max
                    joins = (holds & (st.denom > 0)).to(accum_dtype)  # the old max joins rest
                    back = n_ones - holds.to(accum_dtype)  # ties of the max go to the rest
                    gap = torch.where(st.denom > 0, st.m - m_safe, zero)
                    st.t = alpha * (st.t + st.denom * gap) + t_blk
                    alpha2 = alpha * alpha
                    st.rest1 = alpha * (st.rest1 + joins) + rest_blk + back
                    st.rest2 = alpha2 * (st.rest2 + joins) + a2_blk + back
                    st.rest3 = alpha2 * alpha * (st.rest3 + joins) + a3_blk + back
            if first:
                st.denom = l_blk
                if need_stats and sink_blk is not None:
                    st.sink = sink_blk
            else:
                st.denom = alpha * st.denom + l_blk
                if need_stats:
                    st.sink = alpha * st.sink if sink_blk is None else alpha * st.sink + sink_blk
            st.m = m_new

        active = st.denom > 0
        safe_l = torch.where(active, st.denom, 1.0)
        out_tile = st.acc / safe_l.unsqueeze(-1)  # fully masked rows: 0 / 1 = 0
        if single:
            out = out_tile.expand(b, h, tq, d_v).contiguous() if not wrote_weights else out_tile
        else:
            out[:, :, q0:q1] = out_tile
        if weights is not None:
            if wrote_weights:
                weights[:, :, q0:q1].div_(safe_l.unsqueeze(-1))
            else:  # every pair of this tile is invisible
                weights[:, :, q0:q1].zero_()
        if need_stats:
            ref = zero if st.ref is None else st.ref.squeeze(-1)
            finished = _finish_rows(
                m=st.m,
                denom=st.denom,
                t=st.t,
                rest=(st.rest1, st.rest2, st.rest3),
                moments=(st.count, st.mean, st.m2, st.abs_max),
                sink=st.sink,
                ref=ref,
                fold=fold,
                scale=scale,
            )
            for name, value in finished.items():
                put(name, q0, q1, value)

    row_stats = None
    if need_stats:
        counts = rows.pop("visible_keys").round().to(torch.int64)
        row_stats = RowStats(visible_keys=counts, **rows)
    return out, weights, row_stats


def _additive_tile(
    parts: MaskPlan,
    tile: tuple[int, int, int, int],
    *,
    batch: int,
    heads: int,
    all_visible: bool,
) -> torch.Tensor | None:
    """The non-causal part of one tile's mask as the kernel takes it (`parts`: a plan without
    its causal mask; all_visible: the whole plan's sparse_block found every pair visible):
    None when it hides nothing and adds no bias, else float32 [B*H*tq, w]: the bias (or 0)
    where visible, -inf where not (an exact -inf from a boolean, never a large finite
    number)."""
    q0, q1, k0, k1 = tile
    vis = None if all_visible else parts.block(q0, q1, k0, k1)  # the parts' AND, no host sync
    bias = parts.bias_block(q0, q1, k0, k1)
    if vis is None and bias is None:
        return None
    add = torch.zeros((batch, heads, q1 - q0, k1 - k0), dtype=torch.float32, device=parts.device)
    if bias is not None:
        add += bias.to(torch.float32)
    if vis is not None:
        add.masked_fill_(~vis, -math.inf)
    return add.view(-1, k1 - k0)


def _causal_limit(
    plan: MaskPlan, tile: tuple[int, int, int, int], *, lead: int
) -> torch.Tensor | None:
    """The last key of block [k0, k1) each row of [q0, q1) may see under the causal mask, as
    the kernel takes it: float32 [lead * tq] (rows repeated for the lead B*H dims), or None
    when the causal mask leaves the block whole."""
    q0, q1, k0, k1 = tile
    if plan.causal_state(q0, q1, k0, k1) == "all":
        return None
    rows = torch.arange(q0, q1, device=plan.device, dtype=torch.float32)
    return (rows + float(plan.causal_offset - k0)).repeat(lead)  # query i sees j <= i + offset


def kernel_tiles_steps(
    q4: torch.Tensor,
    k4: torch.Tensor,
    v4: torch.Tensor,
    plan: MaskPlan,
    *,
    scale: float,
    block_size: int,
    tile_q: int,
    sink_tokens: int = DEFAULT_SINK_TOKENS,
    sink_cols: torch.Tensor | None = None,
) -> Generator[None, None, tuple[torch.Tensor, torch.Tensor | None, RowStats | None]]:
    """attend_tiles_steps with statistics (float32 accumulation, a scale it can fold into q,
    no weights kept) on stats_kernel's compiled block update: the same tiles, the same steps,
    the same results up to the order of float reductions. Per block it runs the q k^T matmul,
    the kernel (every statistic, the softmax's exponentials, the merge into the row state) and
    the e v matmul; the sink's part of the exponentials is summed from the kernel's own e, as
    the eager loop sums it (scores recomputed apart would round apart from them)."""
    b, h, n_q, _ = q4.shape
    h_kv, n_kv, d_v = k4.shape[1], k4.shape[2], v4.shape[-1]
    dev, f32 = q4.device, torch.float32
    bk = min(block_size, n_kv)
    tq_max = min(tile_q, n_q)
    kT = KeyBlocks(k4, f32)
    vf = v4.to(f32)  # [B, H_kv, N_kv, D_v]
    sink_end = min(sink_tokens, n_kv)
    sink_w: torch.Tensor | None = None
    if sink_cols is not None:
        sink_w = sink_cols.to(f32).unsqueeze(-2)  # [B|1, H|1, 1, N_kv]
        hits = sink_cols.reshape(-1, n_kv).any(0).nonzero()
        sink_end = int(hits.max()) + 1 if hits.numel() else 0
    out = torch.empty(b, h, n_q, d_v, dtype=f32, device=dev)
    rows = {name: torch.empty(b, h, n_q, dtype=f32, device=dev) for name in ROW_STATS_FIELDS}
    s_buf = torch.empty(b * h * tq_max * bk, dtype=f32, device=dev)
    # The causal mask is the kernel's own (from indices); the other masks come as an addend.
    parts = dataclasses.replace(plan, causal="none")
    stepped = False
    for q0 in range(0, n_q, tq_max):
        q1 = min(q0 + tq_max, n_q)
        tq = q1 - q0
        n_rows = b * h * tq
        qg = group_queries(q4[:, :, q0:q1].to(f32) * scale, h_kv)  # [B, H_kv, G*tq, D]
        state = initial_state(n_rows, device=dev)
        acc = torch.zeros(b, h, tq, d_v, dtype=f32, device=dev)
        sink = torch.zeros(b, h, tq, dtype=f32, device=dev)
        for k0 in range(0, n_kv, bk):
            k1 = min(k0 + bk, n_kv)
            w = k1 - k0
            skip, vis = plan.sparse_block(q0, q1, k0, k1)
            if skip:
                continue  # nothing of this block is visible
            if stepped:  # a step ends before each block but the first
                yield
            stepped = True
            s = s_buf[: n_rows * w].view(b, h_kv, -1, w)
            torch.matmul(qg, kT.block(k0, k1), out=s)  # scale * q.k, [B, H_kv, G*tq, w]
            tile = (q0, q1, k0, k1)
            # vis None: every pair visible (no mask tile, no causal edge) but perhaps a bias
            add = _additive_tile(parts, tile, batch=b, heads=h, all_visible=vis is None)
            limit = None if vis is None else _causal_limit(plan, tile, lead=b * h)
            state, alpha, e = run_update(s.view(n_rows, w), limit, add, state)
            e4 = e.view(b, h, tq, w)
            pv = group_queries(e4, h_kv) @ vf[:, :, k0:k1]
            alpha4 = alpha.view(b, h, tq)
            acc.mul_(alpha4.unsqueeze(-1)).add_(pv.view(b, h, tq, d_v))
            sink.mul_(alpha4)
            if k0 < sink_end:  # the sink's part of this block's exponentials
                cut = min(sink_end, k1) - k0
                part = e4[..., :cut]
                if sink_w is not None:
                    part = part * sink_w[..., k0 : k0 + cut]
                sink.add_(part.sum(-1))

        shape = (b, h, tq)
        m, denom, ref = state.m.view(shape), state.denom.view(shape), state.ref.view(shape)
        safe_l = torch.where(denom > 0, denom, 1.0)
        out[:, :, q0:q1] = acc / safe_l.unsqueeze(-1)  # fully masked rows: 0 / 1 = 0
        finished = _finish_rows(
            m=m,
            denom=denom,
            t=state.t.view(shape),
            rest=(state.rest1.view(shape), state.rest2.view(shape), state.rest3.view(shape)),
            moments=(
                state.keys.view(shape),
                state.mean.view(shape),
                state.m2.view(shape),
                state.abs_max.view(shape),
            ),
            sink=sink,
            ref=ref,
            fold=True,
            scale=scale,
        )
        for name, value in finished.items():
            rows[name][:, :, q0:q1] = value

    counts = rows.pop("visible_keys").round().to(torch.int64)
    return out, None, RowStats(visible_keys=counts, **rows)


def chunked_tile_rows(heads: int, n_q: int, n_kv: int, block_size: int) -> int:
    """Query rows per tile of the chunked path: a [heads, rows, key block] score tile of
    about TILE_ELEMENTS. A tile costs about the same with fewer rows (the key-block loop's
    per-block work dominates), so a caller that cuts the rows (AttentionRun) cuts at
    multiples of it."""
    return min(n_q, max(16, TILE_ELEMENTS // (heads * min(block_size, n_kv))))


def chunked_blocks(q4: torch.Tensor, k4: torch.Tensor, block_size: int) -> int:
    """How many (query tile x key block) steps chunked_attention_steps takes at most (blocks
    a causal or other mask hides entirely are skipped without a step)."""
    b, h, n_q, _ = q4.shape
    n_kv = k4.shape[2]
    bk = min(block_size, n_kv)
    tq = chunked_tile_rows(h, n_q, n_kv, block_size)
    b_chunk = max(1, TILE_ELEMENTS // (h * tq * bk))
    return -(-b // b_chunk) * -(-n_q // tq) * -(-n_kv // bk)


def chunked_attention_steps(
    q4: torch.Tensor,
    k4: torch.Tensor,
    v4: torch.Tensor,
    plan: MaskPlan,
    *,
    scale: float,
    accum_dtype: torch.dtype,
    need_stats: bool,
    block_size: int = DEFAULT_BLOCK_SIZE,
    sink_tokens: int = DEFAULT_SINK_TOKENS,
    sink_cols: torch.Tensor | None = None,
) -> Generator[None, None, tuple[torch.Tensor, RowStats | None]]:
    """The chunked path as a generator of (query tile x key block) steps (attend_tiles_steps)
    that returns output [B, H, N_q, D_v] and RowStats [B, H, N_q] (accum dtype).

    The tile sizes depend on H, N and block_size but not on the batch size: sequences are
    processed in batch chunks, so a row of a batched call goes through the same tile shapes
    as in a solo call (the batching engine relies on it).
    """
    b, h, n_q, _ = q4.shape
    bk = min(block_size, k4.shape[2])
    tq = chunked_tile_rows(h, n_q, k4.shape[2], block_size)
    b_chunk = max(1, TILE_ELEMENTS // (h * tq * bk))
    # The compiled kernel where it applies (stats_kernel.py); the eager loop elsewhere. Sized
    # per sequence, so that the rows of a batched call take the route a solo call's take (as
    # they take its tiles).
    by_kernel = (
        need_stats
        and accum_dtype == torch.float32
        and 1e-6 <= abs(scale) <= 1e6  # folded into q, as the eager loop folds it
        and kernel_ready(q4.device, scores=h * tq * bk)
    )
    outs: list[torch.Tensor] = []
    rows: list[RowStats] = []
    for b0 in range(0, b, b_chunk):
        b1 = min(b0 + b_chunk, b)
        whole = b0 == 0 and b1 == b  # one chunk: no slicing, no concatenation
        chunk = (
            q4 if whole else q4[b0:b1],
            k4 if whole else k4[b0:b1],
            v4 if whole else v4[b0:b1],
            plan if whole else plan.batch_slice(b0, b1),
        )
        cols = (
            sink_cols if whole or sink_cols is None or sink_cols.shape[0] == 1 else sink_cols[b0:b1]
        )
        if by_kernel:
            steps = kernel_tiles_steps(
                *chunk,
                scale=scale,
                block_size=block_size,
                tile_q=tq,
                sink_tokens=sink_tokens,
                sink_cols=cols,
            )
        else:
            steps = attend_tiles_steps(
                *chunk,
                scale=scale,
                accum_dtype=accum_dtype,
                need_stats=need_stats,
                block_size=block_size,
                tile_q=tq,
                sink_tokens=sink_tokens,
                sink_cols=cols,
            )
        out, _, row_stats = yield from steps
        outs.append(out)
        if row_stats is not None:
            rows.append(row_stats)
    output = outs[0] if len(outs) == 1 else torch.cat(outs)  # [B, H, N_q, D_v]
    return output, (RowStats.cat(rows) if rows else None)
