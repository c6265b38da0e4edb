"""The Triton flash kernel's device code (triton_flash.py is its host side and says why).

Imported only by triton_flash.py, on first use: importing it imports Triton. The kernel is
wrapped as Triton's own helpers were when triton.language was first imported in this process
(INTERPRETED), not by @triton.jit, which would read TRITON_INTERPRET again now: a kernel
interpreted while its helpers are compiled (or the reverse) cannot run.

One program owns BLOCK_M query rows of one (batch, head) and walks the key blocks up to the
last key any of its rows may see, keeping per row the online softmax state and the
statistics' accumulators (all float32):

    m: the TRUE running max of the scores s (never lazily rescaled: max_weight reads it)
    alpha = e^(m_old - m_new); e = e^(s - m_new) (0 for invisible keys)
    l  <- alpha l + sum e
    t  <- alpha (t + l (m_old - m_new)) + sum e (s - m_new)     (shifted: H = ln l - t / l)
    r1, r2, r3 <- alpha^k (r_k + joins) + sum over keys but one row max of e^k, k = 1, 2, 3
                  (r2 and r3 of 2^32 e, so that a near-one-hot row's e^2 stays a normal float)
    sink <- alpha sink + sum over keys j < sink_tokens of e
    (count, mean, M2) of the raw q.k by Chan merges of each block's exact two-pass moments;
    max |q.k| as a plain max.

The "rest" sums r_k leave out one row max (which contributes exactly e^0 = 1): on a saturated
row 1 + tiny rounds to 1, so sum p^2 and the Jacobian norm taken from l would cancel; from
the rest sums they keep every digit (chunked.py's _finish_rows has the same finish, here in
float64: a handful of operations per row, and q1^2 = 1e-50 is no float32).
An entry is "at the max" when its score equals the running max exactly (s == m, not
e == 1): this also resolves a score that overflowed to +inf (it takes the whole weight, as
on the other paths) without inf - inf.
"""

from __future__ import annotations

from typing import Any

import triton.language as tl  # type: ignore[import-untyped]
from triton.runtime.interpreter import InterpretedFunction  # type: ignore[import-untyped]
from triton.runtime.jit import JITFunction  # type: ignore[import-untyped]

# The order of the float32 statistics in the kernel's [N_STATS, B, H, tq] output.
STAT_FIELDS = (
    "entropy",
    "max_weight",
    "sink_share",
    "lse",
    "grad_health",
    "jacobian_fro",
    "score_mean_raw",
    "score_m2_raw",
    "score_abs_max_raw",
)


