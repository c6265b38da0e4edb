// The CPU flash kernel: attention and every row statistic in one pass over key blocks.
//
// FlashAttention's structure on the CPU. Every (batch x head, query block) is one task of
// at::parallel_for (torch's intra-op pool: it scales over the cores as torch's own SDPA does).
// A task walks the key blocks its rows can see (a causal edge and key lengths skip whole
// blocks); per key block:
//   1. raw = q k^T, one GEMM on contiguous fp32 blocks (MKL's sgemm_ from libtorch_cpu when it
//      exports one, else at::mm_out);
//   2. one fused pass per row: pass A reads the block row once for the block's max score, the
//      raw-score sum and max |raw|; pass B exponentiates (a vectorizable Cephes expf, no libm
//      call) and accumulates every statistic, writing p = e^(s - m) over raw in place;
//   3. acc = alpha acc + p v, the second GEMM.
// The per-row state (true running max m; "rest" power sums; the shifted first moment; the
// sink's share; Chan-merged raw moments) is merged block by block in double precision and
// finished once per row (finish_row) with the formulas of chunked._finish_rows.
//
// The inner loops are plain C++ with `omp simd` reductions: no -march flag, so that a
// prebuilt image runs on any x86-64; on x86-64 each hot loop is cloned for AVX-512, AVX2+FMA
// and the baseline (target_clones), chosen once at load time by the CPU's features.
#include <torch/extension.h>

#include <ATen/Parallel.h>

#include <algorithm>
#include <array>
#include <cmath>
#include <cstdint>
#include <cstring>
#include <limits>
#include <vector>

// BLAS's sgemm_ (Fortran, column-major). Weak: a torch without it leaves the pointer null
// and the GEMMs go through at::mm_out instead.
extern "C" void sgemm_(const char* transa, const char* transb, const int* m, const int* n,
                       const int* k, const float* alpha, const float* a, const int* lda,
                       const float* b, const int* ldb, const float* beta, float* c,
                       const int* ldc) __attribute__((weak));

#if defined(__x86_64__) && defined(__GNUC__) && !defined(__clang__)
#define SDPA_CLONES __attribute__((target_clones("avx512f", "arch=haswell", "default")))
#else
#define SDPA_CLONES
#endif
// The fused pass's helpers are inlined into each clone, so they take its instruction set.
#define SDPA_INLINE inline __attribute__((always_inline))

