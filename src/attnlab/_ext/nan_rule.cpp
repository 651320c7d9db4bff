// The NaN rule's prefix case as two CPU operators (see attnlab/functional/nan_rule.py).
//
// Every query row i attends a prefix [0, hi_i) of the keys (no mask, causal, padding, both).
// Row i is NaN in column d iff the first key whose k (any entry) or v[d] is non-finite lies below
// hi_i, or q_i is non-finite and hi_i > 0. Both operators read q, k and v once and touch the
// output only where it becomes NaN: for finite inputs their cost is one read of the inputs.
//
//   attnlab_nan::poison_prefix_(out!, q, k, v, hi, lse?) -> ()
//       writes NaN into out (and lse, on whole-row poison) where the rule says; in place.
//   attnlab_nan::sdpa_prefix(q, k, v, attn_mask?, hi, scale, is_causal, enable_gqa, clean_k)
//       -> out: at::scaled_dot_product_attention on (q, k', v') with v' = nan_to_num(v) and
//       k' = nan_to_num(k) (if clean_k) when they hold a non-finite entry (else the inputs
//       themselves: no copy), then poison_prefix_. The kernel runs on the inputs first and the
//       scan after it (the inputs still cached); only a call that needs a cleaned copy runs
//       the kernel a second time.
//   attnlab_nan::decode_attend(q, k, v, scale, keys?, softcap=0.0, sinks?) -> out: the decode
//       backend's step
//       (attnlab/functional/decode.py `_attend`: softmax(q·kᵀ·scale)·v, a row with a non-finite
//       logit NaN) in one pass per (item, k/v head) that reads the cached k and v rows in place
//       (no copy of a cache view, each row once for the G query heads sharing it), in float32
//       (float64 for float64 inputs); the tensor-op path's values up to rounding. keys, a bool
//       (B or 1, S) tensor, restricts every row of item b to the keys where keys[b] is True:
//       one run of them (padding on either side) is read in place, several runs (holes) are
//       gathered first; the other keys are never read, and an item with none gives zeros.
//       softcap > 0: the logits become softcap·tanh(logit / softcap) (Gemma 2; `tanh_f`),
//       after the row's non-finite check (tanh would hide ±inf).
//       sinks, float32 (H,) (attention sinks, GPT-OSS): head h's logit s_h joins the
//       denominator of each of its rows where the row is finalised (`sink_inverse`):
//       out = Σ_j e^{l_j} v_j / (e^{s_h} + Σ_j e^{l_j}); a NaN/+inf s_h makes the rows with a key
//       NaN (the NaN rule); a row with no key stays zeros.
//   attnlab_nan::rope_decode_attend(q, k, v, cos, sin, q_start, k_start, rotate_keys,
//       rotary_dim, interleaved, scale) -> out: `MultiHeadAttention`'s cached decode step after
//       the cache update: RoPE of q (positions q_start…) and, if rotate_keys, of every cached key
//       (positions k_start…) from rows of the tables cos/sin (N, rotary_dim/2) — the calls of
//       `RoPE.forward`'s table path — then decode_attend.
//   attnlab_nan::rope_rows(x, cos, sin, start, rotary_dim, interleaved) -> out: that rotation
//       alone (a rotate-at-insert cache's new keys), bit-equal to `RoPE.forward(x, start)`.
//   attnlab_nan::rms_norm(x, weight, eps) -> out: `RMSNorm.forward` without autograd in one
//       pass per row, y = x·rsqrt(mean(x²) + eps)·w: statistics in float32 (float64 for
//       float64), and for float16/bfloat16 x·rsqrt(…) rounded to the dtype before the product
//       with w, as the module's tensor ops do (a decode step runs 2 per layer on a few rows,
//       where torch's composite op takes ~8 operator calls).
#include <ATen/ATen.h>
#include <ATen/Parallel.h>
#include <torch/library.h>

#include <algorithm>
#include <cstdint>
#include <cstring>
#include <cmath>
#include <limits>
#include <optional>
#include <type_traits>
#include <utility>
#include <vector>

#include "nonfinite.h"
#include "vexp.h"

#if defined(__AVX512F__)
#include <immintrin.h>
#endif