# Every argument is annotated for mypy with what Triton can resolve inside a kernel: the
# compiler evaluates annotations as globals, and only triton.language's names and constexprs
# are visible there (`Any` fails to compile; tests/core/test_triton_flash.py compiles the
# kernel for a GPU target to hold that).
def _flash_fwd(
    Q: tl.tensor,
    K: tl.tensor,
    V: tl.tensor,
    Out: tl.tensor,
    Stats: tl.tensor,  # float32 [len(STAT_FIELDS), B*H*TQ]
    Counts: tl.tensor,  # int64 [B*H*TQ]
    KeyLen: tl.tensor,  # int64, [B, H] through strides (0 on broadcast dims)
    Vis: tl.tensor,  # uint8 (a bool's bytes), [B, H, TQ, N_KV] through strides
    Bias: tl.tensor,  # float, [B, H, TQ, N_KV] through strides
    sqb: tl.tensor,
    sqh: tl.tensor,
    sqm: tl.tensor,
    sqd: tl.tensor,
    skb: tl.tensor,
    skh: tl.tensor,
    skn: tl.tensor,
    skd: tl.tensor,
    svb: tl.tensor,
    svh: tl.tensor,
    svn: tl.tensor,
    svd: tl.tensor,
    slb: tl.tensor,
    slh: tl.tensor,
    sib: tl.tensor,
    sih: tl.tensor,
    sim: tl.tensor,
    sin: tl.tensor,
    sbb: tl.tensor,
    sbh: tl.tensor,
    sbm: tl.tensor,
    sbn: tl.tensor,
    H: tl.tensor,
    GROUP: tl.tensor,  # query heads per kv head
    TQ: tl.tensor,
    N_KV: tl.tensor,
    D: tl.tensor,
    D_V: tl.tensor,
    BH0: tl.tensor,  # the first (batch * H + head) of this launch
    scale: tl.tensor,
    q_start: tl.tensor,
    causal_shift: tl.tensor,
    sink_tokens: tl.tensor,
    n_rows: tl.tensor,  # B*H*TQ: the stride between two statistics in Stats
    HAS_CAUSAL: tl.constexpr,
    HAS_LEN: tl.constexpr,
    HAS_VIS: tl.constexpr,
    HAS_BIAS: tl.constexpr,
    BLOCK_M: tl.constexpr,
    BLOCK_N: tl.constexpr,
    D_PAD: tl.constexpr,
    DV_PAD: tl.constexpr,
    IEEE: tl.constexpr,  # fp32 inputs: exact fp32 products in tl.dot, not TF32
    UPCAST: tl.constexpr,  # the interpreter: every tl.dot operand in fp32 (bf16 dots are wrong)
    P_HALF: tl.constexpr,  # round the weights to the inputs' half dtype before p @ v
) -> None:
    pid_m = tl.program_id(0)
    pid_bh = tl.program_id(1) + BH0
    off_b = (pid_bh // H).to(tl.int64)
    off_h = (pid_bh % H).to(tl.int64)
    off_hk = off_h // GROUP  # GQA: query head h reads kv head h // (H // H_kv)

    rows = pid_m * BLOCK_M + tl.arange(0, BLOCK_M)  # the tile's own row index
    row_ok = rows < TQ
    rows64 = rows.to(tl.int64)
    offs_d = tl.arange(0, D_PAD)
    offs_dv = tl.arange(0, DV_PAD)
    offs_n = tl.arange(0, BLOCK_N)

    q = tl.load(
        Q + off_b * sqb + off_h * sqh + rows64[:, None] * sqm + offs_d[None, :] * sqd,
        mask=row_ok[:, None] & (offs_d[None, :] < D),
        other=0.0,
    )  # [BLOCK_M, D_PAD]
    if UPCAST:
        q = q.to(tl.float32)
    k_base = K + off_b * skb + off_hk * skh
    v_base = V + off_b * svb + off_hk * svh

    # The keys past `hi` are hidden from every row of this block: never loaded.
    hi = N_KV
    if HAS_LEN:
        length = tl.load(KeyLen + off_b * slb + off_h * slh)
        hi = tl.minimum(tl.maximum(length, 0), N_KV).to(tl.int32)
    row_abs = q_start + rows  # absolute query index
    if HAS_CAUSAL:
        last = q_start + tl.minimum((pid_m + 1) * BLOCK_M, TQ) - 1
        hi = tl.minimum(hi, tl.maximum(last + causal_shift + 1, 0))

    m_i = tl.full([BLOCK_M], float("-inf"), tl.float32)
    l_i = tl.zeros([BLOCK_M], tl.float32)
    t_i = tl.zeros([BLOCK_M], tl.float32)
    r1 = tl.zeros([BLOCK_M], tl.float32)
    r2 = tl.zeros([BLOCK_M], tl.float32)
    r3 = tl.zeros([BLOCK_M], tl.float32)
    sink_i = tl.zeros([BLOCK_M], tl.float32)
    cnt_i = tl.zeros([BLOCK_M], tl.float32)
    mean_i = tl.zeros([BLOCK_M], tl.float32)
    m2_i = tl.zeros([BLOCK_M], tl.float32)
    amax_i = tl.zeros([BLOCK_M], tl.float32)
    acc = tl.zeros([BLOCK_M, DV_PAD], tl.float32)

    for start_n in range(0, hi, BLOCK_N):
        cols = start_n + offs_n
        col_ok = cols < hi
        cols64 = cols.to(tl.int64)
        kt = tl.load(
            k_base + cols64[None, :] * skn + offs_d[:, None] * skd,
            mask=col_ok[None, :] & (offs_d[:, None] < D),
            other=0.0,
        )  # k^T [D_PAD, BLOCK_N]
        if UPCAST:
            kt = kt.to(tl.float32)
        # q.k [BLOCK_M, BLOCK_N] in fp32
        raw = tl.dot(q, kt, input_precision="ieee") if IEEE else tl.dot(q, kt)

        keep = row_ok[:, None] & col_ok[None, :]
        if HAS_CAUSAL:
            keep = keep & (cols[None, :] <= row_abs[:, None] + causal_shift)
        if HAS_VIS:
            vis = tl.load(
                Vis + off_b * sib + off_h * sih + rows64[:, None] * sim + cols64[None, :] * sin,
                mask=keep,
                other=0,
            )
            keep = keep & (vis != 0)

        # Moments of the raw q.k over this block's visible keys, merged by Chan's formula.
        cnt_b = tl.sum(keep.to(tl.float32), 1)
        cnt_safe = tl.maximum(cnt_b, 1.0)
        raw_k = tl.where(keep, raw, 0.0)
        shift = tl.sum(raw_k, 1) / cnt_safe
        dev = tl.where(keep, raw - shift[:, None], 0.0)
        resid = tl.sum(dev, 1)
        has = cnt_b > 0
        bm2 = tl.where(has, tl.maximum(tl.sum(dev * dev, 1) - resid * resid / cnt_safe, 0.0), 0.0)
        bmean = tl.where(has, shift + resid / cnt_safe, 0.0)
        n_new = cnt_i + cnt_b
        frac = cnt_b / tl.maximum(n_new, 1.0)
        delta = bmean - mean_i
        m2_i = m2_i + bm2 + delta * delta * cnt_i * frac
        mean_i = mean_i + delta * frac
        cnt_i = n_new
        amax_i = tl.maximum(amax_i, tl.max(tl.abs(raw_k), 1))

        # The scores and the online softmax.
        s = raw * scale
        if HAS_BIAS:
            bias = tl.load(
                Bias + off_b * sbb + off_h * sbh + rows64[:, None] * sbm + cols64[None, :] * sbn,
                mask=keep,
                other=0.0,
            )
            s = s + bias.to(tl.float32)
        s = tl.where(keep, s, float("-inf"))
        blk_max = tl.max(s, 1)
        m_new = tl.maximum(m_i, blk_max)
        m_safe = tl.where(m_new == float("-inf"), 0.0, m_new)  # a row that saw nothing yet
        alpha = tl.where(m_i == m_safe, 1.0, tl.exp(m_i - m_safe))  # 0 while m_i = -inf
        top = s == m_safe[:, None]  # at the row max: e = 1 exactly
        sp = tl.where(top, 0.0, s - m_safe[:, None])  # <= 0; -inf where invisible
        e = tl.exp(sp)
        rest_e = tl.where(top, 0.0, e)
        n_top = tl.sum(top.to(tl.float32), 1)
        rest_b = tl.sum(rest_e, 1)
        t_b = tl.sum(tl.maximum(sp, -3.0e38) * e, 1)  # -inf x 0 would be NaN
        scaled = rest_e * 4294967296.0  # 2^32 e: its square and cube stay normal floats longer
        sq = scaled * scaled
        a2_b = tl.sum(sq, 1)
        a3_b = tl.sum(sq * scaled, 1)
        holds = (blk_max == m_new) & (m_i < m_new)  # this block holds the new max
        had = l_i > 0.0
        joins = (holds & had).to(tl.float32)  # the old max joins the rest
        back = n_top - holds.to(tl.float32)  # ties of the max go to the rest
        gap = tl.where(had, m_i - m_safe, 0.0)
        t_i = tl.where(alpha > 0.0, alpha * (t_i + l_i * gap), 0.0) + t_b
        r1 = alpha * (r1 + joins) + rest_b + back
        # alpha applied once per power (alpha^2 alone underflows where alpha^2 r2 does not);
        # the max's 1 counts 2^64 in r2 and 2^96 in r3
        r2 = alpha * (alpha * (r2 + joins * 1.8446744073709552e19))
        r2 = r2 + a2_b + back * 1.8446744073709552e19
        r3 = alpha * (alpha * (alpha * (r3 + joins * 7.922816251426434e28)))
        r3 = r3 + a3_b + back * 7.922816251426434e28
        l_i = alpha * l_i + rest_b + n_top
        if start_n < sink_tokens:
            sink_i = alpha * sink_i + tl.sum(tl.where(cols[None, :] < sink_tokens, e, 0.0), 1)
        else:
            sink_i = alpha * sink_i
        m_i = m_new

        v = tl.load(
            v_base + cols64[:, None] * svn + offs_dv[None, :] * svd,
            mask=col_ok[:, None] & (offs_dv[None, :] < D_V),
            other=0.0,
        )  # [BLOCK_N, DV_PAD]
        # P_HALF: the inputs' half dtype, as FlashAttention feeds its p @ v
        p = e.to(v.dtype) if P_HALF else e
        if UPCAST:
            p = p.to(tl.float32)
            v = v.to(tl.float32)
        pv = tl.dot(p, v, input_precision="ieee") if IEEE else tl.dot(p, v)
        acc = acc * alpha[:, None] + pv

    # The row statistics (_finish_rows' formulas).
    active = l_i > 0.0
    safe_l = tl.where(active, l_i, 1.0)
    full_l = 1.0 + r1  # = l: the max's 1 plus the rest
    p_max = 1.0 / full_l
    # Per row, in float64 (a handful of operations per row): q_k = the rest's sum of p^k,
    # whose squares leave float32's range on near-one-hot rows (q1 = 1e-25 is a float32, its
    # square is not).
    full64 = 1.0 + r1.to(tl.float64)
    p64 = 1.0 / full64
    q1 = r1.to(tl.float64) / full64  # 1 - p_max, without cancellation
    q2 = r2.to(tl.float64) * 5.421010862427522e-20 / (full64 * full64)  # 2^-64
    q3 = r3.to(tl.float64) * 1.262177448353619e-29 / (full64 * full64 * full64)  # 2^-96
    # ||diag(p) - p p^T||_F^2 = S2 - 2 S3 + S2^2 with S_k = p_max^k + q_k
    jac_sq = p64 * p64 * q1 * q1 + q2 * (1.0 + 2.0 * p64 * p64) - 2.0 * q3 + q2 * q2
    jac = tl.sqrt(tl.maximum(jac_sq, 0.0)).to(tl.float32)
    one_minus_s2 = (q1 * (1.0 + p64) - q2).to(tl.float32)
    # log1p(r1) (Goldberg's form: tl has no log1p), then H = ln l - t / l
    grown = full_l - 1.0  # r1 as 1 + r1 kept it (0 when r1 is below half an ulp of 1)
    log1p_r1 = tl.where(
        grown == 0.0, r1, tl.log(full_l) * (r1 / tl.where(grown == 0.0, 1.0, grown))
    )
    entropy = tl.maximum(log1p_r1 - t_i / full_l, 0.0)
    lse = tl.where(active, m_i + tl.log(safe_l), float("-inf"))

    out = acc / safe_l[:, None]  # a row with no visible key: 0 / 1
    out_ptrs = (
        Out + (pid_bh.to(tl.int64) * TQ + rows64)[:, None] * D_V + offs_dv[None, :].to(tl.int64)
    )
    tl.store(
        out_ptrs,
        out.to(Out.dtype.element_ty),
        mask=row_ok[:, None] & (offs_dv[None, :] < D_V),
    )
    idx = pid_bh.to(tl.int64) * TQ + rows64  # [B*H*TQ] index of each row
    tl.store(Counts + idx, cnt_i.to(tl.int64), mask=row_ok)
    stats = Stats + idx
    tl.store(stats, tl.where(active, entropy, 0.0), mask=row_ok)
    tl.store(stats + n_rows, tl.where(active, p_max, 0.0), mask=row_ok)
    # The sink's exps are a subset of l's, summed in another order: clamp the rounding.
    sink_share = tl.minimum(sink_i / safe_l, 1.0)
    tl.store(stats + 2 * n_rows, tl.where(active, sink_share, 0.0), mask=row_ok)
    tl.store(stats + 3 * n_rows, lse, mask=row_ok)
    grad_health = tl.maximum(one_minus_s2 / tl.maximum(cnt_i, 1.0), 0.0)
    tl.store(stats + 4 * n_rows, tl.where(active, grad_health, 0.0), mask=row_ok)
    tl.store(stats + 5 * n_rows, tl.where(active, jac, 0.0), mask=row_ok)
    tl.store(stats + 6 * n_rows, tl.where(active, mean_i, 0.0), mask=row_ok)
    tl.store(stats + 7 * n_rows, tl.where(active, m2_i, 0.0), mask=row_ok)
    tl.store(stats + 8 * n_rows, tl.where(active, amax_i, 0.0), mask=row_ok)


# Triton picks the interpreter or the compiler once per process, when triton.language is
# imported (its own @jit helpers, tl.zeros among them, are wrapped then by TRITON_INTERPRET):
# the kernel follows that choice, whatever the variable says now.
INTERPRETED: bool = isinstance(tl.zeros, InterpretedFunction)
# Compiled per dtype, constexprs and stride specialization; the ints that change from tile to
# tile (where it starts, its rows) are not specialized on, so a long request's tiles share a
# binary.
_NOT_SPECIALIZED = ("TQ", "N_KV", "BH0", "q_start", "causal_shift", "sink_tokens", "n_rows")
flash_fwd: Any = (
    InterpretedFunction(_flash_fwd)
    if INTERPRETED
    else JITFunction(_flash_fwd, do_not_specialize=_NOT_SPECIALIZED)
)