namespace {

constexpr float kNegInf = -std::numeric_limits<float>::infinity();

// Row-major c[m, n] = a[m, k] . b[n, k]^T (beta 0): the score block.
void gemm_nt(int m, int n, int k, const float* a, int lda, const float* b, int ldb, float* c,
             int ldc) {
  lda = std::max(lda, 1);  // BLAS wants leading dimensions >= 1 even for an empty head (D = 0)
  ldb = std::max(ldb, 1);
  if (sgemm_ != nullptr) {
    const float one = 1.0f, zero = 0.0f;
    // column-major c^T[n, m] = b[n, k] . a^T
    sgemm_("T", "N", &n, &m, &k, &one, b, &ldb, a, &lda, &zero, c, &ldc);
    return;
  }
  auto opts = at::TensorOptions().dtype(at::kFloat);
  auto A = at::from_blob(const_cast<float*>(a), {m, k}, {lda, 1}, opts);
  auto B = at::from_blob(const_cast<float*>(b), {n, k}, {ldb, 1}, opts);
  auto C = at::from_blob(c, {m, n}, {ldc, 1}, opts);
  at::mm_out(C, A, B.t());
}

// Row-major c[m, n] += a[m, k] . b[k, n]: p v into the accumulator.
void gemm_nn_acc(int m, int n, int k, const float* a, int lda, const float* b, int ldb,
                 float* c, int ldc) {
  if (n == 0) return;  // D_v = 0: nothing to accumulate
  if (sgemm_ != nullptr) {
    const float one = 1.0f;
    // column-major c^T[n, m] += b^T[n, k] . a^T[k, m]
    sgemm_("N", "N", &n, &m, &k, &one, b, &ldb, a, &lda, &one, c, &ldc);
    return;
  }
  auto opts = at::TensorOptions().dtype(at::kFloat);
  auto A = at::from_blob(const_cast<float*>(a), {m, k}, {lda, 1}, opts);
  auto B = at::from_blob(const_cast<float*>(b), {k, n}, {ldb, 1}, opts);
  auto C = at::from_blob(c, {m, n}, {ldc, 1}, opts);
  C.addmm_(A, B);
}

// The fused pass works on 16 floats at a time in GCC's generic vectors (vector_size), which
// the compiler lowers to each clone's instruction set: one AVX-512 register, two AVX2 ones or
// four SSE2 ones. (The auto-vectorizer left the loop with seven reductions scalar.)
using vf = float __attribute__((vector_size(64)));
using vi = int32_t __attribute__((vector_size(64)));
constexpr int kLanes = 16;

SDPA_INLINE vf splat(float x) { return vf{} + x; }

SDPA_INLINE vf load(const float* p) {
  vf v;
  std::memcpy(&v, p, sizeof(vf));
  return v;
}

SDPA_INLINE void store(float* p, vf v) { std::memcpy(p, &v, sizeof(vf)); }

SDPA_INLINE float lane_sum(vf v) {
  float s = 0.0f;
  for (int l = 0; l < kLanes; ++l) s += v[l];
  return s;
}

SDPA_INLINE float lane_max(vf v) {
  float s = v[0];
  for (int l = 1; l < kLanes; ++l) s = std::max(s, v[l]);
  return s;
}

// e^x for x <= 0 (-inf included): Cephes' expf (about 1 ulp) on 16 lanes, with no libm call:
// n = round(x log2 e) by truncating a negative number, 2^n by bit arithmetic. Below -87.3
// (e^x under float's normal range) it is exactly 0; e^0 is exactly 1, which the "rest" sums
// rely on.
SDPA_INLINE vf exp_nonpos(vf x) {
  const vf lo = splat(-87.3365447f);
  const vf xc = x < lo ? lo : x;
  const vf fx = xc * 1.44269504088896341f - 0.5f;
  const vi n = __builtin_convertvector(fx, vi);  // truncation toward 0
  const vf nf = __builtin_convertvector(n, vf);
  vf r = xc - nf * 0.693359375f;
  r = r - nf * -2.12194440e-4f;
  vf y = splat(1.9875691500e-4f);
  y = y * r + 1.3981999507e-3f;
  y = y * r + 8.3334519073e-3f;
  y = y * r + 4.1665795894e-2f;
  y = y * r + 1.6666665459e-1f;
  y = y * r + 5.0000001201e-1f;
  y = y * r * r + r + 1.0f;
  const vf pow2n = reinterpret_cast<vf>((n + 127) << 23);
  return x < lo ? vf{} : y * pow2n;
}

// Pass A over one block row: the max score, the raw sum and max |raw| over visible keys.
struct PassA {
  float smax;
  float rsum;
  float rabs;
  int count;
};

// Lanes of pass A: r raw scores, a the addend (0 or the bias where visible, -inf where not).
struct LanesA {
  vf smax = splat(kNegInf), rsum{}, rabs{};
  vi count{};

  template <bool kMasked>
  SDPA_INLINE void add(vf r, vf a, float scale) {
    const vf s = kMasked ? r * scale + a : r * scale;
    smax = s > smax ? s : smax;
    const vf ab = reinterpret_cast<vf>(reinterpret_cast<vi>(r) & 0x7fffffff);
    if (kMasked) {
      const vi vis = a != kNegInf;
      rsum += vis ? r : vf{};
      rabs = (vis & (ab > rabs)) ? ab : rabs;
      count -= vis;  // a true lane is -1
    } else {
      rsum += r;
      rabs = ab > rabs ? ab : rabs;
    }
  }
};

// The first n keys of a row: add == nullptr when all n are visible (the causal edge and the
// key length cut the row at n), else add[j] is the addend.
SDPA_CLONES PassA pass_a(const float* raw, const float* add, int n, float scale) {
  LanesA acc;
  int j = 0;
  for (; j + kLanes <= n; j += kLanes) {
    if (add == nullptr) {
      acc.add<false>(load(raw + j), vf{}, scale);
    } else {
      acc.add<true>(load(raw + j), load(add + j), scale);
    }
  }
  int count = add == nullptr ? j : 0;
  if (j < n) {  // the tail, padded with invisible lanes
    alignas(64) float r[kLanes] = {}, a[kLanes];
    for (int l = 0; l < kLanes; ++l) {
      r[l] = j + l < n ? raw[j + l] : 0.0f;
      a[l] = j + l < n ? (add == nullptr ? 0.0f : add[j + l]) : kNegInf;
    }
    acc.add<true>(load(r), load(a), scale);
  }
  for (int l = 0; l < kLanes; ++l) count += acc.count[l];
  return {lane_max(acc.smax), lane_sum(acc.rsum), lane_max(acc.rabs), count};
}

// Pass B: p = e^(s - m) written over raw (0 where not visible), and the block's sums:
// rest1..3 = sums of (p - [p == 1])^k (the entries equal to 1 are the row max and its exact
// ties, counted apart in ones), t = sum p (s - m), dev/dev2 = sums of raw - mean and its
// square (the block's two-pass M2). rest2 and rest3 are taken of 2^32 (p - [p == 1]), so
// that near-one-hot rows' tiny weights (p ~ 1e-20: p^2 under float's normal range) keep
// their digits; merge() scales them back in double.
constexpr float kPowScale = 4294967296.0f;  // 2^32
constexpr double kInvScale2 = 1.0 / (4294967296.0 * 4294967296.0);
constexpr double kInvScale3 = kInvScale2 / 4294967296.0;
struct PassB {
  float rest1, rest2, rest3, t, ones, dev, dev2;
};

struct LanesB {
  vf rest1{}, rest2{}, rest3{}, t{}, ones{}, dev{}, dev2{};