namespace {

using attnlab_bits::Bits;

template <typename T>
inline bool row_bad(const T* p, int64_t n) {
  return attnlab_bits::span_bad(p, n);
}

// The first of `rows` rows (n values each, `stride` apart) holding a non-finite value, or
// `rows`. Contiguous rows are checked in blocks of 32 rows as one straight span (the common,
// all-finite case is one vectorised pass), and only a bad block is searched row by row.
template <typename T>
int64_t first_bad_row(const T* p, int64_t rows, int64_t stride, int64_t n) {
  constexpr int64_t kBlock = 32;
  int64_t s = 0;
  if (stride == n) {
    for (; s + kBlock <= rows; s += kBlock) {
      if (row_bad(p + s * stride, kBlock * n)) break;
    }
  }
  for (; s < rows; ++s) {
    if (row_bad(p + s * stride, n)) return s;
  }
  return rows;
}

template <typename T>
inline bool is_bad(const T* p) {
  using U = typename Bits<T>::U;
  constexpr U E = Bits<T>::kExp;
  return (*reinterpret_cast<const U*>(p) & E) == E;
}

at::Tensor unit_last(const at::Tensor& x) {
  return (x.size(-1) <= 1 || x.stride(-1) == 1) ? x : x.contiguous();
}

// What the rule needs from q, k, v: per (b, h_kv) and column d the first key whose k row or
// v[d] is non-finite (S if none); per query row whether q_i is non-finite; whether k or v holds
// any non-finite entry.
struct Scan {
  std::vector<int64_t> first;  // (B, H_kv, Dv)
  std::vector<int64_t> first_min;  // (B, H_kv): min over d
  std::vector<int64_t> first_k;  // (B, H_kv)
  std::vector<uint8_t> q_bad;  // (B, H, L)
  bool k_any = false, v_any = false;
};

template <typename T>
Scan scan(const at::Tensor& q, const at::Tensor& k, const at::Tensor& v) {
  const int64_t B = q.size(0), H = q.size(1), L = q.size(2), D = q.size(3);
  const int64_t Hk = k.size(1), S = k.size(2), Dv = v.size(3);
  Scan r;
  r.first.assign(B * Hk * Dv, S);
  r.first_min.assign(B * Hk, S);
  r.first_k.assign(B * Hk, S);
  r.q_bad.assign(B * H * L, 0);
  const T* kp = k.const_data_ptr<T>();
  const T* vp = v.const_data_ptr<T>();
  const T* qp = q.const_data_ptr<T>();
  const auto ks = k.strides();
  const auto vs = v.strides();
  const auto qs = q.strides();
  std::vector<uint8_t> vbad(B * Hk, 0);
  at::parallel_for(0, B * Hk, 1, [&](int64_t begin, int64_t end) {
    for (int64_t bh = begin; bh < end; ++bh) {
      const int64_t b = bh / Hk, h = bh % Hk;
      const T* kb = kp + b * ks[0] + h * ks[1];
      const int64_t fk = first_bad_row(kb, S, ks[2], D);
      r.first_k[bh] = fk;
      const T* vb = vp + b * vs[0] + h * vs[1];
      int64_t* first = r.first.data() + bh * Dv;
      // columns found so far; the scan of v stops at the first key of a bad k row (nothing
      // past it can lower `first` below fk)
      int64_t found = 0;
      for (int64_t s = 0; s < fk && found < Dv; ++s) {
        s += first_bad_row(vb + s * vs[2], fk - s, vs[2], Dv);  // the next bad row, or fk
        if (s >= fk) break;
        const T* row = vb + s * vs[2];
        vbad[bh] = 1;
        for (int64_t d = 0; d < Dv; ++d) {
          if (first[d] == S && is_bad(row + d)) {
            first[d] = s;
            ++found;
          }
        }
      }
      if (fk < S && !vbad[bh]) {
        // v beyond the first bad key is not needed for `first`, but sdpa_prefix must know
        // whether v needs cleaning at all
        if (first_bad_row(vb + fk * vs[2], S - fk, vs[2], Dv) < S - fk) vbad[bh] = 1;
      }
      int64_t mn = fk;
      for (int64_t d = 0; d < Dv; ++d) {
        first[d] = std::min(first[d], fk);
        mn = std::min(mn, first[d]);
      }
      r.first_min[bh] = mn;
    }
  });
  at::parallel_for(0, B * H, 1, [&](int64_t begin, int64_t end) {
    for (int64_t bh = begin; bh < end; ++bh) {
      const int64_t b = bh / H, h = bh % H;
      const T* qb = qp + b * qs[0] + h * qs[1];
      for (int64_t i = first_bad_row(qb, L, qs[2], D); i < L;
           i += 1 + first_bad_row(qb + (i + 1) * qs[2], L - i - 1, qs[2], D)) {
        r.q_bad[bh * L + i] = 1;  // (the rest stay 0 from assign)
      }
    }
  });
  for (int64_t bh = 0; bh < B * Hk; ++bh) {
    r.k_any = r.k_any || r.first_k[bh] < S;
    r.v_any = r.v_any || vbad[bh];
  }
  return r;
}

template <typename T, typename TL>
void apply(const Scan& r, at::Tensor& out, const at::Tensor& hi, at::Tensor* lse, int64_t Hk,
           int64_t S) {
  const int64_t B = out.size(0), H = out.size(1), L = out.size(2), Dv = out.size(3);
  const int64_t G = H / Hk;
  T* op = out.mutable_data_ptr<T>();
  const auto os = out.strides();
  const at::Tensor hic = hi.to(at::kLong).contiguous();
  const int64_t* hp = hic.const_data_ptr<int64_t>();
  const int64_t hB = hic.size(0) == 1 ? 0 : hic.size(-1) * hic.size(1);
  const int64_t hL = hic.size(-1) == 1 ? 0 : 1;
  TL* lp = lse ? lse->mutable_data_ptr<TL>() : nullptr;
  const auto ls = lse ? lse->strides() : at::IntArrayRef();
  const T nan = std::numeric_limits<T>::quiet_NaN();
  at::parallel_for(0, B * H, 1, [&](int64_t begin, int64_t end) {
    for (int64_t bh = begin; bh < end; ++bh) {
      const int64_t b = bh / H, h = bh % H, bk = b * Hk + h / G;
      const int64_t mn = r.first_min[bk];
      const int64_t* first = r.first.data() + bk * Dv;
      for (int64_t i = 0; i < L; ++i) {
        int64_t lim = hp[b * hB + i * hL];
        if (lim > 0 && r.q_bad[bh * L + i]) lim = S + 1;  // a bad q poisons every column
        if (lim <= mn) continue;  // the common case: nothing to poison, out is not touched
        T* row = op + b * os[0] + h * os[1] + i * os[2];
        for (int64_t d = 0; d < Dv; ++d) {
          if (first[d] < lim) row[d * os[3]] = nan;
        }
        if (lp && r.first_k[bk] < lim) {
          lp[b * ls[0] + h * ls[1] + i * ls[2]] = std::numeric_limits<TL>::quiet_NaN();
        }
      }
    }
  });
}

void check_inputs(const at::Tensor& q, const at::Tensor& k, const at::Tensor& v,
                  const at::Tensor& hi) {
  TORCH_CHECK(q.dim() == 4 && k.dim() == 4 && v.dim() == 4, "attnlab_nan: q, k, v must be 4-D");
  TORCH_CHECK(q.device().is_cpu() && k.device().is_cpu() && v.device().is_cpu() &&
                  hi.device().is_cpu(),
              "attnlab_nan: CPU tensors only");
  TORCH_CHECK(q.scalar_type() == k.scalar_type() && q.scalar_type() == v.scalar_type(),
              "attnlab_nan: q, k and v must share one dtype");
  TORCH_CHECK(k.size(0) == q.size(0) && v.size(0) == q.size(0) && k.size(1) == v.size(1) &&
                  k.size(2) == v.size(2) && k.size(3) == q.size(3),
              "attnlab_nan: q (B, H, L, D), k (B, H_kv, S, D), v (B, H_kv, S, Dv) expected");
  TORCH_CHECK(k.size(1) == 0 ? q.size(1) == 0 : q.size(1) % k.size(1) == 0,
              "attnlab_nan: H % H_kv != 0");
  TORCH_CHECK(hi.dim() == 3 && hi.size(1) == 1 && (hi.size(0) == 1 || hi.size(0) == q.size(0)) &&
                  (hi.size(2) == 1 || hi.size(2) == q.size(2)),
              "attnlab_nan: hi must be (B|1, 1, L|1)");
}

void check_out(const at::Tensor& out, const at::Tensor& q, const at::Tensor& v) {
  TORCH_CHECK(out.dim() == 4 && out.device().is_cpu() && out.scalar_type() == q.scalar_type(),
              "attnlab_nan: out must be a 4-D CPU tensor of q's dtype");
  TORCH_CHECK(out.size(0) == q.size(0) && out.size(1) == q.size(1) && out.size(2) == q.size(2) &&
                  out.size(3) == v.size(3),
              "attnlab_nan: out must be (B, H, L, Dv)");
}

template <typename T>
void poison_impl(at::Tensor& out, const at::Tensor& q, const at::Tensor& k, const at::Tensor& v,
                 const at::Tensor& hi, const c10::optional<at::Tensor>& lse, const Scan& r) {
  if (lse.has_value()) {
    at::Tensor l = *lse;
    TORCH_CHECK(l.dim() == 3 && l.size(0) == q.size(0) && l.size(1) == q.size(1) &&
                    l.size(2) == q.size(2),
                "attnlab_nan: lse must be (B, H, L)");
    if (l.scalar_type() == at::kDouble) {
      apply<T, double>(r, out, hi, &l, k.size(1), k.size(2));
    } else {
      TORCH_CHECK(l.scalar_type() == at::kFloat, "attnlab_nan: lse must be float32 or float64");
      apply<T, float>(r, out, hi, &l, k.size(1), k.size(2));
    }
  } else {
    apply<T, float>(r, out, hi, nullptr, k.size(1), k.size(2));
  }
}

#define ATTNLAB_DISPATCH(dtype, NAME, ...)                                  \
  switch (dtype) {                                                          \
    case at::kFloat: { using scalar_t = float; __VA_ARGS__; break; }        \
    case at::kDouble: { using scalar_t = double; __VA_ARGS__; break; }      \
    case at::kBFloat16: { using scalar_t = c10::BFloat16; __VA_ARGS__; break; } \
    case at::kHalf: { using scalar_t = c10::Half; __VA_ARGS__; break; }     \
    default: TORCH_CHECK(false, NAME ": unsupported dtype ", dtype);        \
  }

void poison_prefix_(at::Tensor out, const at::Tensor& q_, const at::Tensor& k_,
                    const at::Tensor& v_, const at::Tensor& hi,
                    const c10::optional<at::Tensor>& lse) {
  const at::Tensor q = unit_last(q_), k = unit_last(k_), v = unit_last(v_);
  check_inputs(q, k, v, hi);
  check_out(out, q, v);
  if (q.numel() == 0 || k.size(2) == 0 || out.numel() == 0) return;
  ATTNLAB_DISPATCH(q.scalar_type(), "poison_prefix_", {
    const Scan r = scan<scalar_t>(q, k, v);
    poison_impl<scalar_t>(out, q, k, v, hi, lse, r);
  });
}

at::Tensor sdpa_prefix(const at::Tensor& q_, const at::Tensor& k_, const at::Tensor& v_,
                       const c10::optional<at::Tensor>& attn_mask, const at::Tensor& hi,
                       double scale, bool is_causal, bool enable_gqa, bool clean_k) {
  const at::Tensor q = unit_last(q_), k = unit_last(k_), v = unit_last(v_);
  check_inputs(q, k, v, hi);
  at::Tensor out;
  ATTNLAB_DISPATCH(q.scalar_type(), "sdpa_prefix", {
    // The kernel first, on the inputs themselves, and the scan after it, while q, k and v are
    // still in cache from the kernel's own reads; in the rare call whose k (when cleaned) or v
    // holds a non-finite entry the kernel runs again on the cleaned copies.
    out = at::scaled_dot_product_attention(q, k, v, attn_mask, 0.0, is_causal, scale,
                                           enable_gqa);
    const Scan r = scan<scalar_t>(q, k, v);
    if ((clean_k && r.k_any) || r.v_any) {
      const at::Tensor kk = (clean_k && r.k_any) ? at::nan_to_num(k, 0.0, 0.0, 0.0) : k;
      const at::Tensor vv = r.v_any ? at::nan_to_num(v, 0.0, 0.0, 0.0) : v;
      out = at::scaled_dot_product_attention(q, kk, vv, attn_mask, 0.0, is_causal, scale,
                                             enable_gqa);
    }
    check_out(out, q, v);
    if (q.numel() != 0 && k.size(2) != 0 && out.numel() != 0) {
      poison_impl<scalar_t>(out, q, k, v, hi, c10::nullopt, r);
    }
  });
  return out;
}

// Σ a[d]·b[d] over D values (float32 in 512-bit vectors where the CPU has them: the plain
// loop's reduction is summed lane by lane in order under -ffp-contract=off).
inline float dot(const float* a, const float* b, int64_t D) {
#if defined(__AVX512F__)
  __m512 acc = _mm512_setzero_ps();
  int64_t d = 0;
  for (; d + 16 <= D; d += 16) {
    acc = _mm512_fmadd_ps(_mm512_loadu_ps(a + d), _mm512_loadu_ps(b + d), acc);
  }
  if (d < D) {
    const __mmask16 m = static_cast<__mmask16>((1u << (D - d)) - 1u);
    acc = _mm512_fmadd_ps(_mm512_maskz_loadu_ps(m, a + d), _mm512_maskz_loadu_ps(m, b + d), acc);
  }
  return _mm512_reduce_add_ps(acc);
#else
  float acc[16] = {};
  int64_t d = 0;
  for (; d + 16 <= D; d += 16) {
#pragma omp simd
    for (int l = 0; l < 16; ++l) acc[l] = std::fma(a[d + l], b[d + l], acc[l]);
  }
  for (; d < D; ++d) acc[0] = std::fma(a[d], b[d], acc[0]);
  for (int w = 8; w > 0; w /= 2) {
    for (int l = 0; l < w; ++l) acc[l] += acc[l + w];
  }
  return acc[0];
#endif
}

inline double dot(const double* a, const double* b, int64_t D) {
  double acc = 0;
  for (int64_t d = 0; d < D; ++d) acc = std::fma(a[d], b[d], acc);
  return acc;
}

// (max of the n values, whether all are finite).
template <typename C>
inline std::pair<C, bool> max_finite_plain(const C* x, int64_t n) {
  C mx = -std::numeric_limits<C>::infinity();
  bool finite = true;
  for (int64_t j = 0; j < n; ++j) {
    mx = std::max(mx, x[j]);
    finite = finite && std::isfinite(x[j]);
  }
  return {mx, finite};
}

inline std::pair<float, bool> max_finite(const float* x, int64_t n) {
#if defined(__AVX512F__)
  __m512 mx = _mm512_set1_ps(-std::numeric_limits<float>::infinity());
  __m512 bad = _mm512_setzero_ps();  // x − x: 0 for finite x, NaN for ±inf and NaN
  int64_t j = 0;
  for (; j + 16 <= n; j += 16) {
    const __m512 v = _mm512_loadu_ps(x + j);
    mx = _mm512_max_ps(mx, v);
    bad = _mm512_add_ps(bad, _mm512_sub_ps(v, v));
  }
  if (j < n) {
    const __mmask16 m = static_cast<__mmask16>((1u << (n - j)) - 1u);
    const __m512 v = _mm512_maskz_loadu_ps(m, x + j);
    mx = _mm512_mask_max_ps(mx, m, mx, v);
    bad = _mm512_add_ps(bad, _mm512_sub_ps(v, v));
  }
  const bool finite = _mm512_cmp_ps_mask(bad, bad, _CMP_UNORD_Q) == 0;
  return {_mm512_reduce_max_ps(mx), finite};
#else
  return max_finite_plain(x, n);
#endif
}

inline std::pair<double, bool> max_finite(const double* x, int64_t n) {
  return max_finite_plain(x, n);
}

// Keys per partial sum of p·v: each block of kSumBlock keys is summed on its own and then added
// to the row's total, so a float32 sum over n keys carries ~(√kSumBlock + √(n / kSumBlock))
// roundings instead of ~√n (600 keys: 2.3× fewer); the float32 decode step then stays within
// the tolerance rule of torch's blocked matrix product on every CPU (an AVX2-only EPYC failed it
// in 1 case of 12 with one running sum).
constexpr int64_t kSumBlock = 32;

// acc (R × Dv) = Σ_j e[r][j]·row(j)[d] in C, summed per block of kSumBlock keys into `part`
// (R × Dv scratch) and then added to acc.
template <typename C, typename Row>
inline void weigh_blocks(const C* e, int64_t n, const Row& row, C* acc, int64_t R, int64_t Dv,
                         C* part) {
  std::fill(acc, acc + R * Dv, C(0));
  for (int64_t j0 = 0; j0 < n; j0 += kSumBlock) {
    std::fill(part, part + R * Dv, C(0));
    for (int64_t j = j0; j < std::min(n, j0 + kSumBlock); ++j) {
      const C* vr = row(j);
      for (int64_t r = 0; r < R; ++r) {
        const C w = e[r * n + j];
        C* pr = part + r * Dv;
#pragma omp simd
        for (int64_t d = 0; d < Dv; ++d) pr[d] = std::fma(w, vr[d], pr[d]);
      }
    }
#pragma omp simd
    for (int64_t i = 0; i < R * Dv; ++i) acc[i] += part[i];
  }
}

#if defined(__AVX512F__)
// How many rows of `width` floats ahead of the one being read the loops prefetch: 16 KB. A decode
// step streams its cached k and v rows from memory once, and the hardware prefetcher alone left a
// 4096-key step whose cache was evicted (the rest of a model's step runs between two calls) at
// a third of the machine's read bandwidth: 316 µs → 86–101 µs for k and v of 2 × 4096 × 64
// floats, 54 → 62 µs when they are in cache (Zen 5 EPYC; benchmarks/RESULTS.md).
inline int64_t prefetch_rows(int64_t width) {
  return std::max<int64_t>(4, 4096 / std::max<int64_t>(1, width));
}

// acc rows r0…r0+N−1, columns d…d+15 (mask m) += Σ_{j0 <= j < j1} e[r][j]·v[j]: one block of
// keys summed in N registers, then added to acc.
template <int N>
inline void weigh_block(const float* e, int64_t n, const float* v, int64_t vs, float* acc,
                        int64_t Dv, int64_t d, __mmask16 m, int64_t j0, int64_t j1) {
  __m512 b[N];
  for (int r = 0; r < N; ++r) b[r] = _mm512_setzero_ps();
  for (int64_t j = j0; j < j1; ++j) {
    const __m512 x = _mm512_maskz_loadu_ps(m, v + j * vs + d);
    for (int r = 0; r < N; ++r) b[r] = _mm512_fmadd_ps(_mm512_set1_ps(e[r * n + j]), x, b[r]);
  }
  for (int r = 0; r < N; ++r) {
    float* a = acc + r * Dv + d;
    _mm512_mask_storeu_ps(a, m, _mm512_add_ps(_mm512_maskz_loadu_ps(m, a), b[r]));
  }
}
#endif

// acc (R × Dv) = e (R × n, row stride n) · v (n rows of Dv, row stride vs), float32, in partial
// sums of kSumBlock keys; with AVX-512 block by block of keys (a block's rows stay in L1 for
// every column group, and v is read once, in order), in groups of 4 rows × 16 columns summed in
// registers (`part`: R × Dv floats of scratch for the portable loop).
inline void weigh_values(const float* e, int64_t n, const float* v, int64_t vs, float* acc,
                         int64_t R, int64_t Dv, [[maybe_unused]] float* part) {
#if defined(__AVX512F__)
  std::fill(acc, acc + R * Dv, 0.0f);
  const int64_t ahead = prefetch_rows(Dv);
  for (int64_t j0 = 0; j0 < n; j0 += kSumBlock) {
    const int64_t j1 = std::min(n, j0 + kSumBlock);
    for (int64_t j = std::max(j1, j1 + ahead - kSumBlock); j < std::min(n, j1 + ahead); ++j) {
      for (int64_t d = 0; d < Dv; d += 16) {
        _mm_prefetch(reinterpret_cast<const char*>(v + j * vs + d), _MM_HINT_T0);
      }
    }
    for (int64_t d = 0; d < Dv; d += 16) {
      const __mmask16 m =
          static_cast<__mmask16>(Dv - d >= 16 ? 0xFFFFu : (1u << (Dv - d)) - 1u);
      int64_t r = 0;
      for (; r + 4 <= R; r += 4) {
        weigh_block<4>(e + r * n, n, v, vs, acc + r * Dv, Dv, d, m, j0, j1);
      }
      for (; r < R; ++r) weigh_block<1>(e + r * n, n, v, vs, acc + r * Dv, Dv, d, m, j0, j1);
    }
  }
#else
  weigh_blocks(e, n, [&](int64_t j) { return v + j * vs; }, acc, R, Dv, part);
#endif
}

// s (R × n, row stride n) = (q · kᵀ)·scale for q (R × D, rows D apart) and n keys (row stride
// ks), float32; with AVX-512 four rows per key at once, their four sums reduced together.
inline void score_rows(const float* q, const float* k, int64_t ks, float* s, int64_t R,
                       int64_t n, int64_t D, float scale) {
  int64_t r = 0;
#if defined(__AVX512F__)
  const __m128 vscale = _mm_set1_ps(scale);
  const int64_t ahead = prefetch_rows(D);
  for (; r + 4 <= R; r += 4) {
    const float* q0 = q + r * D;
    for (int64_t j = 0; j < n; ++j) {
      const float* kr = k + j * ks;
      __m512 p[4] = {_mm512_setzero_ps(), _mm512_setzero_ps(), _mm512_setzero_ps(),
                     _mm512_setzero_ps()};
      for (int64_t d = 0; d < D; d += 16) {
        if (j + ahead < n) {
          _mm_prefetch(reinterpret_cast<const char*>(kr + ahead * ks + d), _MM_HINT_T0);
        }
        const __mmask16 m =
            static_cast<__mmask16>(D - d >= 16 ? 0xFFFFu : (1u << (D - d)) - 1u);
        const __m512 x = _mm512_maskz_loadu_ps(m, kr + d);
        for (int i = 0; i < 4; ++i) {
          p[i] = _mm512_fmadd_ps(_mm512_maskz_loadu_ps(m, q0 + i * D + d), x, p[i]);
        }
      }
      // four 16-lane sums at once: pairwise within 128-bit blocks, then the four blocks
      const __m512 a =
          _mm512_add_ps(_mm512_unpacklo_ps(p[0], p[1]), _mm512_unpackhi_ps(p[0], p[1]));
      const __m512 b =
          _mm512_add_ps(_mm512_unpacklo_ps(p[2], p[3]), _mm512_unpackhi_ps(p[2], p[3]));
      const __m512 c = _mm512_add_ps(_mm512_shuffle_ps(a, b, _MM_SHUFFLE(1, 0, 1, 0)),
                                     _mm512_shuffle_ps(a, b, _MM_SHUFFLE(3, 2, 3, 2)));
      const __m256 h = _mm256_add_ps(_mm512_castps512_ps256(c), _mm512_extractf32x8_ps(c, 1));
      const __m128 f = _mm_mul_ps(
          _mm_add_ps(_mm256_castps256_ps128(h), _mm256_extractf128_ps(h, 1)), vscale);
      alignas(16) float out[4];
      _mm_store_ps(out, f);
      for (int i = 0; i < 4; ++i) s[(r + i) * n + j] = out[i];
    }
  }
#endif
  for (; r < R; ++r) {
    for (int64_t j = 0; j < n; ++j) s[r * n + j] = dot(q + r * D, k + j * ks, D) * scale;
  }
}

// One (batch item, key/value head) of the decode step: its R = G·L query rows (the G heads that
// share the k/v head, L rows each) against its n keys. k and v rows are read in place (any row
// stride, unit stride inside a row), each once for all R rows: scores s = (q·k)·scale, then per
// row the softmax numerators e = exp(s − max) and out = (Σ e·v) / Σ e, all in C. A row with a
// non-finite logit is NaN (the rule `_attend`'s amin poison implements); an inf or NaN value
// reaches the rows that weigh it through the products, as in a matrix product.
// 1 / (the row's denominator with the attention sink s joined): e^{s − base} added to
// den = Σ_j e^{l_j − base}, rescaled to s when s > base (no overflow); NaN for a NaN/+inf s
// (the NaN rule: the row is NaN), 1/den for s = −inf (no sink).
template <typename C>
inline C sink_inverse(C den, C base, C s) {
  if (std::isnan(s) || s == std::numeric_limits<C>::infinity()) {
    return std::numeric_limits<C>::quiet_NaN();
  }
  if (s > base) {
    const C e = std::exp(base - s);
    return e / (den * e + C(1));
  }
  return C(1) / (den + std::exp(s - base));
}

template <typename T, typename C>
void decode_task(const T* const* qrow, const T* kp, int64_t ks, const T* vp, int64_t vs,
                 C* const* orow, int64_t R, int64_t n, int64_t D, int64_t Dv, C scale,
                 C softcap = C(0), const float* sinks = nullptr, int64_t L = 1) {
  std::vector<C> buf(R * D + R * n + 2 * R * Dv + D + Dv);
  C* qc = buf.data();  // (R, D)
  C* s = qc + R * D;  // (R, n)
  C* acc = s + R * n;  // (R, Dv)
  C* part = acc + R * Dv;  // (R, Dv): one block's partial sums of p·v
  C* kc = part + R * Dv;  // one key row (D)
  C* vc = kc + D;  // one value row (Dv)
  for (int64_t r = 0; r < R; ++r) {
    for (int64_t d = 0; d < D; ++d) qc[r * D + d] = static_cast<C>(qrow[r][d]);
  }
  if constexpr (std::is_same_v<T, float>) {
    score_rows(qc, kp, ks, s, R, n, D, scale);
  } else {
    for (int64_t j = 0; j < n; ++j) {
      const T* kr = kp + j * ks;
      for (int64_t d = 0; d < D; ++d) kc[d] = static_cast<C>(kr[d]);
      for (int64_t r = 0; r < R; ++r) s[r * n + j] = dot(qc + r * D, kc, D) * scale;
    }
  }
  std::vector<C> den(R), base_of(R);
  std::vector<uint8_t> poisoned(R);
  for (int64_t r = 0; r < R; ++r) {
    C* sr = s + r * n;
    auto [mx, finite] = max_finite(sr, n);
    poisoned[r] = !finite;  // read BEFORE capping: tanh maps ±inf to ±1
    if (softcap > C(0) && finite) {  // s ← cap·tanh(s / cap) (Gemma 2)
      const C inv = C(1) / softcap;
#pragma omp simd
      for (int64_t j = 0; j < n; ++j) sr[j] = softcap * attnlab_exp::tanh_f(sr[j] * inv);
      mx = max_finite(sr, n).first;
    }
    const C base = finite ? mx : C(0);
    base_of[r] = base;
    C sum = 0;
#pragma omp simd reduction(+ : sum)
    for (int64_t j = 0; j < n; ++j) {
      const C e = attnlab_exp::exp_neg(sr[j] - base);
      sr[j] = e;
      sum += e;
    }
    den[r] = sum;
  }
  if constexpr (std::is_same_v<T, float>) {
    weigh_values(s, n, vp, vs, acc, R, Dv, part);
  } else {
    auto widened = [&](int64_t j) {  // value row j in C (rows are visited once, in order)
      const T* vr = vp + j * vs;
      for (int64_t d = 0; d < Dv; ++d) vc[d] = static_cast<C>(vr[d]);
      return static_cast<const C*>(vc);
    };
    weigh_blocks(s, n, widened, acc, R, Dv, part);
  }
  for (int64_t r = 0; r < R; ++r) {
    const C inv = poisoned[r] ? std::numeric_limits<C>::quiet_NaN()
                  : sinks == nullptr ? C(1) / den[r]
                                     : sink_inverse(den[r], base_of[r], C(sinks[r / L]));
    const C* ar = acc + r * Dv;
    C* o = orow[r];
#pragma omp simd
    for (int64_t d = 0; d < Dv; ++d) o[d] = ar[d] * inv;
  }
}

// The maximal runs [a, b) of True in keys[0…n) (bool bytes), appended to `runs`.
inline void key_runs(const bool* keys, int64_t n, std::vector<std::pair<int64_t, int64_t>>& runs) {
  runs.clear();
  for (int64_t j = 0; j < n;) {
    while (j < n && !keys[j]) ++j;
    const int64_t a = j;
    while (j < n && keys[j]) ++j;
    if (j > a) runs.emplace_back(a, j);
  }
}

template <typename T, typename C>
void decode_impl(const at::Tensor& q, const at::Tensor& k, const at::Tensor& v, at::Tensor& out,
                 double scale, const at::Tensor* keys, double softcap = 0.0,
                 const float* sinks = nullptr) {
  const int64_t b = q.size(0), H = q.size(1), L = q.size(2), D = q.size(3);
  const int64_t Hk = k.size(1), n = k.size(2), Dv = v.size(3), G = H / Hk, R = G * L;
  const T* qp = q.const_data_ptr<T>();
  const T* kp = k.const_data_ptr<T>();
  const T* vp = v.const_data_ptr<T>();
  C* op = out.mutable_data_ptr<C>();
  const auto qs = q.strides(), ks = k.strides(), vs = v.strides();
  const bool* kb = keys ? keys->const_data_ptr<bool>() : nullptr;
  const int64_t kb0 = keys && keys->size(0) > 1 ? keys->stride(0) : 0;
  // one task per (item, k/v head); tasks of a few thousand multiply-adds stay on one thread
  const int64_t work = std::max<int64_t>(1, R * n * (D + Dv));
  const int64_t grain = std::max<int64_t>(1, (int64_t{1} << 17) / work);
  at::parallel_for(0, b * Hk, grain, [&](int64_t lo, int64_t hi) {
    std::vector<const T*> qrow(R);
    std::vector<C*> orow(R);
    std::vector<std::pair<int64_t, int64_t>> runs;
    std::vector<T> kg, vg;  // the attended rows gathered, when they are not one run
    for (int64_t t = lo; t < hi; ++t) {
      const int64_t i = t / Hk, hk = t % Hk;
      for (int64_t g = 0; g < G; ++g) {
        const int64_t h = hk * G + g;
        for (int64_t l = 0; l < L; ++l) {
          qrow[g * L + l] = qp + i * qs[0] + h * qs[1] + l * qs[2];
          orow[g * L + l] = op + ((i * H + h) * L + l) * Dv;
        }
      }
      const T* kt = kp + i * ks[0] + hk * ks[1];
      const T* vt = vp + i * vs[0] + hk * vs[1];
      int64_t kst = ks[2], vst = vs[2], m = n;
      if (kb) {  // only the attended keys are read: the others never reach a row
        key_runs(kb + i * kb0, n, runs);
        if (runs.empty()) {  // a row that may attend nothing is zeros (the rule)
          for (int64_t r = 0; r < R; ++r) std::fill(orow[r], orow[r] + Dv, C(0));
          continue;
        }
        if (runs.size() == 1) {
          kt += runs[0].first * kst;
          vt += runs[0].first * vst;
          m = runs[0].second - runs[0].first;
        } else {
          m = 0;
          for (const auto& [a, e] : runs) m += e - a;
          kg.resize(m * D);
          vg.resize(m * Dv);
          int64_t row = 0;
          for (const auto& [a, e] : runs) {
            for (int64_t j = a; j < e; ++j, ++row) {
              std::copy_n(kt + j * kst, D, kg.data() + row * D);
              std::copy_n(vt + j * vst, Dv, vg.data() + row * Dv);
            }
          }
          kt = kg.data(), vt = vg.data(), kst = D, vst = Dv;
        }
      }
      decode_task<T, C>(qrow.data(), kt, kst, vt, vst, orow.data(), R, m, D, Dv,
                        static_cast<C>(scale), static_cast<C>(softcap),
                        sinks == nullptr ? nullptr : sinks + hk * G, L);
    }
  });
}

at::Tensor decode_attend(const at::Tensor& q_, const at::Tensor& k_, const at::Tensor& v_,
                         double scale, const std::optional<at::Tensor>& keys_, double softcap,
                         const std::optional<at::Tensor>& sinks_) {
  TORCH_CHECK(q_.dim() == 4 && k_.dim() == 4 && v_.dim() == 4, "decode_attend: 4-D q, k, v");
  TORCH_CHECK(softcap >= 0.0, "decode_attend: softcap must be >= 0 (0: none), got ", softcap);
  TORCH_CHECK(k_.size(1) > 0 && q_.size(1) % k_.size(1) == 0, "decode_attend: H % H_kv != 0");
  TORCH_CHECK(q_.scalar_type() == k_.scalar_type() && q_.scalar_type() == v_.scalar_type(),
              "decode_attend: q, k, v of one dtype");
  at::Tensor keys;
  if (keys_.has_value()) {
    keys = keys_->contiguous();
    TORCH_CHECK(keys.scalar_type() == at::kBool && keys.dim() == 2 &&
                    keys.size(1) == k_.size(2) &&
                    (keys.size(0) == 1 || keys.size(0) == q_.size(0)),
                "decode_attend: keys must be a bool (B or 1, S) tensor");
  }
  const float* sinks = nullptr;
  if (sinks_.has_value()) {
    const at::Tensor& t = *sinks_;
    TORCH_CHECK(t.scalar_type() == at::kFloat && t.dim() == 1 && t.size(0) == q_.size(1) &&
                    t.device().is_cpu() && (t.stride(0) == 1 || t.size(0) <= 1),
                "decode_attend: sinks must be a unit-stride float32 CPU tensor of shape (",
                q_.size(1), ",), got ", t.scalar_type(), " of shape ", t.sizes());
    sinks = t.const_data_ptr<float>();
  }
  const at::Tensor q = unit_last(q_), k = unit_last(k_), v = unit_last(v_);
  const auto c = q.scalar_type() == at::kDouble ? at::kDouble : at::kFloat;
  const auto opts = q.options().dtype(c);
  if (k.size(2) == 0) return at::zeros({q.size(0), q.size(1), q.size(2), v.size(3)}, opts);
  at::Tensor out = at::empty({q.size(0), q.size(1), q.size(2), v.size(3)}, opts);
  if (out.numel() == 0) return out;
  ATTNLAB_DISPATCH(q.scalar_type(), "decode_attend", {
    using compute_t = std::conditional_t<std::is_same_v<scalar_t, double>, double, float>;
    decode_impl<scalar_t, compute_t>(q, k, v, out, scale, keys_.has_value() ? &keys : nullptr,
                                     softcap, sinks);
  });
  return out;  // in the compute dtype, as `_attend`
}

// One row, unit strides, rotate-half: a vectorisable loop per half, then the unrotated tail.
template <typename T, typename C>
inline void rotate_half_row(const T* __restrict xa, const C* __restrict cc,
                            const C* __restrict sc, T* __restrict o, int64_t P, int64_t R,
                            int64_t D) {
  const T* __restrict xb = xa + P;
  for (int64_t i = 0; i < P; ++i) {
    const C a = static_cast<C>(xa[i]), b = static_cast<C>(xb[i]);
    const C ac = a * cc[i], bs = b * sc[i];
    o[i] = static_cast<T>(ac - bs);
  }
  for (int64_t i = 0; i < P; ++i) {
    const C a = static_cast<C>(xa[i]), b = static_cast<C>(xb[i]);
    const C bc = b * cc[i], as = a * sc[i];
    o[P + i] = static_cast<T>(bc + as);
  }
  for (int64_t d = R; d < D; ++d) o[d] = xa[d];
}

// RoPE of the rows of x (B, n_heads, n, D) at positions start…start+n-1 from tables cos/sin
// (N, R/2) of dtype C, into a new contiguous tensor of x's dtype: per pair (a, b) of the first R
// dims, (a·c − b·s, b·c + a·s) computed in C (x converted to C exactly, each product and sum
// rounded in C, the result rounded to x's dtype), the other dims copied. These are the values of
// RoPE.forward's tensor ops (mul, mul, sub / add, cat or stack, .to) in one pass; the library
// is compiled with -ffp-contract=off, so no product is fused into the subtraction.
template <typename T, typename C>
void rope_rows_impl(const at::Tensor& x, const at::Tensor& cos, const at::Tensor& sin,
                    at::Tensor& out, int64_t start, int64_t R, bool interleaved) {
  const int64_t B = x.size(0), N = x.size(1), n = x.size(2), D = x.size(3), P = R / 2;
  const auto xs = x.strides();
  const T* xp = x.const_data_ptr<T>();
  T* op = out.mutable_data_ptr<T>();
  const C* cp = cos.const_data_ptr<C>();
  const C* sp = sin.const_data_ptr<C>();
  const int64_t cs0 = cos.stride(0), cs1 = cos.stride(1), ss0 = sin.stride(0), ss1 = sin.stride(1);
  const int64_t ia = interleaved ? 2 : 1, ib = interleaved ? 2 : 1;
  const int64_t oa = 0, ob = interleaved ? 1 : P;
  const bool contiguous = !interleaved && xs[3] == 1 && cs1 == 1 && ss1 == 1;
  // rows are split by (b, head) so that no row index is divided (64-bit division per row
  // costs more than the row's arithmetic at D = 32)
  const int64_t grain = std::max<int64_t>(1, 16384 / std::max<int64_t>(1, n * D));
  at::parallel_for(0, B * N, grain, [&](int64_t lo, int64_t hi) {
    for (int64_t bh = lo; bh < hi; ++bh) {
      const int64_t b = bh / N, h = bh % N;
      for (int64_t l = 0; l < n; ++l) {
        const T* xr = xp + b * xs[0] + h * xs[1] + l * xs[2];
        T* orow = op + (bh * n + l) * D;
        const C* c = cp + (start + l) * cs0;
        const C* s = sp + (start + l) * ss0;
        if (contiguous) {
          rotate_half_row<T, C>(xr, c, s, orow, P, R, D);
          continue;
        }
        for (int64_t i = 0; i < P; ++i) {
          const C a = static_cast<C>(xr[(oa + i * ia) * xs[3]]);
          const C bb = static_cast<C>(xr[(ob + i * ib) * xs[3]]);
          const C ci = c[i * cs1], si = s[i * ss1];
          const C ac = a * ci, bs = bb * si, bc = bb * ci, as = a * si;
          orow[oa + i * ia] = static_cast<T>(ac - bs);
          orow[ob + i * ib] = static_cast<T>(bc + as);
        }
        for (int64_t d = R; d < D; ++d) orow[d] = xr[d * xs[3]];
      }
    }
  });
}

at::Tensor rope_rows(const at::Tensor& x, const at::Tensor& cos, const at::Tensor& sin,
                     int64_t start, int64_t R, bool interleaved) {
  at::Tensor out = at::empty(x.sizes(), x.options().memory_format(at::MemoryFormat::Contiguous));
  if (out.numel() == 0) return out;
  if (cos.scalar_type() == at::kDouble) {
    TORCH_CHECK(x.scalar_type() == at::kDouble, "rope_decode_attend: float64 tables for float64");
    rope_rows_impl<double, double>(x, cos, sin, out, start, R, interleaved);
    return out;
  }
  TORCH_CHECK(cos.scalar_type() == at::kFloat && x.scalar_type() != at::kDouble,
              "rope_decode_attend: float32 tables (float64 for float64 inputs)");
  ATTNLAB_DISPATCH(x.scalar_type(), "rope_decode_attend", {
    rope_rows_impl<scalar_t, float>(x, cos, sin, out, start, R, interleaved);
  });
  return out;
}

at::Tensor rope_decode_attend(const at::Tensor& q, const at::Tensor& k, const at::Tensor& v,
                              const at::Tensor& cos, const at::Tensor& sin, int64_t q_start,
                              int64_t k_start, bool rotate_keys, int64_t rotary_dim,
                              bool interleaved, double scale) {
  TORCH_CHECK(q.dim() == 4 && k.dim() == 4 && v.dim() == 4, "rope_decode_attend: 4-D q, k, v");
  const int64_t R = rotary_dim;
  TORCH_CHECK(R >= 2 && R % 2 == 0 && R <= q.size(3) && k.size(3) == q.size(3),
              "rope_decode_attend: an even rotary_dim <= D expected");
  TORCH_CHECK(cos.dim() == 2 && sin.sizes() == cos.sizes() && cos.size(1) == R / 2 &&
                  sin.scalar_type() == cos.scalar_type() && cos.is_floating_point(),
              "rope_decode_attend: cos and sin must be float (N, rotary_dim/2) tables");
  TORCH_CHECK(q_start >= 0 && q_start + q.size(2) <= cos.size(0) &&
                  (!rotate_keys || (k_start >= 0 && k_start + k.size(2) <= cos.size(0))),
              "rope_decode_attend: positions outside the tables");
  const at::Tensor qr = rope_rows(q, cos, sin, q_start, R, interleaved);
  const at::Tensor kr = rotate_keys ? rope_rows(k, cos, sin, k_start, R, interleaved) : k;
  return decode_attend(qr, kr, v, scale, std::nullopt, 0.0, std::nullopt);
}

at::Tensor rope_rows_op(const at::Tensor& x, const at::Tensor& cos, const at::Tensor& sin,
                        int64_t start, int64_t rotary_dim, bool interleaved) {
  const int64_t R = rotary_dim;
  TORCH_CHECK(x.dim() == 4 && R >= 2 && R % 2 == 0 && R <= x.size(3),
              "rope_rows: 4-D x and an even rotary_dim <= D expected");
  TORCH_CHECK(cos.dim() == 2 && sin.sizes() == cos.sizes() && cos.size(1) == R / 2 &&
                  sin.scalar_type() == cos.scalar_type(),
              "rope_rows: cos and sin must be (N, rotary_dim/2) tables");
  TORCH_CHECK(start >= 0 && start + x.size(2) <= cos.size(0), "rope_rows: positions outside");
  return rope_rows(x, cos, sin, start, R, interleaved);
}

// One row at a time (rows of E contiguous values): the sum of squares in C (float32, float64
// for float64), r = 1/sqrt(sum/E + eps), y = (x·r)·w with x·r rounded to T first.
template <typename T, typename C>
void rms_norm_impl(const at::Tensor& x, const at::Tensor& w, double eps, at::Tensor& out) {
  const int64_t E = x.size(-1), rows = x.numel() / E;
  const T* xp = x.const_data_ptr<T>();
  const T* wp = w.const_data_ptr<T>();
  T* op = out.mutable_data_ptr<T>();
  const C ce = static_cast<C>(eps), n = static_cast<C>(E);
  // a few rows (a decode step) stay on the calling thread
  const int64_t grain = std::max<int64_t>(1, 65536 / std::max<int64_t>(1, E));
  at::parallel_for(0, rows, grain, [&](int64_t lo, int64_t hi) {
    for (int64_t r = lo; r < hi; ++r) {
      const T* xr = xp + r * E;
      T* orow = op + r * E;
      C ss = 0;
#pragma omp simd reduction(+ : ss)
      for (int64_t e = 0; e < E; ++e) ss += static_cast<C>(xr[e]) * static_cast<C>(xr[e]);
      const C inv = C(1) / std::sqrt(ss / n + ce);
#pragma omp simd
      for (int64_t e = 0; e < E; ++e) {
        const T y = static_cast<T>(static_cast<C>(xr[e]) * inv);
        orow[e] = static_cast<T>(static_cast<C>(y) * static_cast<C>(wp[e]));
      }
    }
  });
}

at::Tensor rms_norm(const at::Tensor& x_, const at::Tensor& w, double eps) {
  TORCH_CHECK(x_.dim() >= 1 && w.dim() == 1 && w.size(0) == x_.size(-1),
              "rms_norm: weight must be (E,) with E the last dim of x");
  TORCH_CHECK(w.scalar_type() == x_.scalar_type(), "rms_norm: x and weight must share a dtype");
  const at::Tensor x = x_.contiguous();
  const at::Tensor wc = w.contiguous();
  at::Tensor out = at::empty(x.sizes(), x.options());
  if (out.numel() == 0) return out;
  ATTNLAB_DISPATCH(x.scalar_type(), "rms_norm", {
    using C = std::conditional_t<std::is_same_v<scalar_t, double>, double, float>;
    rms_norm_impl<scalar_t, C>(x, wc, eps, out);
  });
  return out;
}

}  // namespace