  template <bool kMasked>
  SDPA_INLINE vf add(vf r, vf a, float scale, float m, float mean) {
    const vf s = kMasked ? r * scale + a : r * scale;
    const vf d = s - m;  // -inf where not visible
    const vf p = exp_nonpos(d);
    const vf one = p >= 1.0f ? splat(1.0f) : vf{};
    const vf q = p - one;
    const vf qs = q * kPowScale;  // 2^32 q: its square and cube stay normal floats longer
    vf c = r - mean;
    if (kMasked) {
      const vi vis = a != kNegInf;
      c = vis ? c : vf{};
      t += vis ? p * d : vf{};
    } else {
      t += p * d;
    }
    rest1 += q;
    rest2 += qs * qs;
    rest3 += qs * qs * qs;
    ones += one;
    dev += c;
    dev2 += c * c;
    return p;
  }
};

SDPA_CLONES PassB pass_b(float* raw, const float* add, int n, float scale, float m,
                         float mean) {
  LanesB acc;
  int j = 0;
  for (; j + kLanes <= n; j += kLanes) {
    if (add == nullptr) {
      store(raw + j, acc.add<false>(load(raw + j), vf{}, scale, m, mean));
    } else {
      store(raw + j, acc.add<true>(load(raw + j), load(add + j), scale, m, mean));
    }
  }
  if (j < n) {
    alignas(64) float r[kLanes] = {}, a[kLanes];
    for (int l = 0; l < kLanes; ++l) {
      r[l] = j + l < n ? raw[j + l] : 0.0f;
      a[l] = j + l < n ? (add == nullptr ? 0.0f : add[j + l]) : kNegInf;
    }
    const vf p = acc.add<true>(load(r), load(a), scale, m, mean);
    for (int l = 0; j + l < n; ++l) raw[j + l] = p[l];
  }
  return {lane_sum(acc.rest1), lane_sum(acc.rest2), lane_sum(acc.rest3), lane_sum(acc.t),
          lane_sum(acc.ones),  lane_sum(acc.dev),   lane_sum(acc.dev2)};
}

// The online state of one query row (double: the merges are a few scalar operations per
// row and block).
struct Row {
  float m;       // true running max of the scores s (-inf before the first visible key)
  double rest1;  // sum of e^(s - m) over every visible key but one row max
  double rest2;  // ... of e^(2 (s - m))
  double rest3;  // ... of e^(3 (s - m))
  double t;      // sum e^(s - m) (s - m): the shifted first moment
  double sink;   // sum of e^(s - m) over the sink's keys
  int64_t count;
  double mean;   // of the raw scores q.k
  double m2;     // sum of squared deviations of the raw scores
  float abs_max;
};

// Merge one block row (pass A's `a`, pass B's `b`, the sink's exponentials) into the state.
// Returns alpha, the factor on the row's accumulated p v.
inline float merge(Row& row, const PassA& a, const PassB& b, float m_new, double sink_blk) {
  const bool had = row.count > 0;
  float alpha = 1.0f;
  const double extra_ones = b.ones;
  if (m_new > row.m) {
    // This block holds the new max: one of its ones is the max itself (left out of the rest
    // sums); the old max, e^(m_old - m_new) relative to it, joins them.
    const double al = had ? std::exp(static_cast<double>(row.m) - m_new) : 0.0;
    const double j = had ? 1.0 : 0.0;
    const double gap = had ? static_cast<double>(row.m) - m_new : 0.0;
    const double l_old = had ? 1.0 + row.rest1 : 0.0;
    row.t = al > 0.0 ? al * (row.t + l_old * gap) : 0.0;
    row.rest1 = al * (row.rest1 + j) + (extra_ones - 1.0);
    row.rest2 = al * al * (row.rest2 + j) + (extra_ones - 1.0);
    row.rest3 = al * al * al * (row.rest3 + j) + (extra_ones - 1.0);
    row.sink *= al;
    row.m = m_new;
    alpha = static_cast<float>(al);
  } else {
    row.rest1 += extra_ones;  // ties of the max are ordinary entries
    row.rest2 += extra_ones;
    row.rest3 += extra_ones;
  }
  row.rest1 += b.rest1;
  row.rest2 += b.rest2 * kInvScale2;
  row.rest3 += b.rest3 * kInvScale3;
  row.t += b.t;
  row.sink += sink_blk;
  // Chan's merge of (count, mean, M2) with the block's exact two-pass moments.
  const double cnt = a.count;
  const double shift = a.rsum / cnt;
  const double bm2 = std::max(0.0, b.dev2 - static_cast<double>(b.dev) * b.dev / cnt);
  const double bmean = shift + b.dev / cnt;
  const double n_new = static_cast<double>(row.count) + cnt;
  const double delta = bmean - row.mean;
  row.m2 += bm2 + delta * delta * static_cast<double>(row.count) * cnt / n_new;
  row.mean += delta * cnt / n_new;
  row.count += a.count;
  row.abs_max = std::max(row.abs_max, a.rabs);
  return alpha;
}

// The row statistics from a row's final state (chunked._finish_rows' formulas): out[0..8] =
// entropy, max_weight, sink_share, lse, grad_health, jacobian_fro, score_mean_raw,
// score_m2_raw, score_abs_max_raw; returns 1 / l (0 for a row with no visible key).
inline double finish_row(const Row& row, float* out, int64_t stride) {
  if (row.count == 0) {
    for (int f = 0; f < 9; ++f) out[f * stride] = 0.0f;
    out[3 * stride] = kNegInf;
    return 0.0;
  }
  const double l = 1.0 + row.rest1;
  const double p_max = 1.0 / l;
  const double r1 = row.rest1 / l;  // 1 - p_max
  const double r2 = row.rest2 / (l * l);
  const double r3 = row.rest3 / (l * l * l);
  // ||J||_F^2 = S2 - 2 S3 + S2^2 and 1 - S2 in terms that do not cancel as p_max -> 1.
  const double jac_sq = p_max * p_max * r1 * r1 + r2 * (1.0 + 2.0 * p_max * p_max) - 2.0 * r3;
  const double one_minus_s2 = r1 * (1.0 + p_max) - r2;
  const double entropy = std::log1p(row.rest1) - row.t / l;
  out[0 * stride] = static_cast<float>(std::max(entropy, 0.0));
  out[1 * stride] = static_cast<float>(p_max);
  out[2 * stride] = static_cast<float>(std::min(row.sink / l, 1.0));
  out[3 * stride] = static_cast<float>(row.m + std::log(l));
  out[4 * stride] =
      static_cast<float>(std::max(one_minus_s2 / static_cast<double>(row.count), 0.0));
  out[5 * stride] = static_cast<float>(std::sqrt(std::max(jac_sq + r2 * r2, 0.0)));
  out[6 * stride] = static_cast<float>(row.mean);
  out[7 * stride] = static_cast<float>(row.m2);
  out[8 * stride] = row.abs_max;
  return p_max;
}

// Query and key block sizes: torch's own CPU flash attention's choice for the query block
// (32 rows for short sequences, 64, then 256), 512 keys; but short tiles with enough
// (batch x head) tasks for every thread take up to 64 rows in one block (half the GEMM calls
// and tasks, which is most of a small tile's cost).
int64_t query_block(int64_t tq, int64_t heads, int64_t threads) {
  if (tq >= 768) return 256;
  if (tq >= 192 || heads >= 2 * threads) return 64;
  return 32;
}
constexpr int64_t kKeyBlock = 512;

// The first n keys of one row of the mask as an addend (keys past n, beyond the causal edge
// or the key length, are never read): add[j] = the bias or 0 where key k0 + j is visible,
// -inf where not.
template <typename bias_t>
void gather_add(float* add, int n, const bool* vis, int64_t vis_stride, const bias_t* bias,
                int64_t bias_stride) {
  for (int j = 0; j < n; ++j) {
    bool ok = true;
    if (vis != nullptr) ok = vis[j * vis_stride];
    float v = kNegInf;
    if (ok) v = bias != nullptr ? static_cast<float>(bias[j * bias_stride]) : 0.0f;
    add[j] = v;
  }
}

template <typename bias_t>
std::vector<at::Tensor> flash_tile_impl(const at::Tensor& q_in, const at::Tensor& k_in,
                                        const at::Tensor& v_in, double scale_d,
                                        int64_t q_start, c10::optional<int64_t> causal_shift,
                                        const c10::optional<at::Tensor>& key_lengths,
                                        const c10::optional<at::Tensor>& visible,
                                        const c10::optional<at::Tensor>& bias,
                                        int64_t sink_tokens) {
  const int64_t B = q_in.size(0), H = q_in.size(1), tq = q_in.size(2), D = q_in.size(3);
  const int64_t H_kv = k_in.size(1), N_kv = k_in.size(2), D_v = v_in.size(3);
  const int64_t group = H / H_kv;
  const float scale = static_cast<float>(scale_d);

  // fp32, contiguous: one O(N D) copy where the inputs are another dtype or layout.
  const at::Tensor q = q_in.to(at::kFloat).contiguous();
  const at::Tensor k = k_in.to(at::kFloat).contiguous();
  const at::Tensor v = v_in.to(at::kFloat).contiguous();
  at::Tensor out = at::zeros({B, H, tq, D_v}, q.options());
  at::Tensor stats = at::empty({9, B, H, tq}, q.options());
  at::Tensor counts = at::empty({B, H, tq}, q.options().dtype(at::kLong));

  at::Tensor kl;
  const int64_t* kl_ptr = nullptr;
  int64_t kl_sb = 0, kl_sh = 0;
  if (key_lengths.has_value()) {
    kl = key_lengths->expand({B, H});
    kl_ptr = kl.data_ptr<int64_t>();
    kl_sb = kl.stride(0);
    kl_sh = kl.stride(1);
  }
  at::Tensor vis_t, bias_t_;
  const bool* vis_ptr = nullptr;
  const bias_t* bias_ptr = nullptr;
  std::array<int64_t, 4> vs{}, bs{};
  if (visible.has_value()) {
    vis_t = visible->expand({B, H, tq, N_kv});
    vis_ptr = vis_t.data_ptr<bool>();
    for (int d = 0; d < 4; ++d) vs[d] = vis_t.stride(d);
  }
  if (bias.has_value()) {
    bias_t_ = bias->expand({B, H, tq, N_kv});
    bias_ptr = bias_t_.data_ptr<bias_t>();
    for (int d = 0; d < 4; ++d) bs[d] = bias_t_.stride(d);
  }
  const bool masked = vis_ptr != nullptr || bias_ptr != nullptr;

  const int64_t threads = at::get_num_threads();
  const int64_t qb = std::max<int64_t>(std::min(query_block(tq, B * H, threads), tq), 1);
  const int64_t kb = std::min(kKeyBlock, std::max<int64_t>(N_kv, 1));
  const int64_t n_qb = (tq + qb - 1) / qb;
  // Per thread: the score block, the mask row, the row states.
  const int64_t per_thread = qb * kb + kb;
  at::Tensor scratch = at::empty({threads, per_thread}, q.options());
  std::vector<std::vector<Row>> rows_of(threads, std::vector<Row>(qb));
  std::vector<std::vector<int64_t>> limit_of(threads, std::vector<int64_t>(qb));

  const float* qp = q.data_ptr<float>();
  const float* kp = k.data_ptr<float>();
  const float* vp = v.data_ptr<float>();
  float* op = out.data_ptr<float>();
  float* sp = stats.data_ptr<float>();
  int64_t* cp = counts.data_ptr<int64_t>();
  const int64_t stat_stride = B * H * tq;

  at::parallel_for(0, B * H * n_qb, 1, [&](int64_t begin, int64_t end) {
    const int64_t tid = at::get_thread_num();
    TORCH_INTERNAL_ASSERT(tid < threads, "a thread outside torch's intra-op pool");
    float* scores = scratch.data_ptr<float>() + tid * per_thread;
    float* add = scores + qb * kb;
    std::vector<Row>& rows = rows_of[tid];
    std::vector<int64_t>& limit = limit_of[tid];
    for (int64_t task = begin; task < end; ++task) {
      const int64_t bh = task / n_qb, b = bh / H, h = bh % H;
      const int64_t i0 = (task % n_qb) * qb, rows_n = std::min(qb, tq - i0);
      const int64_t hk = h / group;
      const float* q_blk = qp + ((b * H + h) * tq + i0) * D;
      const float* k_bh = kp + (b * H_kv + hk) * N_kv * D;
      const float* v_bh = vp + (b * H_kv + hk) * N_kv * D_v;
      float* o_blk = op + ((b * H + h) * tq + i0) * D_v;
      const int64_t length = kl_ptr ? std::min(kl_ptr[b * kl_sb + h * kl_sh], N_kv) : N_kv;
      // Each row's keys [0, limit): the causal edge and the key length.
      int64_t kv_end = 0;
      for (int64_t i = 0; i < rows_n; ++i) {
        int64_t lim = length;
        if (causal_shift.has_value()) lim = std::min(lim, q_start + i0 + i + *causal_shift + 1);
        limit[i] = std::max<int64_t>(lim, 0);
        kv_end = std::max(kv_end, limit[i]);
        rows[i] = Row{kNegInf, 0.0, 0.0, 0.0, 0.0, 0.0, 0, 0.0, 0.0, 0.0f};
      }
      for (int64_t k0 = 0; k0 < kv_end; k0 += kb) {
        const int64_t w = std::min(kb, N_kv - k0);
        gemm_nt(static_cast<int>(rows_n), static_cast<int>(w), static_cast<int>(D), q_blk,
                static_cast<int>(D), k_bh + k0 * D, static_cast<int>(D), scores,
                static_cast<int>(w));
        for (int64_t i = 0; i < rows_n; ++i) {
          float* row_s = scores + i * w;
          const int n = static_cast<int>(std::clamp<int64_t>(limit[i] - k0, 0, w));
          const float* row_add = nullptr;
          const int width = n;
          if (masked) {
            const int64_t qi = i0 + i;
            const bool* vrow =
                vis_ptr ? vis_ptr + b * vs[0] + h * vs[1] + qi * vs[2] + k0 * vs[3] : nullptr;
            const bias_t* brow =
                bias_ptr ? bias_ptr + b * bs[0] + h * bs[1] + qi * bs[2] + k0 * bs[3] : nullptr;
            gather_add(add, n, vrow, vs[3], brow, bs[3]);
            row_add = add;
          }
          PassA a = pass_a(row_s, row_add, width, scale);
          if (a.count == 0) {  // no visible key in this block
            std::fill(row_s, row_s + w, 0.0f);
            continue;
          }
          Row& row = rows[i];
          const float m_new = std::max(row.m, a.smax);
          const float mean = a.rsum / static_cast<float>(a.count);
          PassB pb = pass_b(row_s, row_add, width, scale, m_new, mean);
          std::fill(row_s + width, row_s + w, 0.0f);
          double sink_blk = 0.0;
          const int64_t sink_n = std::clamp<int64_t>(sink_tokens - k0, 0, width);
          for (int64_t j = 0; j < sink_n; ++j) sink_blk += row_s[j];
          const float alpha = merge(row, a, pb, m_new, sink_blk);
          if (alpha != 1.0f) {
            float* o_row = o_blk + i * D_v;
            for (int64_t d = 0; d < D_v; ++d) o_row[d] *= alpha;
          }
        }
        gemm_nn_acc(static_cast<int>(rows_n), static_cast<int>(D_v), static_cast<int>(w),
                    scores, static_cast<int>(w), v_bh + k0 * D_v, static_cast<int>(D_v), o_blk,
                    static_cast<int>(D_v));
      }
      for (int64_t i = 0; i < rows_n; ++i) {
        const int64_t r = (b * H + h) * tq + i0 + i;
        const double inv_l = finish_row(rows[i], sp + r, stat_stride);
        cp[r] = rows[i].count;
        float* o_row = o_blk + i * D_v;
        const float f = static_cast<float>(inv_l);
        for (int64_t d = 0; d < D_v; ++d) o_row[d] *= f;
      }
    }
  });

  std::vector<at::Tensor> result;
  result.reserve(11);
  result.push_back(q_in.scalar_type() == at::kFloat ? out : out.to(q_in.scalar_type()));
  result.push_back(counts);
  for (at::Tensor& s : stats.unbind(0)) result.push_back(s);
  return result;
}

std::vector<at::Tensor> flash_tile(const at::Tensor& q, const at::Tensor& k, const at::Tensor& v,
                                   double scale, int64_t q_start,
                                   c10::optional<int64_t> causal_shift,
                                   const c10::optional<at::Tensor>& key_lengths,
                                   const c10::optional<at::Tensor>& visible,
                                   const c10::optional<at::Tensor>& bias, int64_t sink_tokens) {
  TORCH_CHECK(q.dim() == 4 && k.dim() == 4 && v.dim() == 4, "q, k, v must be 4-D");
  TORCH_CHECK(q.device().is_cpu() && k.device().is_cpu() && v.device().is_cpu(),
              "the CPU flash kernel takes CPU tensors");
  const auto dt = q.scalar_type();
  TORCH_CHECK(dt == at::kFloat || dt == at::kHalf || dt == at::kBFloat16,
              "q must be float32, float16 or bfloat16");
  TORCH_CHECK(k.scalar_type() == dt && v.scalar_type() == dt, "q, k, v must share one dtype");
  TORCH_CHECK(k.size(0) == q.size(0) && v.size(0) == q.size(0), "batch sizes differ");
  TORCH_CHECK(k.size(1) > 0 && q.size(1) % k.size(1) == 0 && v.size(1) == k.size(1),
              "query heads must be a multiple of the key/value heads");
  TORCH_CHECK(k.size(3) == q.size(3) && v.size(2) == k.size(2), "k and v do not match q");
  if (key_lengths.has_value())
    TORCH_CHECK(key_lengths->scalar_type() == at::kLong, "key_lengths must be int64");
  if (visible.has_value())
    TORCH_CHECK(visible->scalar_type() == at::kBool, "visible must be bool");
  if (!bias.has_value())
    return flash_tile_impl<float>(q, k, v, scale, q_start, causal_shift, key_lengths, visible,
                                  bias, sink_tokens);
  return AT_DISPATCH_FLOATING_TYPES_AND2(
      at::kHalf, at::kBFloat16, bias->scalar_type(), "cpu_flash_bias", [&] {
        return flash_tile_impl<scalar_t>(q, k, v, scale, q_start, causal_shift, key_lengths,
                                         visible, bias, sink_tokens);
      });
}

// The summary's per-head table (diagnostics._head_table, the same quantities in one call):
// fields are RowStats' entropy, max_weight, sink_share, grad_health, jacobian_fro,
// score_mean_raw, score_m2_raw, score_abs_max_raw ([..., rows], one float dtype), counts its
// visible_keys (int64). Returns float64 [15, heads]: per head the sums over its active rows
// of diagnostics._TABLE (active, entropy, normalized entropy, effective keys, max weight,
// saturated, sink share, grad health, Jacobian norm, n, n * mean, M2), then Chan's spread
// sum n (mean_row - mean_head)^2, the head's mean and its max |raw score|. A fully masked
// row adds nothing (whatever it holds); sums run in double in row order, NaN propagates.
template <typename scalar_t>
void head_table_impl(const std::vector<at::Tensor>& f, const int64_t* counts, int64_t heads,
                     int64_t rows, double saturation, double* out) {
  std::array<const scalar_t*, 8> p{};
  for (size_t i = 0; i < p.size(); ++i) p[i] = f[i].data_ptr<scalar_t>();
  // Heads are independent (each sums its own rows in order: the same numbers on any number of
  // threads); a table of few rows stays on this thread (the grain covers about 32k rows).
  const int64_t grain = std::max<int64_t>(1, 32768 / std::max<int64_t>(rows, 1));
  at::parallel_for(0, heads, grain, [&](int64_t h_begin, int64_t h_end) {
  for (int64_t h = h_begin; h < h_end; ++h) {
    std::array<double, 12> t{};
    double abs_max = 0.0;
    const int64_t r0 = h * rows;
    for (int64_t r = r0; r < r0 + rows; ++r) {
      const int64_t n = counts[r];
      if (n <= 0) continue;
      const double nd = static_cast<double>(n);
      const double ent = p[0][r], mw = p[1][r];
      t[0] += 1.0;
      t[1] += ent;
      if (n > 1) t[2] += std::min(ent / std::log(nd), 1.0);  // NaN stays NaN
      t[3] += std::exp(ent);
      t[4] += mw;
      t[5] += mw >= saturation ? 1.0 : 0.0;
      t[6] += p[2][r];
      t[7] += p[3][r];
      t[8] += p[4][r];
      t[9] += nd;
      t[10] += nd * static_cast<double>(p[5][r]);
      t[11] += p[6][r];
      const double a = p[7][r];
      if (!(a <= abs_max) && !std::isnan(abs_max)) abs_max = a;  // NaN wins, as in amax
    }
    const double mean = t[10] / std::max(t[9], 1.0);
    double spread = 0.0;
    for (int64_t r = r0; r < r0 + rows; ++r) {
      if (counts[r] <= 0) continue;
      const double d = static_cast<double>(p[5][r]) - mean;
      spread += static_cast<double>(counts[r]) * d * d;
    }
    for (int64_t i = 0; i < 12; ++i) out[i * heads + h] = t[i];
    out[12 * heads + h] = spread;
    out[13 * heads + h] = mean;
    out[14 * heads + h] = abs_max;
  }
  });
}

at::Tensor head_table(const std::vector<at::Tensor>& fields, const at::Tensor& visible_keys,
                      double saturation) {
  TORCH_CHECK(fields.size() == 8, "head_table takes 8 row statistics");
  TORCH_CHECK(visible_keys.scalar_type() == at::kLong && visible_keys.device().is_cpu(),
              "visible_keys must be int64 on the CPU");
  TORCH_CHECK(visible_keys.dim() >= 1, "visible_keys must have a rows dimension");
  const int64_t rows = visible_keys.size(-1);
  const int64_t heads = rows == 0 ? 0 : visible_keys.numel() / rows;
  const auto dt = fields[0].scalar_type();
  TORCH_CHECK(dt == at::kFloat || dt == at::kDouble, "row statistics must be float32/64");
  std::vector<at::Tensor> f;
  f.reserve(fields.size());
  for (const at::Tensor& x : fields) {
    TORCH_CHECK(x.scalar_type() == dt && x.device().is_cpu() &&
                    x.sizes() == visible_keys.sizes(),
                "row statistics must share visible_keys' shape, one dtype, the CPU");
    f.push_back(x.contiguous());
  }
  const at::Tensor counts = visible_keys.contiguous();
  at::Tensor out = at::empty({15, heads}, visible_keys.options().dtype(at::kDouble));
  if (dt == at::kFloat)
    head_table_impl<float>(f, counts.data_ptr<int64_t>(), heads, rows, saturation,
                           out.data_ptr<double>());
  else
    head_table_impl<double>(f, counts.data_ptr<int64_t>(), heads, rows, saturation,
                            out.data_ptr<double>());
  return out;
}

}  // namespace

PYBIND11_MODULE(TORCH_EXTENSION_NAME, m) {
  m.def("flash_tile", &flash_tile,
        "Attention and every row statistic of one query tile: [output, visible_keys, entropy, "
        "max_weight, sink_share, lse, grad_health, jacobian_fro, score_mean_raw, score_m2_raw, "
        "score_abs_max_raw]",
        py::arg("q"), py::arg("k"), py::arg("v"), py::arg("scale"), py::arg("q_start"),
        py::arg("causal_shift"), py::arg("key_lengths"), py::arg("visible"), py::arg("bias"),
        py::arg("sink_tokens"),
        // The GIL is released while the kernel runs (as torch's own ops do): a long tile must
        // not stop the service's other threads, its event loop among them.
        py::call_guard<py::gil_scoped_release>());
  m.def("head_table", &head_table,
        "The summary's per-head table from RowStats (diagnostics._head_table): float64 "
        "[15, heads]",
        py::arg("fields"), py::arg("visible_keys"), py::arg("saturation"),
        // As flash_tile: a long request's table (millions of rows) must not hold the GIL.
        py::call_guard<py::gil_scoped_release>());
}