TORCH_LIBRARY(attnlab_nan, m) {
  m.def("poison_prefix_(Tensor(a!) out, Tensor q, Tensor k, Tensor v, Tensor hi, "
        "Tensor(b!)? lse=None) -> ()");
  m.def("sdpa_prefix(Tensor q, Tensor k, Tensor v, Tensor? attn_mask, Tensor hi, float scale, "
        "bool is_causal, bool enable_gqa, bool clean_k) -> Tensor");
  m.def(
      "decode_attend(Tensor q, Tensor k, Tensor v, float scale, Tensor? keys=None, "
      "float softcap=0.0, Tensor? sinks=None) -> Tensor");
  m.def("rope_decode_attend(Tensor q, Tensor k, Tensor v, Tensor cos, Tensor sin, int q_start, "
        "int k_start, bool rotate_keys, int rotary_dim, bool interleaved, float scale) -> Tensor");
  m.def("rope_rows(Tensor x, Tensor cos, Tensor sin, int start, int rotary_dim, bool interleaved) "
        "-> Tensor");
  m.def("rms_norm(Tensor x, Tensor weight, float eps) -> Tensor");
}

TORCH_LIBRARY_IMPL(attnlab_nan, CPU, m) {
  m.impl("poison_prefix_", &poison_prefix_);
  m.impl("sdpa_prefix", &sdpa_prefix);
  m.impl("decode_attend", &decode_attend);
  m.impl("rope_decode_attend", &rope_decode_attend);
  m.impl("rope_rows", &rope_rows_op);
  m.impl("rms_norm", &rms_norm);
}
