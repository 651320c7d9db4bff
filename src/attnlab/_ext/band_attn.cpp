// Batched band calls (sliding windows) and batched segments (packed documents) of the flash
// backend, each as one CPU operator (see attnlab/functional/flash/band.py and band_kernel.py).
//
//   attnlab_band::forward_into(out!, lse!, q, k, v, add, r0, nblk, bq, k_start, width, limit,
//                              scale, check=False, widen=False, softcap=0.0, keys=None,
//                              sinks=None) -> seen
//       q (H, L, D), k (H_kv, S, D), v (H_kv, S, Dv): one batch item, unit stride in the last
//       dim; query block t (0 <= t < nblk) holds rows r0 + t·bq … + bq and sees the keys
//       [k_start + t·bq, … + width) that lie in [0, limit) (edge windows are clipped: columns
//       outside are masked; limit <= S) and, with keys (bool (S,): a key mask, padding), that
//       it keeps (blocks whose window holds none of its run skip both products). add
//       (A0, A1, bq, width) float32 with
//       A0 in {1, nblk} and A1 in {1, H}: the additive tile (mask as −inf, plus any bias).
//       Writes out (nblk, H, bq, Dv) in q's dtype (or float32: bfloat16/float16 calls whose
//       partial outputs are merged) and lse (nblk, H, bq) float32 (any strides, e.g. views of the
//       whole output):
//           out = softmax(q·kᵀ·scale + add) v,   lse = log Σ exp(q·kᵀ·scale + add);
//       a row whose every key is masked gets out = 0, lse = −inf. softcap > 0 (both forward
//       operators): the logits q·kᵀ·scale become softcap·tanh(q·kᵀ·scale / softcap) before add
//       (Gemma 2's soft-capping; forward only: the backward operators have no tanh stage).
//       check: also test every q, k, v entry the call reads (the q rows of its blocks, the keys
//       and values of its windows) for NaN/±inf: seen is then a 1-element tensor if one was
//       found (out and lse are not meaningful), else empty (numel 0; also when not checking),
//       so the caller branches on shape, as on `attnlab_flash::clean_copy`.
//   attnlab_band::segments_into(out!, lse!, q, k, v, start, n, count, causal, bq, scale,
//                               widen=False, softcap=0.0, keys=None, sinks=None)
//       q, k, v as above; segment s (0 <= s < count) holds rows and keys [start + s·n, … + n):
//       its rows attend all its keys, or (causal) the keys up to their own position — of those,
//       with keys (bool (S,): a key mask, padding), only the keys j with keys[j]. Writes the
//       segments' rows of out (H, L, Dv) and lse (H, L) float32 (other rows untouched), in
//       query blocks of bq rows: out = softmax(q·kᵀ·scale) v, lse = log Σ exp(q·kᵀ·scale); a
//       row left without keys gets out = 0, lse = −inf. A key mask costs only the columns from
//       each segment's first attended key to its last (`KeyRuns`).
//       sinks (both forward operators; float32 (H,), GPT-OSS's attention sinks): head h's logit
//       s_h joins each of its rows' denominators where the row is finalised (`finish_row`):
//       out = Σ_j e^{l_j} v_j / (e^{s_h} + Σ_j e^{l_j}), lse = log(e^{s_h} + Σ_j e^{l_j}); a
//       row without keys gets out = 0, lse = s_h; a NaN/+inf s_h makes the rows with a key NaN.
//       The backward operators are exact on these out and lse (the sink-inclusive weights).
//   attnlab_band::backward_into(dq!, dk!, dv!, q, k, v, out, dout, lse, add, r0, nblk, bq,
//                               k_start, width, limit, scale, own_delta=False, keys=None,
//                               delta=None)
//   attnlab_band::segments_backward_into(dq!, dk!, dv!, q, k, v, out, dout, lse, start, n,
//                                        count, causal, bq, scale, keys=None, delta=None)
//       The backward of the two calls, added into float32 dq, dk, dv: every product in float32
//       (float16 and bfloat16 q, k, v, dout widened as they are packed), out float32 (segments:
//       or q's dtype), lse float32 (+inf on rows without a key). own_delta: the band call holds
//       every key of its rows, so δ is Σ P·dP of each row rather than rowsum(dout ⊙ out).
//       delta: (H, L) float32, or None: the rows the call computes get their δ (0 without a
//       key; the other rows untouched), what the gradient of attention sinks reads.
//   attnlab_band::supported(dtype) -> bool: whether this CPU runs the operator in that dtype
//       (oneDNN's brgemm micro-kernel in float32, wherever it exists: float16 is widened to
//       float32 as it is packed, and so is bfloat16 unless its own products run); the caller
//       falls back to torch's flash kernel otherwise.
//   attnlab_band::segment_span() -> int: score columns a segment block holds at once (longer
//       rows run in spans of that many, merged online).
//   attnlab_band::native(dtype) -> bool: whether the forward multiplies in that dtype itself:
//       float32, and bfloat16 (in VNNI pairs: an even head dim and block) on CPUs with
//       AVX512-BF16 or AMX. Elsewhere, or with widen=True, a bfloat16 forward widens its inputs
//       to float32 as it packs them (exact; the same float32 products as float16).
//
// Why it is faster than torch's fused kernel on these calls: every block holds ALL its keys, so
// the softmax is one pass (no running rescale); each key is packed once per thread (the windows
// of neighbouring blocks overlap, torch's kernel repacks them per block), band calls as their
// blocks reach it, into a buffer that stays in cache (`BandStream`), segment calls per head; both
// products run on oneDNN's batch-reduce GEMM micro-kernel (brgemm) with float32 accumulation
// (bfloat16 inputs in VNNI pairs), the same micro-kernel torch's kernel uses on AMX CPUs.
#include <ATen/ATen.h>
#include <ATen/Parallel.h>
#include <ATen/native/CPUBlas.h>
#include <sys/mman.h>
#include <unistd.h>
#include <torch/library.h>

#include "nonfinite.h"
#include "vexp.h"

#if defined(__AVX512F__) || (defined(__AVX2__) && defined(__FMA__))
#include <immintrin.h>
#endif
#if !defined(__AVX512F__) && defined(__AVX2__) && defined(__FMA__)
#define ATTNLAB_AVX2 1  // the 8-lane loops of CPUs with AVX2 and FMA but no AVX-512
#endif

#include <algorithm>
#include <array>
#include <atomic>
#include <cmath>
#include <cstdint>
#include <cstdlib>
#include <cstring>
#include <limits>
#include <memory>
#include <mutex>
#include <new>
#include <optional>
#include <type_traits>
#include <vector>

namespace {

using at::native::cpublas::brgemm;
using at::native::cpublas::brgemm_release;

constexpr float kNegInf = -std::numeric_limits<float>::infinity();

using attnlab_exp::bits;
using attnlab_exp::exp_neg;
using attnlab_exp::from_bits;

inline uint16_t to_bf16(float f) {  // round to nearest even (inputs are finite)
  const uint32_t u = bits(f);
  return static_cast<uint16_t>((u + 0x7FFFu + ((u >> 16) & 1u)) >> 16);
}

// Per input dtype T: the dtype C both products multiply in (float16 is widened to float32 as it
// is packed: float32 products run at the fp16 matmul rate on CPUs with AVX512-FP16 and no
// AMX-FP16, and far above torch's float16 kernel elsewhere), whether B of p·v is packed (bfloat16
// VNNI pairs; float16 widened rows; float32 values are read in place) and the rounding of a
// float32 result to T.
template <typename T>
struct Traits;

template <>
struct Traits<float> {
  using C = float;
  static constexpr bool vnni = false;
  static constexpr bool packs_values = false;
  static float store(float f) { return f; }
};

template <>
struct Traits<c10::BFloat16> {
  using C = c10::BFloat16;
  static constexpr bool vnni = true;
  static constexpr bool packs_values = true;
  static c10::BFloat16 store(float f) {
    return c10::BFloat16(to_bf16(f), c10::BFloat16::from_bits());
  }
};

template <>
struct Traits<c10::Half> {
  using C = float;
  static constexpr bool vnni = false;
  static constexpr bool packs_values = true;
  static c10::Half store(float f) { return c10::Half(f); }  // round to nearest even
};

// bfloat16 read as float32: the bits of c10::BFloat16, widened as they are packed (the band
// backward's products run in float32 for every input dtype).
struct WideBF16 {
  uint16_t x;
  operator float() const { return from_bits(static_cast<uint32_t>(x) << 16); }
};

template <>
struct Traits<WideBF16> {
  using C = float;
  static constexpr bool vnni = false;
  static constexpr bool packs_values = true;
  static WideBF16 store(float f) { return WideBF16{to_bf16(f)}; }
};

// Whether T is multiplied as a wider C (float16, WideBF16 as float32).
template <typename T>
constexpr bool kWidens = !std::is_same_v<T, typename Traits<T>::C>;

}  // namespace

namespace attnlab_bits {
template <>
struct Bits<WideBF16> : Bits<c10::BFloat16> {};
}  // namespace attnlab_bits

namespace {

// 64-byte aligned scratch (AMX tile loads and stores run at a third of their speed when rows
// straddle cache lines: brgemm 16 × 272 × 64 in bfloat16, 2.9 → 1.2 µs for both products).
template <typename T>
class Buffer {
 public:
  explicit Buffer(size_t n) : p_(nullptr, &std::free) {
    const size_t bytes = (std::max<size_t>(n, 1) * sizeof(T) + 63) / 64 * 64;
    p_.reset(static_cast<T*>(std::aligned_alloc(64, bytes)));
    if (!p_) throw std::bad_alloc();
  }
  T* get() const { return p_.get(); }

 private:
  std::unique_ptr<T, void (*)(void*)> p_;
};

// Scores per row of a block that sees `width` keys: whole 16-lane vectors; in bfloat16 whole
// 32-key steps of the AMX/VNNI product p·v (a K remainder costs the micro-kernel a second,
// slower kernel: 16 × 64 × 272 took 1.3 µs, × 288 0.3 µs), the extra columns masked.
inline int64_t score_cols(int64_t width, bool bf16) {
  const int64_t a = bf16 ? 32 : 16;
  return (width + a - 1) / a * a;
}

// `softmax_row` (below) in plain C++ for CPUs without AVX-512: exp_neg in 16-lane loops.
template <bool HasAdd, typename P>
inline std::pair<float, float> softmax_row_portable(float* sr, const float* ad, int64_t ws,
                                                    int64_t c_lo, int64_t c_hi, float scale,
                                                    P* pr) {
  float mv[16];
  for (int c = 0; c < 16; ++c) mv[c] = kNegInf;
  for (int64_t c0 = 0; c0 < ws; c0 += 16) {
#pragma omp simd
    for (int c = 0; c < 16; ++c) {
      const int64_t col = c0 + c;
      const float y = HasAdd ? std::fma(sr[col], scale, ad[col]) : sr[col] * scale;
      const float x = col >= c_lo && col < c_hi ? y : kNegInf;
      sr[col] = x;
      mv[c] = std::max(mv[c], x);
    }
  }
  float mx = kNegInf;
  for (int c = 0; c < 16; ++c) mx = std::max(mx, mv[c]);
  const float base = mx == kNegInf ? 0.0f : mx;
  float sv[16] = {};
  for (int64_t c0 = 0; c0 < ws; c0 += 16) {
#pragma omp simd
    for (int c = 0; c < 16; ++c) {
      const float e = exp_neg(sr[c0 + c] - base);
      pr[c0 + c] = Traits<P>::store(e);
      sv[c] += e;
    }
  }
  float sum = 0.0f;
  for (int c = 0; c < 16; ++c) sum += sv[c];
  return {mx, sum};
}

#if defined(__AVX512F__)
// 2^t on 16 lanes: 2ⁿ·poly(t − n) with n = round(t) and a fit of 2^f on [−½, ½] (relative
// error 7.9e-8 in degree 6 for float32 numerators — the backward recomputes them from the lse,
// so they must be as exact as exp_neg's — and 2.6e-6 in degree 4 for numerators rounded to
// bfloat16, whose step is 2⁻⁸): 12–14 vector operations per 16 scores where exp_neg takes 17;
// exactly 0 below 2⁻¹²⁶ and for −inf (a masked key weighs nothing).
template <typename P>
inline __m512 exp2_16(__m512 t) {
  const __mmask16 live = _mm512_cmp_ps_mask(t, _mm512_set1_ps(-126.0f), _CMP_GE_OQ);
  const __m512 n = _mm512_roundscale_ps(t, _MM_FROUND_TO_NEAREST_INT | _MM_FROUND_NO_EXC);
  const __m512 f = _mm512_sub_ps(t, n);
  __m512 p;
  if constexpr (std::is_same_v<P, float>) {  // p(0) = 1 exactly: a lone key weighs 1
    p = _mm512_fmadd_ps(_mm512_set1_ps(0.0001535335904918611f), f,
                        _mm512_set1_ps(0.0013398875016719103f));
    p = _mm512_fmadd_ps(p, f, _mm512_set1_ps(0.00961843691766262f));
    p = _mm512_fmadd_ps(p, f, _mm512_set1_ps(0.055503323674201965f));
    p = _mm512_fmadd_ps(p, f, _mm512_set1_ps(0.24022647738456726f));
    p = _mm512_fmadd_ps(p, f, _mm512_set1_ps(0.6931471824645996f));
    p = _mm512_fmadd_ps(p, f, _mm512_set1_ps(1.0f));
  } else {
    p = _mm512_fmadd_ps(_mm512_set1_ps(0.009570094756782055f), f,
                        _mm512_set1_ps(0.05591785907745361f));
    p = _mm512_fmadd_ps(p, f, _mm512_set1_ps(0.240247443318367f));
    p = _mm512_fmadd_ps(p, f, _mm512_set1_ps(0.6931217908859253f));
    p = _mm512_fmadd_ps(p, f, _mm512_set1_ps(0.9999992847442627f));
  }
  return _mm512_maskz_scalef_ps(live, p, n);
}

inline void store16(float* p, __m512 e) { _mm512_storeu_ps(p, e); }

inline void store16(c10::Half* p, __m512 e) {  // round to nearest even on 16 lanes
  _mm256_storeu_si256(reinterpret_cast<__m256i*>(p),
                      _mm512_cvtps_ph(e, _MM_FROUND_TO_NEAREST_INT | _MM_FROUND_NO_EXC));
}

inline void store16(c10::BFloat16* p, __m512 e);

inline void store16(WideBF16* p, __m512 e) {  // the bits of c10::BFloat16
  store16(reinterpret_cast<c10::BFloat16*>(p), e);
}

inline void store16(c10::BFloat16* p, __m512 e) {  // to_bf16 on 16 lanes
#if defined(__AVX512BF16__)
  // one instruction (round to nearest even; numerators below 2⁻¹²⁶ become 0)
  _mm256_storeu_si256(reinterpret_cast<__m256i*>(p), (__m256i)_mm512_cvtneps_pbh(e));
#else
  const __m512i u = _mm512_castps_si512(e);
  const __m512i odd = _mm512_and_si512(_mm512_srli_epi32(u, 16), _mm512_set1_epi32(1));
  const __m512i r = _mm512_srli_epi32(
      _mm512_add_epi32(_mm512_add_epi32(u, _mm512_set1_epi32(0x7FFF)), odd), 16);
  _mm256_storeu_si256(reinterpret_cast<__m256i*>(p), _mm512_cvtepi32_epi16(r));
#endif
}
#endif

#if defined(ATTNLAB_AVX2)
// exp2_16's float32 fit on 8 lanes: 2ⁿ is built in the exponent bits (n >= −126 where t is
// live), 0 below 2⁻¹²⁶ and for −inf.
inline __m256 exp2_8(__m256 t) {
  const __m256 live = _mm256_cmp_ps(t, _mm256_set1_ps(-126.0f), _CMP_GE_OQ);
  const __m256 n = _mm256_round_ps(t, _MM_FROUND_TO_NEAREST_INT | _MM_FROUND_NO_EXC);
  const __m256 f = _mm256_sub_ps(t, n);
  __m256 p = _mm256_fmadd_ps(_mm256_set1_ps(0.0001535335904918611f), f,
                             _mm256_set1_ps(0.0013398875016719103f));
  p = _mm256_fmadd_ps(p, f, _mm256_set1_ps(0.00961843691766262f));
  p = _mm256_fmadd_ps(p, f, _mm256_set1_ps(0.055503323674201965f));
  p = _mm256_fmadd_ps(p, f, _mm256_set1_ps(0.24022647738456726f));
  p = _mm256_fmadd_ps(p, f, _mm256_set1_ps(0.6931471824645996f));
  p = _mm256_fmadd_ps(p, f, _mm256_set1_ps(1.0f));
  const __m256i e = _mm256_slli_epi32(
      _mm256_add_epi32(_mm256_cvtps_epi32(n), _mm256_set1_epi32(127)), 23);
  return _mm256_and_ps(live, _mm256_mul_ps(p, _mm256_castsi256_ps(e)));
}

inline float hmax8(__m256 v) {
  __m128 m = _mm_max_ps(_mm256_castps256_ps128(v), _mm256_extractf128_ps(v, 1));
  m = _mm_max_ps(m, _mm_movehl_ps(m, m));
  return _mm_cvtss_f32(_mm_max_ss(m, _mm_movehdup_ps(m)));
}

inline float hsum8(__m256 v) {
  __m128 m = _mm_add_ps(_mm256_castps256_ps128(v), _mm256_extractf128_ps(v, 1));
  m = _mm_add_ps(m, _mm_movehl_ps(m, m));
  return _mm_cvtss_f32(_mm_add_ss(m, _mm_movehdup_ps(m)));
}

// `softmax_row` with float32 numerators on 8 lanes (as the AVX-512 loop; the portable loop
// compiles to scalar exps here: window 256, L = 16384 on an AVX2 EPYC, 40 % of the call).
template <bool HasAdd>
inline std::pair<float, float> softmax_row_avx2(float* sr, const float* ad, int64_t ws,
                                                int64_t c_lo, int64_t c_hi, float scale,
                                                float* pr) {
  const __m256 vscale = _mm256_set1_ps(scale), ninf = _mm256_set1_ps(kNegInf);
  const __m256i lane = _mm256_setr_epi32(0, 1, 2, 3, 4, 5, 6, 7);
  const __m256i lo = _mm256_set1_epi32(static_cast<int32_t>(c_lo) - 1);
  const __m256i hi = _mm256_set1_epi32(static_cast<int32_t>(c_hi));
  __m256 mv = ninf;
  for (int64_t c0 = 0; c0 < ws; c0 += 8) {
    const __m256 y = _mm256_loadu_ps(sr + c0);
    __m256 x = HasAdd ? _mm256_fmadd_ps(y, vscale, _mm256_loadu_ps(ad + c0))
                      : _mm256_mul_ps(y, vscale);
    if (c0 < c_lo || c0 + 8 > c_hi) {  // lo < col + 1 and col < hi
      const __m256i col = _mm256_add_epi32(lane, _mm256_set1_epi32(static_cast<int32_t>(c0)));
      const __m256i in =
          _mm256_and_si256(_mm256_cmpgt_epi32(col, lo), _mm256_cmpgt_epi32(hi, col));
      x = _mm256_blendv_ps(ninf, x, _mm256_castsi256_ps(in));
    }
    _mm256_storeu_ps(sr + c0, x);
    mv = _mm256_max_ps(mv, x);
  }
  const float mx = hmax8(mv);
  const __m256 log2e = _mm256_set1_ps(1.44269504088896341f);
  const __m256 base = _mm256_set1_ps(mx == kNegInf ? 0.0f : mx);
  __m256 sv = _mm256_setzero_ps();
  for (int64_t c0 = 0; c0 < ws; c0 += 8) {  // (x − max)·log₂e: the difference first
    const __m256 e = exp2_8(_mm256_mul_ps(_mm256_sub_ps(_mm256_loadu_ps(sr + c0), base), log2e));
    sv = _mm256_add_ps(sv, e);
    _mm256_storeu_ps(pr + c0, e);
  }
  return {mx, hsum8(sv)};
}
#endif

// One row of ws scores (ws a multiple of 16) turned into softmax numerators, written to pr in
// P (float: pr may be sr itself; bfloat16: rounded for p·v): x = s·scale + add on the columns
// [c_lo, c_hi) (add may be null: no additive tile), −inf on the others; the row runs in whole
// 16-lane vectors (no scalar remainder). Returns (max, Σ exp(x − max)) of the unrounded
// numerators; max = −inf when no column is a key (the numerators are then all 0).
template <bool HasAdd, typename P>
inline std::pair<float, float> softmax_row(float* sr, const float* ad, int64_t ws, int64_t c_lo,
                                           int64_t c_hi, float scale, P* pr) {
#if defined(__AVX512F__)
  // in explicit 512-bit vectors: compilers split the mixed float/bfloat16 loop into halves
  // (window 256, L = 16384, bfloat16 on a Xeon with AMX: ~30 % of the kernel's time)
  const __m512 vscale = _mm512_set1_ps(scale), ninf = _mm512_set1_ps(kNegInf);
  const __m512i lane = _mm512_setr_epi32(0, 1, 2, 3, 4, 5, 6, 7, 8, 9, 10, 11, 12, 13, 14, 15);
  const __m512i lo = _mm512_set1_epi32(static_cast<int32_t>(c_lo));
  const __m512i hi = _mm512_set1_epi32(static_cast<int32_t>(c_hi));
  __m512 mv = ninf;
  for (int64_t c0 = 0; c0 < ws; c0 += 16) {
    const __m512 y = _mm512_loadu_ps(sr + c0);
    __m512 x = HasAdd ? _mm512_fmadd_ps(y, vscale, _mm512_loadu_ps(ad + c0))
                      : _mm512_mul_ps(y, vscale);
    if (c0 < c_lo || c0 + 16 > c_hi) {
      const __m512i col = _mm512_add_epi32(lane, _mm512_set1_epi32(static_cast<int32_t>(c0)));
      const __mmask16 in =
          _mm512_cmpge_epi32_mask(col, lo) & _mm512_cmplt_epi32_mask(col, hi);
      x = _mm512_mask_blend_ps(in, ninf, x);
    }
    _mm512_storeu_ps(sr + c0, x);
    mv = _mm512_max_ps(mv, x);
  }
  const float mx = _mm512_reduce_max_ps(mv);
  const float bs = mx == kNegInf ? 0.0f : mx;
  __m512 sv = _mm512_setzero_ps();
  // t = (x − max)·log₂e: the difference first (exact near the max), so huge logits stay exact
  // (a fused x·log₂e − max·log₂e is off by ulp(max·log₂e): thousands at |max| ~ 1e10)
  const __m512 log2e = _mm512_set1_ps(1.44269504088896341f);
  const __m512 base = _mm512_set1_ps(bs);
  for (int64_t c0 = 0; c0 < ws; c0 += 16) {
    const __m512 t = _mm512_mul_ps(_mm512_sub_ps(_mm512_loadu_ps(sr + c0), base), log2e);
    const __m512 e = exp2_16<P>(t);
    sv = _mm512_add_ps(sv, e);
    store16(pr + c0, e);
  }
  return {mx, _mm512_reduce_add_ps(sv)};
#else
#if defined(ATTNLAB_AVX2)
  if constexpr (std::is_same_v<P, float>) {
    return softmax_row_avx2<HasAdd>(sr, ad, ws, c_lo, c_hi, scale, pr);
  }
#endif
  return softmax_row_portable<HasAdd>(sr, ad, ws, c_lo, c_hi, scale, pr);
#endif
}

// Logit soft-capping of one row of n raw scores in place: s ← cap·tanh(s·scale/cap) (Gemma 2;
// `reference.softcap_logits`), before the additive tile and the mask; `softmax_row` then runs
// with scale 1. tanh(x) is x + x·z·P(z), z = x², for |x| < 0.625 (Cephes' float fit, ~1 ulp)
// and sign(x)·(1 − 2/(e^{2|x|} + 1)) above, |x| clamped to 9 (tanh(9) rounds to 1).
inline float tanh_scalar(float x) { return std::tanh(x); }

#if defined(__AVX512F__)
inline __m512 tanh16(__m512 x) {
  const __m512 ax = _mm512_min_ps(_mm512_abs_ps(x), _mm512_set1_ps(9.0f));
  const __m512 z = _mm512_mul_ps(x, x);
  __m512 p = _mm512_fmadd_ps(_mm512_set1_ps(-5.70498872745e-3f), z,
                             _mm512_set1_ps(2.06390887954e-2f));
  p = _mm512_fmadd_ps(p, z, _mm512_set1_ps(-5.37397155531e-2f));
  p = _mm512_fmadd_ps(p, z, _mm512_set1_ps(1.33314422036e-1f));
  p = _mm512_fmadd_ps(p, z, _mm512_set1_ps(-3.33332819422e-1f));
  const __m512 small = _mm512_fmadd_ps(_mm512_mul_ps(x, z), p, x);
  const __m512 e = exp2_16<float>(_mm512_mul_ps(ax, _mm512_set1_ps(2.88539008177792681f)));
  const __m512 one = _mm512_set1_ps(1.0f);
  const __m512 big = _mm512_sub_ps(one, _mm512_div_ps(_mm512_set1_ps(2.0f), _mm512_add_ps(e, one)));
  // sign of x onto the large branch
  const __m512 sign = _mm512_castsi512_ps(
      _mm512_and_si512(_mm512_castps_si512(x), _mm512_set1_epi32(static_cast<int>(0x80000000u))));
  const __m512 large = _mm512_castsi512_ps(
      _mm512_or_si512(_mm512_castps_si512(big), _mm512_castps_si512(sign)));
  const __mmask16 is_small = _mm512_cmp_ps_mask(ax, _mm512_set1_ps(0.625f), _CMP_LT_OQ);
  return _mm512_mask_blend_ps(is_small, large, small);
}
#endif

#if defined(ATTNLAB_AVX2)
inline __m256 tanh8(__m256 x) {
  const __m256 signbit = _mm256_set1_ps(-0.0f);
  const __m256 ax = _mm256_min_ps(_mm256_andnot_ps(signbit, x), _mm256_set1_ps(9.0f));
  const __m256 z = _mm256_mul_ps(x, x);
  __m256 p = _mm256_fmadd_ps(_mm256_set1_ps(-5.70498872745e-3f), z,
                             _mm256_set1_ps(2.06390887954e-2f));
  p = _mm256_fmadd_ps(p, z, _mm256_set1_ps(-5.37397155531e-2f));
  p = _mm256_fmadd_ps(p, z, _mm256_set1_ps(1.33314422036e-1f));
  p = _mm256_fmadd_ps(p, z, _mm256_set1_ps(-3.33332819422e-1f));
  const __m256 small = _mm256_fmadd_ps(_mm256_mul_ps(x, z), p, x);
  const __m256 e = exp2_8(_mm256_mul_ps(ax, _mm256_set1_ps(2.88539008177792681f)));
  const __m256 one = _mm256_set1_ps(1.0f);
  const __m256 big = _mm256_sub_ps(one, _mm256_div_ps(_mm256_set1_ps(2.0f), _mm256_add_ps(e, one)));
  const __m256 large = _mm256_or_ps(big, _mm256_and_ps(x, signbit));
  const __m256 is_small = _mm256_cmp_ps(ax, _mm256_set1_ps(0.625f), _CMP_LT_OQ);
  return _mm256_blendv_ps(large, small, is_small);
}
#endif

inline void cap_scores(float* s, int64_t n, float scale, float cap) {
  const float a = scale / cap;
  int64_t c = 0;
#if defined(__AVX512F__)
  const __m512 va = _mm512_set1_ps(a), vc = _mm512_set1_ps(cap);
  for (; c + 16 <= n; c += 16) {
    _mm512_storeu_ps(s + c, _mm512_mul_ps(vc, tanh16(_mm512_mul_ps(_mm512_loadu_ps(s + c), va))));
  }
#elif defined(ATTNLAB_AVX2)
  const __m256 va = _mm256_set1_ps(a), vc = _mm256_set1_ps(cap);
  for (; c + 8 <= n; c += 8) {
    _mm256_storeu_ps(s + c, _mm256_mul_ps(vc, tanh8(_mm256_mul_ps(_mm256_loadu_ps(s + c), va))));
  }
#endif
  for (; c < n; ++c) s[c] = cap * tanh_scalar(s[c] * a);
}

// Writes one output row (the unnormalized p·v row ``src`` divided by the denominator) and its
// log-sum-exp; a row without keys (max −inf) gets 0 and −inf.
//
// With an attention sink ``sink`` (the row's head's logit, GPT-OSS; −inf: none) the sink joins
// the row's denominator where it is finalised: with m' = max(mx, sink),
//     out = src·e^{mx − m'} / (den·e^{mx − m'} + e^{sink − m'}),
//     lse = m' + log(den·e^{mx − m'} + e^{sink − m'})  (= logaddexp(lse, sink)),
// so the output and lse are those of the softmax over the keys and the sink. A row without
// keys keeps 0 and gets lse = sink. A NaN or +inf sink (the NaN rule) makes a row with a key
// NaN (output and lse); a row without keys keeps 0 and gets lse = sink.
template <typename T>
inline void finish_row(T* orow, float* lrow, const float* src, int64_t Dv, float mx, float den,
                       float sink = kNegInf) {
  const bool dead = mx == kNegInf;
  float inv = dead ? 0.0f : 1.0f / den;
  float lse_row = dead ? sink : mx + std::log(den);
  if (!dead && sink != kNegInf) {
    if (std::isnan(sink) || sink == -kNegInf) {  // the NaN rule: the row is NaN
      inv = std::numeric_limits<float>::quiet_NaN();
      lse_row = inv;
    } else if (sink > mx) {  // rescale to the sink (no overflow of e^{sink − mx})
      const float e = std::exp(mx - sink), x = den * e;  // the keys' share, over the sink's
      inv = e / (x + 1.0f);
      lse_row = sink + std::log1p(x);  // (log(1 + x) would lose x's digits when x is small)
    } else {
      const float d = den + std::exp(sink - mx);
      inv = 1.0f / d;
      lse_row = mx + std::log(d);
    }
  }
  int64_t c = 0;
#if defined(__AVX512F__)
  const __m512 vinv = _mm512_set1_ps(inv);
  for (; c + 16 <= Dv; c += 16) store16(orow + c, _mm512_mul_ps(_mm512_loadu_ps(src + c), vinv));
#endif
  for (; c < Dv; ++c) orow[c] = Traits<T>::store(src[c] * inv);
  *lrow = lse_row;
}

#if defined(__AVX512BW__)
// Lanes of T in the 512 bits of x that are NaN or ±inf (exponent bits all ones), as a mask.
template <typename T>
inline uint64_t nonfinite_lanes(__m512i x) {
  using U = typename attnlab_bits::Bits<T>::U;
  constexpr U E = attnlab_bits::Bits<T>::kExp;
  if constexpr (sizeof(T) == 2) {
    const __m512i e = _mm512_set1_epi16(static_cast<int16_t>(E));
    return _mm512_cmpeq_epi16_mask(_mm512_and_si512(x, e), e);
  } else {
    const __m512i e = _mm512_set1_epi32(static_cast<int32_t>(E));
    return _mm512_cmpeq_epi32_mask(_mm512_and_si512(x, e), e);
  }
}
#endif

#if defined(ATTNLAB_AVX2)
// Transposes an 8 × 8 block of 32-bit words: dst[d][j] = src[j][d].
inline void transpose8(const uint32_t* src, int64_t lds, uint32_t* dst, int64_t ldd) {
  __m256 r[8], t[8];
  for (int i = 0; i < 8; ++i) r[i] = _mm256_loadu_ps(reinterpret_cast<const float*>(src + i * lds));
  for (int i = 0; i < 8; i += 2) {
    t[i] = _mm256_unpacklo_ps(r[i], r[i + 1]);
    t[i + 1] = _mm256_unpackhi_ps(r[i], r[i + 1]);
  }
  for (int i = 0; i < 8; i += 4) {
    r[i] = _mm256_shuffle_ps(t[i], t[i + 2], _MM_SHUFFLE(1, 0, 1, 0));
    r[i + 1] = _mm256_shuffle_ps(t[i], t[i + 2], _MM_SHUFFLE(3, 2, 3, 2));
    r[i + 2] = _mm256_shuffle_ps(t[i + 1], t[i + 3], _MM_SHUFFLE(1, 0, 1, 0));
    r[i + 3] = _mm256_shuffle_ps(t[i + 1], t[i + 3], _MM_SHUFFLE(3, 2, 3, 2));
  }
  for (int i = 0; i < 4; ++i) {
    t[i] = _mm256_permute2f128_ps(r[i], r[i + 4], 0x20);
    t[i + 4] = _mm256_permute2f128_ps(r[i], r[i + 4], 0x31);
  }
  for (int i = 0; i < 8; ++i) _mm256_storeu_ps(reinterpret_cast<float*>(dst + i * ldd), t[i]);
}
#endif

// Packs the keys [k0, k0 + n) of one head as B of q·kᵀ: float32 (D, n_pad) row-major; bfloat16
// VNNI pairs (D/2, n_pad, 2). Columns n..n_pad are zero.
// Transposes a 16 × 16 block of 32-bit words: dst[d][j] = src[j][d]. With `bad` (AVX-512BW),
// also tests the words' values of T for NaN/±inf while they are in registers (a find sets it).
template <typename T>
inline void transpose16(const uint32_t* src, int64_t lds, uint32_t* dst, int64_t ldd,
                        bool* bad) {
#if defined(__AVX512F__)
  __m512 r[16], t[16];
  for (int i = 0; i < 16; ++i) r[i] = _mm512_loadu_ps(reinterpret_cast<const float*>(src + i * lds));
#if defined(__AVX512BW__)
  if (bad != nullptr) {
    uint64_t m = 0;
    for (int i = 0; i < 16; ++i) m |= nonfinite_lanes<T>(_mm512_castps_si512(r[i]));
    if (m != 0) *bad = true;
  }
#else
  if (bad != nullptr) {
    for (int i = 0; i < 16; ++i) {
      if (attnlab_bits::span_bad(reinterpret_cast<const T*>(src + i * lds), 64 / sizeof(T))) {
        *bad = true;
      }
    }
  }
#endif
  for (int i = 0; i < 16; i += 2) {
    t[i] = _mm512_unpacklo_ps(r[i], r[i + 1]);
    t[i + 1] = _mm512_unpackhi_ps(r[i], r[i + 1]);
  }
  for (int i = 0; i < 16; i += 4) {
    r[i] = _mm512_shuffle_ps(t[i], t[i + 2], _MM_SHUFFLE(1, 0, 1, 0));
    r[i + 1] = _mm512_shuffle_ps(t[i], t[i + 2], _MM_SHUFFLE(3, 2, 3, 2));
    r[i + 2] = _mm512_shuffle_ps(t[i + 1], t[i + 3], _MM_SHUFFLE(1, 0, 1, 0));
    r[i + 3] = _mm512_shuffle_ps(t[i + 1], t[i + 3], _MM_SHUFFLE(3, 2, 3, 2));
  }
  for (int h = 0; h < 16; h += 8) {
    for (int i = 0; i < 4; ++i) {
      t[h + i] = _mm512_shuffle_f32x4(r[h + i], r[h + i + 4], 0x88);
      t[h + i + 4] = _mm512_shuffle_f32x4(r[h + i], r[h + i + 4], 0xdd);
    }
  }
  for (int i = 0; i < 8; ++i) {
    r[i] = _mm512_shuffle_f32x4(t[i], t[i + 8], 0x88);
    r[i + 8] = _mm512_shuffle_f32x4(t[i], t[i + 8], 0xdd);
  }
  for (int i = 0; i < 16; ++i) _mm512_storeu_ps(reinterpret_cast<float*>(dst + i * ldd), r[i]);
#else
  for (int j = 0; j < 16 && bad != nullptr; ++j) {
    if (attnlab_bits::span_bad(reinterpret_cast<const T*>(src + j * lds), 64 / sizeof(T))) {
      *bad = true;
    }
  }
#if defined(ATTNLAB_AVX2)
  for (int j = 0; j < 16; j += 8) {
    for (int d = 0; d < 16; d += 8) transpose8(src + j * lds + d, lds, dst + d * ldd + j, ldd);
  }
#else
  for (int d = 0; d < 16; ++d) {
    for (int j = 0; j < 16; ++j) dst[d * ldd + j] = src[j * lds + d];
  }
#endif
#endif
}

// Packed columns [j_lo, j_hi) of one head's keys as B of q·kᵀ (row stride ld): column j holds
// key k0 + j when v_lo <= j < v_hi, else zeros; float32 (D, ld) row-major, bfloat16 VNNI pairs
// (D/2, ld, 2). ``k`` points at key 0; column j is written at position j − col0. With `bad`,
// every key packed is also tested for NaN/±inf (a find sets *bad).
template <typename T>
void pack_keys(const T* k, int64_t ks, int64_t D, int64_t k0, int64_t v_lo, int64_t v_hi,
               int64_t j_lo, int64_t j_hi, int64_t ld, T* out, bool* bad, int64_t col0 = 0) {
  constexpr int64_t per = 4 / sizeof(T);  // bf16: a pair (d, d+1) of one key is one word
  static_assert(sizeof(T) * per == 4, "32-bit words");
  const int64_t Dw = D / per, ksw = ks / per;
  const auto* kw = reinterpret_cast<const uint32_t*>(k);
  auto* o = reinterpret_cast<uint32_t*>(out);
  const bool fast = ks % per == 0 && reinterpret_cast<uintptr_t>(k) % 4 == 0;
  uint32_t tile[16][16];
  for (int64_t j0 = j_lo; j0 < j_hi; j0 += 16) {
    const int64_t nj = std::min<int64_t>(16, j_hi - j0);
    for (int64_t d0 = 0; d0 < Dw; d0 += 16) {
      const int64_t nd = std::min<int64_t>(16, Dw - d0);
      if (fast && nj == 16 && nd == 16 && j0 >= v_lo && j0 + 16 <= v_hi) {
        transpose16<T>(kw + (k0 + j0) * ksw + d0, ksw, o + d0 * ld + j0 - col0, ld, bad);
        continue;
      }
      for (int64_t j = 0; j < nj; ++j) {
        if (j0 + j >= v_lo && j0 + j < v_hi) {
          const T* row = k + (k0 + j0 + j) * ks + d0 * per;
          if (bad != nullptr && attnlab_bits::span_bad(row, nd * per)) *bad = true;
          std::memcpy(tile[j], row, nd * 4);
        } else {
          std::memset(tile[j], 0, nd * 4);
        }
      }
      for (int64_t d = 0; d < nd; ++d) {
        uint32_t* row = o + (d0 + d) * ld + j0 - col0;
        for (int64_t j = 0; j < nj; ++j) row[j] = tile[j][d];
      }
    }
  }
}

// Packed rows [j_lo, j_hi) (j_lo even) of one head's values as B of p·v: bfloat16 VNNI pairs
// (·, Dv, 2), row j = value k0 + j when v_lo <= j < v_hi, else zeros (float32 values are read
// in place). ``v`` points at value 0; row j is written at position j − row0 (even). With `bad`,
// every value packed is also tested for NaN/±inf (a find sets *bad).
void pack_values(const c10::BFloat16* v, int64_t vs, int64_t Dv, int64_t k0, int64_t v_lo,
                 int64_t v_hi, int64_t j_lo, int64_t j_hi, c10::BFloat16* out, bool* bad,
                 int64_t row0 = 0) {
  const c10::BFloat16 zero(0.0f);
  auto row = [&](int64_t j) { return j >= v_lo && j < v_hi ? v + (k0 + j) * vs : nullptr; };
#if defined(__AVX512BW__)
  // interleave 32 columns of two rows: word 2c of the lower half takes a[c], 2c + 1 takes b[c]
  // (index 32 + c); the upper half the same for c + 16
  static const std::array<uint16_t, 64> kPairs = [] {
    std::array<uint16_t, 64> t{};
    for (uint16_t c = 0; c < 16; ++c) {
      t[2 * c] = c;
      t[2 * c + 1] = 32 + c;
      t[32 + 2 * c] = 16 + c;
      t[32 + 2 * c + 1] = 48 + c;
    }
    return t;
  }();
  const __m512i lo_half = _mm512_loadu_si512(kPairs.data());
  const __m512i hi_half = _mm512_loadu_si512(kPairs.data() + 32);
  uint64_t found = 0;  // non-finite lanes seen (with `bad`)
#endif
  for (int64_t j = j_lo; j < j_hi; j += 2) {
    const c10::BFloat16* a = row(j);
    const c10::BFloat16* b = row(j + 1);
    c10::BFloat16* o = out + (j - row0) * Dv;
    int64_t c = 0;
#if defined(__AVX512BW__)
    for (; a && b && c + 32 <= Dv; c += 32) {
      const __m512i x = _mm512_loadu_si512(a + c), y = _mm512_loadu_si512(b + c);
      if (bad != nullptr) {
        found |= nonfinite_lanes<c10::BFloat16>(x) | nonfinite_lanes<c10::BFloat16>(y);
      }
      _mm512_storeu_si512(o + 2 * c, _mm512_permutex2var_epi16(x, lo_half, y));
      _mm512_storeu_si512(o + 2 * c + 32, _mm512_permutex2var_epi16(x, hi_half, y));
    }
#endif
    if (bad != nullptr && c < Dv) {  // the columns the vector loop left (or a lone row)
      const bool bad_a = a && attnlab_bits::span_bad(a + c, Dv - c);
      if (bad_a || (b && attnlab_bits::span_bad(b + c, Dv - c))) *bad = true;
    }
    for (; c < Dv; ++c) {
      o[2 * c] = a ? a[c] : zero;
      o[2 * c + 1] = b ? b[c] : zero;
    }
  }
#if defined(__AVX512BW__)
  if (found != 0) *bad = true;
#endif
}

// n float16 values widened to float32 (exactly: every float16 is a float32).
inline void widen_row(const c10::Half* a, int64_t n, float* o) {
  int64_t c = 0;
#if defined(__AVX512F__)
  for (; c + 16 <= n; c += 16) {
    _mm512_storeu_ps(o + c, _mm512_cvtph_ps(_mm256_loadu_si256(
                                reinterpret_cast<const __m256i*>(a + c))));
  }
#elif defined(ATTNLAB_AVX2) && defined(__F16C__)
  for (; c + 8 <= n; c += 8) {
    _mm256_storeu_ps(o + c, _mm256_cvtph_ps(_mm_loadu_si128(
                                reinterpret_cast<const __m128i*>(a + c))));
  }
#endif
  for (; c < n; ++c) o[c] = static_cast<float>(a[c]);
}

// n bfloat16 values widened to float32 (exactly: the bits shifted into the upper half).
inline void widen_row(const WideBF16* a, int64_t n, float* o) {
  int64_t c = 0;
#if defined(__AVX512F__)
  for (; c + 16 <= n; c += 16) {
    const __m512i u =
        _mm512_cvtepu16_epi32(_mm256_loadu_si256(reinterpret_cast<const __m256i*>(a + c)));
    _mm512_storeu_ps(o + c, _mm512_castsi512_ps(_mm512_slli_epi32(u, 16)));
  }
#elif defined(ATTNLAB_AVX2)
  for (; c + 8 <= n; c += 8) {
    const __m256i u =
        _mm256_cvtepu16_epi32(_mm_loadu_si128(reinterpret_cast<const __m128i*>(a + c)));
    _mm256_storeu_ps(o + c, _mm256_castsi256_ps(_mm256_slli_epi32(u, 16)));
  }
#endif
  for (; c < n; ++c) o[c] = static_cast<float>(a[c]);
}

// `pack_keys` for float16 (or WideBF16) keys, widened to float32 (D, ld) as they are packed: 16
// keys × 16 dims at a time are widened into a tile and transposed (the NaN/±inf test, with
// `bad`, runs on the widened registers: widening keeps them).
template <typename T>
void pack_keys_wide(const T* k, int64_t ks, int64_t D, int64_t k0, int64_t v_lo,
                    int64_t v_hi, int64_t j_lo, int64_t j_hi, int64_t ld, float* out, bool* bad,
                    int64_t col0) {
  alignas(64) float tile[16][16];
  for (int64_t j0 = j_lo; j0 < j_hi; j0 += 16) {
    const int64_t nj = std::min<int64_t>(16, j_hi - j0);
    for (int64_t d0 = 0; d0 < D; d0 += 16) {
      const int64_t nd = std::min<int64_t>(16, D - d0);
      for (int64_t j = 0; j < 16; ++j) {
        if (j < nj && j0 + j >= v_lo && j0 + j < v_hi) {
          widen_row(k + (k0 + j0 + j) * ks + d0, nd, tile[j]);
          std::fill(tile[j] + nd, tile[j] + 16, 0.0f);
        } else {
          std::fill(tile[j], tile[j] + 16, 0.0f);
        }
      }
      float* o = out + d0 * ld + j0 - col0;
      if (nj == 16 && nd == 16) {
        transpose16<float>(reinterpret_cast<const uint32_t*>(tile), 16,
                           reinterpret_cast<uint32_t*>(o), ld, bad);
        continue;
      }
      for (int64_t j = 0; j < nj && bad != nullptr; ++j) {
        if (attnlab_bits::span_bad(tile[j], nd)) *bad = true;
      }
      for (int64_t d = 0; d < nd; ++d) {
        for (int64_t j = 0; j < nj; ++j) o[d * ld + j] = tile[j][d];
      }
    }
  }
}

// Rows [j_lo, j_hi) of one head's float16 (or WideBF16) values widened to float32 rows (·, Dv):
// row j = value k0 + j when v_lo <= j < v_hi, else zeros, written at position j − row0. With
// `bad`, every value packed is also tested for NaN/±inf (a find sets *bad).
template <typename T>
void pack_values_wide(const T* v, int64_t vs, int64_t Dv, int64_t k0, int64_t v_lo,
                      int64_t v_hi, int64_t j_lo, int64_t j_hi, float* out, bool* bad,
                      int64_t row0) {
  for (int64_t j = j_lo; j < j_hi; ++j) {
    float* o = out + (j - row0) * Dv;
    if (j < v_lo || j >= v_hi) {
      std::fill(o, o + Dv, 0.0f);
      continue;
    }
    const T* a = v + (k0 + j) * vs;
    if (bad != nullptr && attnlab_bits::span_bad(a, Dv)) *bad = true;
    widen_row(a, Dv, o);
  }
}

// Packs columns [j_lo, j_hi) of one key head for both products: its keys as B of q·kᵀ into
// kout (row stride ld; `pack_keys`, float16 widened: `pack_keys_wide`) and, where p·v reads
// packed values (bfloat16 VNNI pairs, float16 widened rows), its value rows [j_lo, min(j_hi,
// v_end)) into vout; column/row j is written at position j − at. Float32 values are read in
// place (with `bad` only tested here). With `bad`, every key and value packed is tested for
// NaN/±inf (a find sets *bad).
template <typename T, typename C = typename Traits<T>::C>
void pack_span(const T* keys, int64_t ks, const T* values, int64_t vs, int64_t D, int64_t Dv,
               int64_t k0, int64_t v_lo, int64_t v_hi, int64_t j_lo, int64_t j_hi, int64_t v_end,
               int64_t ld, C* kout, C* vout, bool* bad, int64_t at) {
  const int64_t vj_hi = std::min(j_hi, v_end);
  if constexpr (kWidens<T>) {
    pack_keys_wide(keys, ks, D, k0, v_lo, v_hi, j_lo, j_hi, ld, kout, bad, at);
    if (j_lo < vj_hi) pack_values_wide(values, vs, Dv, k0, v_lo, v_hi, j_lo, vj_hi, vout, bad, at);
  } else {
    pack_keys<T>(keys, ks, D, k0, v_lo, v_hi, j_lo, j_hi, ld, kout, bad, at);
    if constexpr (Traits<T>::vnni) {
      if (j_lo < vj_hi) pack_values(values, vs, Dv, k0, v_lo, v_hi, j_lo, vj_hi, vout, bad, at);
    } else if (bad != nullptr) {
      for (int64_t j = std::max(j_lo, v_lo); j < std::min(j_hi, v_hi); ++j) {
        if (attnlab_bits::span_bad(values + (k0 + j) * vs, Dv)) *bad = true;
      }
    }
  }
}

// Pointers and strides of one batch item's q (H, L, D), k (H_kv, S, D) and v (H_kv, S, Dv).
template <typename T>
struct Heads {
  const T* q;
  const T* k;
  const T* v;
  int64_t qh, qs, kh, ks, vh, vs;
  Heads(const at::Tensor& q_, const at::Tensor& k_, const at::Tensor& v_)
      : q(static_cast<const T*>(q_.const_data_ptr())),
        k(static_cast<const T*>(k_.const_data_ptr())),
        v(static_cast<const T*>(v_.const_data_ptr())),
        qh(q_.stride(0)),
        qs(q_.stride(1)),
        kh(k_.stride(0)),
        ks(k_.stride(1)),
        vh(v_.stride(0)),
        vs(v_.stride(1)) {}
  const T* values(int64_t hk) const { return v + hk * vh; }  // value 0 of key head hk
};

// Packs key head hk for both products, in parallel chunks of 512 columns (`pack_span`): its keys'
// columns [0, ldk) (key k0 + j where v_lo <= j < v_hi, else zeros) and, where p·v reads packed
// values, its values' rows [0, nv). With `bad`, each chunk's keys and values are also tested for
// NaN/±inf while they are in cache; a find sets *bad.
template <typename T, typename C = typename Traits<T>::C>
void pack_head(const Heads<T>& in, int64_t hk, int64_t D, int64_t Dv, int64_t k0, int64_t v_lo,
               int64_t v_hi, int64_t ldk, int64_t nv, C* kpack, C* vpack, std::atomic<bool>* bad) {
  constexpr int64_t kChunk = 512;
  at::parallel_for(0, (ldk + kChunk - 1) / kChunk, 1, [&](int64_t c0, int64_t c1) {
    const int64_t j_lo = c0 * kChunk, j_hi = std::min(ldk, c1 * kChunk);
    bool found = false;
    pack_span<T>(in.k + hk * in.kh, in.ks, in.values(hk), in.vs, D, Dv, k0, v_lo, v_hi, j_lo,
                 j_hi, nv, ldk, kpack, vpack, bad != nullptr ? &found : nullptr, 0);
    if (found) bad->store(true, std::memory_order_relaxed);
  });
}

// Per-thread scratch of both operators (C: the dtype of the products): scores s (float32),
// numerators p (bfloat16 only), the unnormalized output o, a block's query rows widened to C
// (float16 only) and each row's max m and denominator den.
template <typename C>
struct Scratch {
  Buffer<float> s_buf;
  Buffer<C> p_buf;
  Buffer<float> o_buf;
  Buffer<C> q_buf;
  float* s;
  C* p;
  float* o;
  C* q;
  std::vector<float> m, den;
  Scratch(size_t ns, size_t np, size_t no, size_t rows, size_t nq)
      : s_buf(ns), p_buf(np), o_buf(no), q_buf(nq), s(s_buf.get()), p(p_buf.get()),
        o(o_buf.get()), q(q_buf.get()), m(rows), den(rows) {}
};

// A of q·kᵀ for `rows` query rows from qb (row stride qs) and its row stride: the rows in place,
// or (float16) widened into `buf` (row stride D).
template <typename T, typename C = typename Traits<T>::C>
inline std::pair<const C*, int64_t> query_rows(const T* qb, int64_t qs, int64_t rows, int64_t D,
                                               C* buf) {
  if constexpr (kWidens<T>) {
    for (int64_t r = 0; r < rows; ++r) widen_row(qb + r * qs, D, buf + r * D);
    return {buf, D};
  } else {
    return {qb, qs};
  }
}

// Runs one batch item's segment work: for each key head, `pack_head` packs it (all threads; keys
// k0 + j for v_lo <= j < v_hi into ldk columns, bfloat16 values into nv rows) and
// `run(hk, kpack, vpack, i0, i1, scratch)` runs its work items [i0, i1) split between the
// threads. (Whole heads per thread, one parallel region per call, measured the same: window
// 256, L = 16384 on a Xeon with AMX, 17.1 vs 17.1 ms bfloat16, 51.2 vs 51.3 ms float32.)
template <typename T, typename Run>
void run_heads(const Heads<T>& in, int64_t Hkv, int64_t D, int64_t Dv, int64_t k0, int64_t v_lo,
               int64_t v_hi, int64_t ldk, int64_t nv, std::atomic<bool>* bad, int64_t items,
               const size_t (&scratch)[5], const Run& run) {
  using C = typename Traits<T>::C;
  const Buffer<C> kpack(static_cast<size_t>(D * ldk));
  const Buffer<C> vpack(Traits<T>::packs_values ? static_cast<size_t>(nv * Dv) : 0);
  for (int64_t hk = 0; hk < Hkv; ++hk) {
    pack_head<T>(in, hk, D, Dv, k0, v_lo, v_hi, ldk, nv, kpack.get(), vpack.get(), bad);
    at::parallel_for(0, items, 1, [&](int64_t i0, int64_t i1) {
      Scratch<C> sc(scratch[0], scratch[1], scratch[2], scratch[3], scratch[4]);
      run(hk, kpack.get(), vpack.get(), i0, i1, sc);
      brgemm_release(Traits<T>::vnni);
    });
  }
}

// Prefetches rows [lo, hi) of `row_bytes` bytes each (`stride` elements apart) into cache.
template <typename T>
inline void prefetch_rows(const T* base, int64_t stride, int64_t lo, int64_t hi,
                          int64_t row_bytes) {
  for (int64_t r = lo; r < hi; ++r) {
    const char* p = reinterpret_cast<const char*>(base + r * stride);
    for (int64_t b = 0; b < row_bytes; b += 64) __builtin_prefetch(p + b, 0, 2);
  }
}

// What a key mask (one bool per key of the batch item: padding) leaves of each segment of a
// call: the run [lo, hi) from its first attended key to one past its last (segment-relative;
// lo = hi when it has none) and, when some run has holes, an additive row over the call's
// columns — 0 where a key may be attended, −inf elsewhere and past the call (a block's padded
// score columns read it). Without a key mask every segment is the run [0, n), without holes.
// Blocks then compute only the columns from the run's first key (rounded down to 32: whole
// VNNI pairs and vectors) to their last one: a left-padded row costs its real keys only.
// Scores of masked keys inside a run to −inf: s[c] += hole[key0 + c] on columns [lo, hi) (hole:
// 0 for a kept key, −inf for a masked one; the scores are finite, so kept ones are unchanged).
inline void mask_holes(float* s, const float* hole, int64_t key0, int64_t lo, int64_t hi) {
#pragma omp simd
  for (int64_t c = lo; c < hi; ++c) s[c] += hole[key0 + c];
}

struct KeyRuns {
  std::vector<int64_t> lo, hi;
  std::vector<float> add;  // count·n + 64 columns, or empty: no run has holes
  int64_t n = 0;

  KeyRuns(const bool* keys, int64_t start, int64_t n_, int64_t count)
      : lo(count, 0), hi(count, n_), n(n_) {
    if (keys == nullptr) return;
    bool holes = false;
    for (int64_t s = 0; s < count; ++s) {
      const bool* ks = keys + start + s * n;
      int64_t a = 0, b = n, on = 0;
      while (a < n && !ks[a]) ++a;
      while (b > a && !ks[b - 1]) --b;
      for (int64_t j = a; j < b; ++j) on += ks[j];
      lo[s] = a;
      hi[s] = b;
      holes = holes || on < b - a;
    }
    if (!holes) return;
    add.assign(static_cast<size_t>(count * n + 64), kNegInf);
    for (int64_t j = 0; j < count * n; ++j) add[j] = keys[start + j] ? 0.0f : kNegInf;
  }
  // the additive row of segment s from its column c on (null: no holes)
  const float* row(int64_t s, int64_t c) const {
    return add.empty() ? nullptr : add.data() + s * n + c;
  }
  // the first column a block of segment s computes: its first key, rounded down to 32
  int64_t first(int64_t s) const { return lo[s] / 32 * 32; }
  // one past the last key of rows [p0, p1) of segment s (causal: up to the last row)
  int64_t end(int64_t s, bool causal, int64_t p1) const {
    return causal ? std::min(p1, hi[s]) : hi[s];
  }
};

// One thread's packed keys (and packed values: bfloat16, float16) of one key head for the band's
// columns
// [base, end), filled as its blocks advance: a block needs the columns [t·bq, t·bq + ws), of
// which all but its last bq were packed for the blocks before it. The buffer (cap columns)
// stays in the core's cache, and the head's keys and values are read from memory in step with
// the computation instead of in a pass of their own (which memory bandwidth bounds: window
// 256, L = 16384, bfloat16 on a Xeon with AMX, a fifth of the call); when the next columns would
// not fit, the still-needed ones move to the front.
template <typename T>
class BandStream {
  using C = typename Traits<T>::C;

 public:
  BandStream(const Heads<T>& in, int64_t D, int64_t Dv, int64_t k0, int64_t v_lo, int64_t v_hi,
             int64_t cap)
      : in_(in), D_(D), Dv_(Dv), k0_(k0), v_lo_(v_lo), v_hi_(v_hi), cap_(cap),
        ld_(cap + 16),  // off a power of two (rows of a window would share cache sets)
        keys_(static_cast<size_t>(D * ld_)),
        values_(Traits<T>::packs_values ? static_cast<size_t>(cap * Dv) : 0) {}

  // Packs what columns [lo, hi) of key head hk still need (lo a multiple of 16, hi − lo <= cap);
  // with `bad`, the keys and values it packs are tested for NaN/±inf (a find sets *bad).
  void cover(int64_t hk, int64_t lo, int64_t hi, bool* bad) {
    if (hk != hk_ || lo < base_ || lo > end_) {
      hk_ = hk;
      base_ = end_ = lo;
    }
    if (hi - base_ > cap_) slide(lo);
    if (hi <= end_) return;
    const T* keys = in_.k + hk * in_.kh;
    pack_span<T>(keys, in_.ks, in_.values(hk), in_.vs, D_, Dv_, k0_, v_lo_, v_hi_, end_, hi, hi,
                 ld_, keys_.get(), values_.get(), bad, base_);
    // the keys and values of the next columns (as many as these), on their way into cache
    // while the blocks compute: the next cover packs from cache, not from memory
    const int64_t n_lo = std::max(hi, v_lo_), n_hi = std::min(hi + (hi - end_), v_hi_);
    prefetch_rows(keys, in_.ks, k0_ + n_lo, k0_ + n_hi, D_ * static_cast<int64_t>(sizeof(T)));
    prefetch_rows(in_.values(hk), in_.vs, k0_ + n_lo, k0_ + n_hi,
                  Dv_ * static_cast<int64_t>(sizeof(T)));
    end_ = hi;
  }

  // B of q·kᵀ for the columns from c on (row stride ld()); B of p·v for the value rows from c on
  const C* keys(int64_t c) const { return keys_.get() + (Traits<T>::vnni ? 2 : 1) * (c - base_); }
  const C* values(int64_t c) const { return values_.get() + (c - base_) * Dv_; }
  int64_t ld() const { return ld_; }

 private:
  void slide(int64_t lo) {  // columns [lo, end_) to the front
    const int64_t keep = std::max<int64_t>(0, end_ - lo), shift = lo - base_;
    constexpr int64_t per = 4 / sizeof(C);  // values of C per packed 32-bit word
    auto* kw = reinterpret_cast<uint32_t*>(keys_.get());
    for (int64_t d = 0; d < D_ / per; ++d) {
      std::memmove(kw + d * ld_, kw + d * ld_ + shift, keep * sizeof(uint32_t));
    }
    if constexpr (Traits<T>::packs_values) {
      std::memmove(values_.get(), values_.get() + shift * Dv_, keep * Dv_ * sizeof(C));
    }
    base_ = lo;
    end_ = std::max(end_, lo);
  }

  const Heads<T>& in_;
  const int64_t D_, Dv_, k0_, v_lo_, v_hi_, cap_, ld_;
  Buffer<C> keys_, values_;
  int64_t hk_ = -1, base_ = 0, end_ = 0;
};

// Blocks per work item of band_forward: each product runs on all of them before the other
// (one AMX tile configuration per product and group instead of two per block: 16 × 288 × 64 in
// bfloat16, 1.0 → 0.7 µs per block for both products).
constexpr int64_t kGroup = 4;

template <typename T, typename TO>
void band_forward(at::Tensor& out, at::Tensor& lse, const at::Tensor& q, const at::Tensor& k,
                  const at::Tensor& v, const at::Tensor& add, int64_t r0, int64_t nblk, int64_t bq,
                  int64_t k_start, int64_t width, int64_t limit, double scale_d,
                  std::atomic<bool>* bad, float softcap, const bool* keys,
                  const float* sinks) {
  using C = typename Traits<T>::C;
  constexpr bool vnni = Traits<T>::vnni;
  const int64_t H = q.size(0), D = q.size(2), Hkv = k.size(0), Dv = v.size(2);
  const int64_t G = H / Hkv;
  const float scale = static_cast<float>(scale_d);
  // scores per row (add holds −inf past width); in bfloat16 also the keys per block of p·v
  const int64_t ws = score_cols(width, vnni);
  const int64_t nk = (nblk - 1) * bq + width;  // keys the band covers
  // packed column j is key k_start + j: a key when v_lo <= j < v_hi (edge windows reach past
  // [0, limit), a key mask's run of kept keys ends before them: those columns are −inf and
  // their packed keys and values zero); a key mask's holes are −inf on the scores (`hole`)
  const KeyRuns runs(keys, 0, k.size(1), 1);
  const int64_t v_lo = std::max<int64_t>({0, -k_start, runs.lo[0] - k_start});
  const int64_t v_hi = std::max(v_lo, std::min({nk, limit - k_start, runs.hi[0] - k_start}));
  const float* hole = runs.row(0, 0);  // over the item's keys: 0 kept, −inf masked (or null)
  const int64_t ngrp = (nblk + kGroup - 1) / kGroup;
  // columns one work item reads ((kGroup − 1)·bq + ws), and the stream's capacity: several
  // items' worth, so that a slide (moving the overlap to the front) is rare
  const int64_t span = (kGroup - 1) * bq + ws;
  const int64_t cap = std::max<int64_t>(4 * span, 1024) / 16 * 16;

  const Heads<T> in(q, k, v);
  const int64_t qs = in.qs, vs = in.vs;
  const float* ap = add.const_data_ptr<float>();
  const int64_t a0 = add.size(0) > 1 ? add.stride(0) : 0;
  const int64_t a1 = add.size(1) > 1 ? add.stride(1) : 0;
  const int64_t ar = add.stride(2);
  TO* op = static_cast<TO*>(out.data_ptr());  // WideBF16: the bits of bfloat16
  float* lp = lse.data_ptr<float>();
  const int64_t o0 = out.stride(0), o1 = out.stride(1), o2 = out.stride(2);
  const int64_t l0 = lse.stride(0), l1 = lse.stride(1), l2 = lse.stride(2);

  // every (key head, group of blocks, query head of the group) is a work item; a thread runs a
  // contiguous range of them, packing each key head's columns as its blocks reach them
  const int64_t items = ngrp * G;
  auto run = [&](int64_t hk, int64_t it, BandStream<T>& st, Scratch<C>& sc, bool* seen) {
    [[maybe_unused]] const T* vh_ = in.values(hk);
    float* const s = sc.s;
    {
      const int64_t h = hk * G + it % G, t0 = it / G * kGroup;
      const int64_t t1 = std::min(nblk, t0 + kGroup);
      st.cover(hk, t0 * bq, (t1 - 1) * bq + ws, seen);
      for (int64_t t = t0; t < t1; ++t) {
        const T* qb = in.q + h * in.qh + (r0 + t * bq) * qs;
        if (seen != nullptr) {  // this block's query rows, once per (block, head)
          for (int64_t r = 0; r < bq; ++r) {
            if (attnlab_bits::span_bad(qb + r * qs, D)) *seen = true;
          }
        }
        if (std::min(v_hi - t * bq, ws) <= std::clamp<int64_t>(v_lo - t * bq, 0, ws)) {
          continue;  // no key in the window (padding): below, its rows are zeros
        }
        const auto [qa, lda] = query_rows(qb, qs, bq, D, sc.q);
        brgemm(bq, ws, D, lda, st.ld(), ws, false, qa, st.keys(t * bq), s + (t - t0) * bq * ws,
               vnni);
      }
      for (int64_t t = t0; t < t1; ++t) {
        const float* at = ap + t * a0 + h * a1;
        // this block's columns that are keys: [c_lo, c_hi) (all of them inside the band)
        const int64_t c_lo = std::clamp<int64_t>(v_lo - t * bq, 0, ws);
        const int64_t c_hi = std::clamp<int64_t>(v_hi - t * bq, c_lo, ws);
        const int64_t g = (t - t0) * bq;
        if (c_hi <= c_lo) {  // no key in the window: the rows are zeros (no product ran)
          std::fill(sc.o + g * Dv, sc.o + (g + bq) * Dv, 0.0f);
          std::fill(sc.m.data() + g, sc.m.data() + g + bq, kNegInf);
          continue;
        }
        for (int64_t r = 0; r < bq; ++r) {
          float* sr = s + (g + r) * ws;
          C* pr = vnni ? sc.p + (g + r) * ws : reinterpret_cast<C*>(sr);
          if (softcap > 0.0f) cap_scores(sr, ws, scale, softcap);
          if (hole != nullptr) mask_holes(sr, hole, k_start + t * bq, c_lo, c_hi);
          const float sx = softcap > 0.0f ? 1.0f : scale;
          const auto [mx, sum] = softmax_row<true>(sr, at + r * ar, ws, c_lo, c_hi, sx, pr);
          sc.m[g + r] = mx;
          sc.den[g + r] = sum;
        }
        float* ob = sc.o + g * Dv;
        if constexpr (vnni) {  // packed values: zero rows where there is no key
          brgemm(bq, Dv, ws, ws, Dv, Dv, false, sc.p + g * ws, st.values(t * bq), ob, true);
        } else if (c_hi > c_lo) {  // only the rows that exist: in place, or widened
          const int64_t kn = std::min(width, c_hi) - c_lo;
          if constexpr (Traits<T>::packs_values) {
            brgemm(bq, Dv, kn, ws, Dv, Dv, false, s + g * ws + c_lo, st.values(t * bq + c_lo),
                   ob, false);
          } else {
            brgemm(bq, Dv, kn, ws, vs, Dv, false, s + g * ws + c_lo,
                   vh_ + (k_start + t * bq + c_lo) * vs, ob, false);
          }
        } else {
          std::fill(ob, ob + bq * Dv, 0.0f);
        }
      }
      const float sink = sinks == nullptr ? kNegInf : sinks[h];
      for (int64_t t = t0; t < t1; ++t) {
        const int64_t g = (t - t0) * bq;
        for (int64_t r = 0; r < bq; ++r) {
          finish_row(op + t * o0 + h * o1 + r * o2, lp + t * l0 + h * l1 + r * l2,
                     sc.o + (g + r) * Dv, Dv, sc.m[g + r], sc.den[g + r], sink);
        }
      }
    }
  };
  const size_t rows = static_cast<size_t>(kGroup * bq);
  at::parallel_for(0, Hkv * items, 1, [&](int64_t w0, int64_t w1) {
    Scratch<C> sc(rows * ws, vnni ? rows * ws : 0, rows * Dv, rows,
                  kWidens<T> ? static_cast<size_t>(bq * D) : 0);
    BandStream<T> st(in, D, Dv, k_start, v_lo, v_hi, cap);
    bool seen = false;  // a non-finite q, k or v entry read by this thread's items
    for (int64_t w = w0; w < w1; ++w) {
      if (w + 1 < w1) {  // the next item's query rows, on their way into cache
        const int64_t hk = (w + 1) / items, it = (w + 1) % items;
        const int64_t t0 = it / G * kGroup, n = std::min(nblk, t0 + kGroup) - t0;
        const T* qh = in.q + (hk * G + it % G) * in.qh;
        const int64_t row_bytes = D * static_cast<int64_t>(sizeof(T));
        prefetch_rows(qh, qs, r0 + t0 * bq, r0 + (t0 + n) * bq, row_bytes);
      }
      run(w / items, w % items, st, sc, bad ? &seen : nullptr);
    }
    if (seen) bad->store(true, std::memory_order_relaxed);
    brgemm_release(vnni);
  });
}

// Score columns a segment block holds at once (forward and backward): longer rows (one causal
// call over L = 16384) run in spans of this many, so that a 64-row block's scores (512 KiB)
// stay in the core's cache; the forward merges the spans' softmax online. One causal call at
// L = 16384, fp32 forward on an AVX2 EPYC: flash/SDPA 1.13–1.17 (all 16384 at once) → 0.98–1.03
// (2048; 512: 1.04, 1024: 0.95–1.13); packed documents of 2048 stay one pass.
constexpr int64_t kSegmentSpan = 2048;

// Batched segments (packed documents, `tiling.SegmentCall`) of one batch item: segment s holds
// rows and keys [start + s·n, start + (s+1)·n); its rows see all its keys, or (causal) the keys
// up to their own position. Every row's keys are in one block, so the softmax is one pass (up
// to kSegmentSpan columns; longer rows merge spans online); each key head is packed once for
// all its segments. Query block t of a segment (rows t·bq …) needs
// only the keys [0, t·bq + rows) of it when causal: its scores are computed and read in chunks
// of 512 columns (a handful of brgemm shapes for any n). Work items run the blocks of a segment
// in the order 0, last, 1, last − 1, … so that the two halves of the range (one per thread)
// carry equal work.
template <typename T>
void segment_forward(at::Tensor& out, at::Tensor& lse, const at::Tensor& q, const at::Tensor& k,
                     const at::Tensor& v, int64_t start, int64_t n, int64_t count, bool causal,
                     int64_t bq, double scale_d, float softcap, const bool* keys,
                     const float* sinks) {
  using C = typename Traits<T>::C;
  constexpr bool vnni = Traits<T>::vnni;
  constexpr int64_t kCols = 512;  // columns per brgemm call, both products
  const int64_t H = q.size(0), D = q.size(2), Hkv = k.size(0), Dv = v.size(2);
  const int64_t G = H / Hkv;
  const float scale = static_cast<float>(scale_d);
  const int64_t nk = count * n;  // keys of the call; even in bfloat16 (n even)
  const int64_t wmax = score_cols(n, vnni);  // scores per row
  // scores held at once per row: all of them up to kSegmentSpan, else spans of that many
  // columns whose softmax is merged online
  const int64_t span = std::min(wmax, kSegmentSpan);
  // their row stride: 64 bytes off a power of two (score rows 2^k floats apart share cache
  // sets; one causal call at L = 8192, fp32 on an AVX2 EPYC: flash/SDPA 0.95–1.03 → 0.89–0.98
  // in 4 of 5 alternating runs)
  const int64_t lds = span + (vnni ? 32 : 16);
  // packed rows of bfloat16 values: p·v of a block reads whole 32-key steps, up to 31 zero
  // rows past the last key; packed keys: every row reads up to wmax columns
  const int64_t nv = vnni ? nk + 32 : nk;
  const int64_t ldk = (nv + 15) / 16 * 16 + 16;
  const int64_t nblk = (n + bq - 1) / bq;
  const KeyRuns runs(keys, start, n, count);
  const int64_t items = count * nblk * G;
  // with a key mask, blocks before a segment's first key are empty (a left-padded row): the
  // threads take items one at a time (per key head) instead of a fixed half each
  std::vector<std::atomic<int64_t>> next(keys != nullptr ? Hkv : 0);
  for (auto& x : next) x.store(0);

  const Heads<T> in(q, k, v);
  const int64_t qs = in.qs, vs = in.vs;
  T* op = static_cast<T*>(out.data_ptr());  // WideBF16: the bits of bfloat16
  float* lp = lse.data_ptr<float>();
  const int64_t o0 = out.stride(0), o1 = out.stride(1), l0 = lse.stride(0), l1 = lse.stride(1);

  auto block = [&](int64_t hk, const C* kpack, const C* vpack, int64_t it, Scratch<C>& sc) {
    [[maybe_unused]] const T* vh_ = in.values(hk);
    float* const s = sc.s;
    const int64_t seg = it / (nblk * G), u = it / G % nblk, h = hk * G + it % G;
    const float sink = sinks == nullptr ? kNegInf : sinks[h];
    const int64_t t = u % 2 == 0 ? u / 2 : nblk - 1 - u / 2;  // 0, last, 1, last − 1, …
    const int64_t rows = std::min(bq, n - t * bq);
    const int64_t key0 = seg * n;  // the segment's first packed column
    const int64_t row0 = start + key0 + t * bq;
    // this block's columns: [kb, end) (its first key rounded down, one past its last key)
    const int64_t lo = runs.lo[seg], kb = runs.first(seg);
    const int64_t end = runs.end(seg, causal, t * bq + rows);
    if (end <= lo) {  // no row of the block has a key: zeros, lse −inf
      std::fill(sc.o, sc.o + rows * Dv, 0.0f);
      for (int64_t r = 0; r < rows; ++r) {
        finish_row(op + h * o0 + (row0 + r) * o1, lp + h * l0 + (row0 + r) * l1, sc.o + r * Dv,
                   Dv, kNegInf, 0.0f, sink);
      }
      return;
    }
    const int64_t width = end - kb;
    const int64_t ws = score_cols(width, vnni);
    const auto [qa, lda] = query_rows(in.q + h * in.qh + row0 * qs, qs, rows, D, sc.q);
    // bfloat16: whole 32-key steps (p is 0 past the keys, the packed values too)
    const int64_t kn = vnni ? ws : width;
    const int64_t col0 = key0 + kb;  // packed column of the block's first score column
    constexpr bool packed = Traits<T>::packs_values;
    for (int64_t a0 = 0; a0 < ws; a0 += span) {  // one span of columns (usually the only one)
      const int64_t wa = std::min(span, ws - a0);
      for (int64_t c0 = 0; c0 < wa; c0 += kCols) {
        brgemm(rows, std::min(kCols, wa - c0), D, lda, ldk, lds, false, qa,
               kpack + (vnni ? 2 : 1) * (col0 + a0 + c0), s + c0, vnni);
      }
      // the first span's softmax and p·v go to m, den, o; a later one's to their second
      // halves, then merged: o·e^(m − m') + o₂·e^(m₂ − m') with m' = max(m, m₂)
      float* const m = sc.m.data() + (a0 > 0 ? rows : 0);
      float* const den = sc.den.data() + (a0 > 0 ? rows : 0);
      float* const o = sc.o + (a0 > 0 ? rows * Dv : 0);
      const float* ad = runs.row(seg, kb + a0);  // the key mask's holes (null: none)
      const int64_t c_lo = std::clamp<int64_t>(lo - kb - a0, 0, wa);
      for (int64_t r = 0; r < rows; ++r) {
        float* sr = s + r * lds;
        C* pr = vnni ? sc.p + r * lds : reinterpret_cast<C*>(sr);
        const int64_t c_hi =
            std::clamp<int64_t>(runs.end(seg, causal, t * bq + r + 1) - kb - a0, c_lo, wa);
        if (softcap > 0.0f) cap_scores(sr, wa, scale, softcap);
        const float sx = softcap > 0.0f ? 1.0f : scale;
        const auto [mx, sum] = ad == nullptr
                                   ? softmax_row<false>(sr, nullptr, wa, c_lo, c_hi, sx, pr)
                                   : softmax_row<true>(sr, ad, wa, c_lo, c_hi, sx, pr);
        m[r] = mx;
        den[r] = sum;
      }
      const C* pa = vnni ? sc.p : reinterpret_cast<const C*>(s);
      const int64_t ka = std::min(wa, kn - a0);
      for (int64_t c0 = 0; c0 < ka; c0 += kCols) {
        const int64_t kc = std::min(kCols, ka - c0);
        const C* vb;
        if constexpr (packed) {
          vb = vpack + (col0 + a0 + c0) * Dv;
        } else {
          vb = vh_ + (start + col0 + a0 + c0) * vs;
        }
        brgemm(rows, Dv, kc, lds, packed ? Dv : vs, Dv, c0 > 0, pa + c0, vb, o, vnni);
      }
      if (a0 == 0) continue;
      for (int64_t r = 0; r < rows; ++r) {
        if (m[r] == kNegInf) continue;  // no key of this row in the span
        const float mm = std::max(sc.m[r], m[r]);
        const float e1 = sc.m[r] == kNegInf ? 0.0f : std::exp(sc.m[r] - mm);
        const float e2 = std::exp(m[r] - mm);
        float* orow = sc.o + r * Dv;
        const float* o2 = o + r * Dv;
        for (int64_t d = 0; d < Dv; ++d) orow[d] = orow[d] * e1 + o2[d] * e2;
        sc.den[r] = sc.den[r] * e1 + den[r] * e2;
        sc.m[r] = mm;
      }
    }
    for (int64_t r = 0; r < rows; ++r) {
      finish_row(op + h * o0 + (row0 + r) * o1, lp + h * l0 + (row0 + r) * l1, sc.o + r * Dv, Dv,
                 sc.m[r], sc.den[r], sink);
    }
  };
  auto run = [&](int64_t hk, const C* kpack, const C* vpack, int64_t i0, int64_t i1,
                 Scratch<C>& sc) {
    if (next.empty()) {
      for (int64_t it = i0; it < i1; ++it) block(hk, kpack, vpack, it, sc);
      return;
    }
    for (int64_t it = next[hk]++; it < items; it = next[hk]++) block(hk, kpack, vpack, it, sc);
  };
  const size_t rows = static_cast<size_t>(bq);
  const size_t spans = (wmax > span ? 2 : 1);  // 2: a second set of m, den, o to merge
  const size_t scratch[5] = {rows * lds, vnni ? rows * lds : 0, spans * rows * Dv, spans * rows,
                             kWidens<T> ? rows * static_cast<size_t>(D) : 0};
  run_heads<T>(in, Hkv, D, Dv, start, 0, nk, ldk, nv, nullptr, items, scratch, run);
}

// ---------------------------------------------------------------------------- band backward
// Transposes rows × cols floats (row stride lds) into dst (cols × rows, row stride ldd).
inline void transpose_f32(const float* src, int64_t lds, int64_t rows, int64_t cols, float* dst,
                          int64_t ldd) {
  for (int64_t r0 = 0; r0 < rows; r0 += 16) {
    for (int64_t c0 = 0; c0 < cols; c0 += 16) {
      if (r0 + 16 <= rows && c0 + 16 <= cols) {
        transpose16<float>(reinterpret_cast<const uint32_t*>(src + r0 * lds + c0), lds,
                           reinterpret_cast<uint32_t*>(dst + c0 * ldd + r0), ldd, nullptr);
        continue;
      }
      for (int64_t r = r0; r < std::min(rows, r0 + 16); ++r) {
        for (int64_t c = c0; c < std::min(cols, c0 + 16); ++c) dst[c * ldd + r] = src[r * lds + c];
      }
    }
  }
}

// One thread's dKᵀ (D × ld) and dVᵀ (Dv × ld) of key head hk, band columns [base, end):
// its blocks add into them (one block: the columns [t·bq, t·bq + ws)); columns left of the
// current block are final for the thread and go to `flush(hk, c0, c1, dkt, dvt, ld)` (the
// transposed columns [c0, c1)), on a change of head, when the buffer would overflow (the
// still-open columns then move to the front) and at the end (`finish`).
template <typename Flush>
class GradAcc {
 public:
  GradAcc(int64_t D, int64_t Dv, int64_t cap, const Flush& flush)
      : D_(D), Dv_(Dv), cap_(cap), ld_(cap + 16), dk_(static_cast<size_t>(D * ld_)),
        dv_(static_cast<size_t>(Dv * ld_)), flush_(flush) {}

  void cover(int64_t hk, int64_t lo, int64_t hi) {
    if (hk != hk_) {
      finish();
      hk_ = hk;
      base_ = end_ = lo;
    }
    if (hi - base_ > cap_) {
      emit(base_, lo);
      const int64_t keep = std::max<int64_t>(0, end_ - lo);
      const size_t bytes = keep * sizeof(float);
      for (int64_t d = 0; d < D_; ++d) std::memmove(dkt(base_) + d * ld_, dkt(lo) + d * ld_, bytes);
      for (int64_t d = 0; d < Dv_; ++d) std::memmove(dvt(base_) + d * ld_, dvt(lo) + d * ld_, bytes);
      base_ = lo;
      end_ = std::max(end_, lo);
    }
    if (hi > end_) {
      for (int64_t d = 0; d < D_; ++d) std::fill(dkt(end_) + d * ld_, dkt(hi) + d * ld_, 0.0f);
      for (int64_t d = 0; d < Dv_; ++d) std::fill(dvt(end_) + d * ld_, dvt(hi) + d * ld_, 0.0f);
      end_ = hi;
    }
  }

  void finish() {
    if (hk_ >= 0 && end_ > base_) emit(base_, end_);
    base_ = end_;
  }

  float* dkt(int64_t c) { return dk_.get() + (c - base_); }
  float* dvt(int64_t c) { return dv_.get() + (c - base_); }
  int64_t ld() const { return ld_; }

 private:
  void emit(int64_t c0, int64_t c1) {
    if (c1 > c0) flush_(hk_, c0, c1, dkt(c0), dvt(c0), ld_);
  }

  const int64_t D_, Dv_, cap_, ld_;
  Buffer<float> dk_, dv_;
  const Flush& flush_;
  int64_t hk_ = -1, base_ = 0, end_ = 0;
};

// Adds the transposed columns [0, n) of src (rows × ·, row stride lds) into n rows of dst (row
// stride ldd, `rows` values each) from row 0.
inline void add_transposed(const float* src, int64_t lds, int64_t rows, int64_t n, float* dst,
                           int64_t ldd) {
  alignas(64) float tile[16][16];
  for (int64_t c0 = 0; c0 < n; c0 += 16) {
    const int64_t nc = std::min<int64_t>(16, n - c0);
    for (int64_t d0 = 0; d0 < rows; d0 += 16) {
      const int64_t nd = std::min<int64_t>(16, rows - d0);
      transpose_f32(src + d0 * lds + c0, lds, nd, nc, &tile[0][0], 16);  // tile[c][d]
      for (int64_t c = 0; c < nc; ++c) {
        float* row = dst + (c0 + c) * ldd + d0;
#pragma omp simd
        for (int64_t d = 0; d < nd; ++d) row[d] += tile[c][d];
      }
    }
  }
}

// Pointers and strides of a backward call's out (H, L, Dv) in O (float32, or the inputs' dtype),
// dout (H, L, Dv) in the inputs' dtype T, float32 lse (H, L) and gradients dq (H, L, D), dk
// (H_kv, S, D), dv (H_kv, S, Dv) of one batch item.
template <typename T, typename O = float>
struct GradIo {
  const O* o;
  const T* g;
  const float* l;
  float* dq;
  float* dk;
  float* dv;
  int64_t oh, os, gh, gs, lh, ls, dqh, dqs, dkh, dks, dvh, dvs;
  GradIo(at::Tensor& dq_, at::Tensor& dk_, at::Tensor& dv_, const at::Tensor& out,
         const at::Tensor& dout, const at::Tensor& lse)
      : o(static_cast<const O*>(out.const_data_ptr())), g(static_cast<const T*>(dout.const_data_ptr())),
        l(lse.const_data_ptr<float>()), dq(dq_.data_ptr<float>()), dk(dk_.data_ptr<float>()),
        dv(dv_.data_ptr<float>()), oh(out.stride(0)), os(out.stride(1)), gh(dout.stride(0)),
        gs(dout.stride(1)), lh(lse.stride(0)), ls(lse.stride(1)), dqh(dq_.stride(0)),
        dqs(dq_.stride(1)), dkh(dk_.stride(0)), dks(dk_.stride(1)), dvh(dv_.stride(0)),
        dvs(dv_.stride(1)) {}
  // δ = rowsum(dO ⊙ O) of `rows` rows of head h from row0, into delta. Summed in double: every
  // dS_ij = P_ij·(dP_ij − δ_i) carries δ's error, and a row whose P sits on a few keys (ALiBi)
  // passes it whole into dq_i = Σ_j dS_ij·k_j — a float32 chain over Dv = 128 took dq to 1.6×
  // torch's error (issue #38); rounded once, δ is exact to float32 (bq·Dv products per block).
  void deltas(int64_t h, int64_t row0, int64_t rows, int64_t Dv, float* delta) const {
    const T* gb = g + h * gh + row0 * gs;
    const O* ob = o + h * oh + row0 * os;
    for (int64_t r = 0; r < rows; ++r) {
      double d = 0.0;
      for (int64_t e = 0; e < Dv; ++e) {
        d += static_cast<double>(static_cast<float>(gb[r * gs + e])) *
             static_cast<double>(static_cast<float>(ob[r * os + e]));
      }
      delta[r] = static_cast<float>(d);
    }
  }
  float lse_at(int64_t h, int64_t row) const { return l[h * lh + row * ls]; }
  const T* g_row(int64_t h, int64_t row) const { return g + h * gh + row * gs; }
  float* dq_row(int64_t h, int64_t row) const { return dq + h * dqh + row * dqs; }
  float* dk_row(int64_t hk, int64_t key) const { return dk + hk * dkh + key * dks; }
  float* dv_row(int64_t hk, int64_t key) const { return dv + hk * dvh + key * dvs; }
};

// One row of ws scores sr and dO·vᵀ values dr turned into P = exp(x − lse) (in sr) and
// dS·scale = P ⊙ (dr − δ)·scale (in dr), with x = s·scale + add (add may be null) on the
// columns [lo, hi) and −inf (P = 0) on the others.
inline void grad_row(float* sr, float* dr, const float* ad, int64_t ws, int64_t lo, int64_t hi,
                     float scale, float lse, float delta) {
  int64_t j = 0;
#if defined(ATTNLAB_AVX2)
  // the loop below in 8 lanes, with the same operations (the compiler leaves it scalar here:
  // window 256, L = 16384 on an AVX2 EPYC, a fifth of forward + backward)
  const __m256 vscale = _mm256_set1_ps(scale), vlse = _mm256_set1_ps(lse);
  const __m256 vdelta = _mm256_set1_ps(delta);
  const __m256i lane = _mm256_setr_epi32(0, 1, 2, 3, 4, 5, 6, 7);
  const __m256i vlo = _mm256_set1_epi32(static_cast<int32_t>(lo) - 1);
  const __m256i vhi = _mm256_set1_epi32(static_cast<int32_t>(hi));
  for (; j + 8 <= ws; j += 8) {
    const __m256 s8 = _mm256_loadu_ps(sr + j);
    const __m256 y = ad != nullptr ? _mm256_fmadd_ps(s8, vscale, _mm256_loadu_ps(ad + j))
                                   : _mm256_mul_ps(s8, vscale);
    const __m256i col = _mm256_add_epi32(lane, _mm256_set1_epi32(static_cast<int32_t>(j)));
    const __m256i in =
        _mm256_and_si256(_mm256_cmpgt_epi32(col, vlo), _mm256_cmpgt_epi32(vhi, col));
    const __m256 pj =
        _mm256_and_ps(_mm256_castsi256_ps(in), attnlab_exp::exp_neg8(_mm256_sub_ps(y, vlse)));
    _mm256_storeu_ps(sr + j, pj);
    const __m256 d = _mm256_sub_ps(_mm256_loadu_ps(dr + j), vdelta);
    _mm256_storeu_ps(dr + j, _mm256_mul_ps(_mm256_mul_ps(pj, d), vscale));
  }
#endif
  // two loops, not `ad != nullptr ? … : …` in one: compiled for AVX-512, that loop read ad
  // through a masked load even without it — a load from page 0 whose fault each masked-off
  // lane suppresses through a microcode assist (a causal segment of 160, H = 4, D = 32, fp32:
  // backward 272 → 77 µs per call on a Zen 5 EPYC)
  if (ad == nullptr) {
    for (; j < ws; ++j) {
      const float pj = j >= lo && j < hi ? exp_neg(sr[j] * scale - lse) : 0.0f;
      sr[j] = pj;
      dr[j] = pj * (dr[j] - delta) * scale;
    }
    return;
  }
  for (; j < ws; ++j) {
    const float pj = j >= lo && j < hi ? exp_neg(std::fma(sr[j], scale, ad[j]) - lse) : 0.0f;
    sr[j] = pj;
    dr[j] = pj * (dr[j] - delta) * scale;
  }
}

// `grad_row` of a row whose every key the call holds, with δ = Σ_j P_j·dP_j of the row itself
// (in double), as softmax's own backward forms it: dS then sums to zero with the very P and dP
// it multiplies (a row with one key gets dS = 0 exactly), where rowsum(dO ⊙ O) differs from
// Σ P·dP by the roundings of O and of the dO·vᵀ product. On rows with a few keys (window edges,
// L > S) or with P on a few keys (ALiBi) that difference reached dq whole: 5–7× the error of
// the same-dtype softmax at D = 256 (issue #38). Runs `grad_row` with δ = 0 (dr = P·dP·scale),
// then dr −= (Σ dr)·P: two light passes over the row.
inline float grad_row_own(float* sr, float* dr, const float* ad, int64_t ws, int64_t lo,
                          int64_t hi, float scale, float lse) {
  grad_row(sr, dr, ad, ws, lo, hi, scale, lse, 0.0f);
  double d = 0.0;
#pragma omp simd reduction(+ : d)
  for (int64_t j = 0; j < ws; ++j) d += static_cast<double>(dr[j]);
  const float dl = static_cast<float>(d);
#pragma omp simd
  for (int64_t j = 0; j < ws; ++j) dr[j] -= dl * sr[j];
  return dl;  // δ·scale
}

// Where a backward operator writes each row's δ (`delta` (H, L) float32, optional): the rows
// it computes get their δ (Σ P·dP, or rowsum(dO ⊙ O)), rows without a key 0. The sinks'
// gradient reads it (ds_h = Σ_i e^{s_h − lse_i}·(dlse_i − δ_i): attnlab/functional/flash/sinks.py)
// instead of a pass over dO and O.
struct DeltaOut {
  float* p = nullptr;
  int64_t s0 = 0, s1 = 0;
  explicit DeltaOut(const std::optional<at::Tensor>& t) {
    if (!t.has_value()) return;
    p = t->data_ptr<float>();
    s0 = t->stride(0);
    s1 = t->stride(1);
  }
  void put(int64_t h, int64_t row, float d) const {
    if (p != nullptr) p[h * s0 + row * s1] = d;
  }
};

// The backward of `band_forward` in float32 for one batch item, added into dq (H, L, D),
// dk (H_kv, S, D), dv (H_kv, S, Dv): per query block t and head h, with the forward's lse and
// δ = rowsum(dO ⊙ O) (with `own_delta`, when the call holds every key of its rows, δ = Σ P·dP
// of the row: `grad_row_own`),
//     P = exp(q·kᵀ·scale + add − lse),  dS = P ⊙ (dO·vᵀ − δ)·scale,
//     dq += dS·k,  dkᵀ += qᵀ·dS,  dvᵀ += dOᵀ·P   (over the window's keys);
// a row with lse = +inf (no key) contributes nothing. Work items are (key head, block) with the
// G query heads of the group inside; each thread keeps dKᵀ/dVᵀ of its columns (`GradAcc`) and
// adds a column into dk/dv once it is done with it; the columns the neighbouring threads'
// blocks share (at most a window at each end of its range) are kept and added after the
// parallel region in the order of the ranges: every run adds the same numbers in the same order
// (bit-deterministic, as the catalogue asks of every backward).
template <typename T>
void band_backward(at::Tensor& dq, at::Tensor& dk, at::Tensor& dv, const at::Tensor& q,
                   const at::Tensor& k, const at::Tensor& v, const at::Tensor& out,
                   const at::Tensor& dout, const at::Tensor& lse, const at::Tensor& add,
                   int64_t r0, int64_t nblk, int64_t bq, int64_t k_start, int64_t width,
                   int64_t limit, double scale_d, bool own_delta, const bool* keys,
                   const DeltaOut& dout_delta) {
  const int64_t H = q.size(0), D = q.size(2), Hkv = k.size(0), Dv = v.size(2);
  const int64_t G = H / Hkv;
  const float scale = static_cast<float>(scale_d);
  const int64_t ws = score_cols(width, false);
  const int64_t nk = (nblk - 1) * bq + width;
  const KeyRuns runs(keys, 0, k.size(1), 1);  // as the forward: the run of kept keys, holes
  const int64_t v_lo = std::max<int64_t>({0, -k_start, runs.lo[0] - k_start});
  const int64_t v_hi = std::max(v_lo, std::min({nk, limit - k_start, runs.hi[0] - k_start}));
  const float* hole = runs.row(0, 0);
  const int64_t cap = std::max<int64_t>(4 * ws, 1024) / 16 * 16;

  // keys packed as kᵀ for q·kᵀ and (16-bit inputs, widened) as rows for dS·k; values as vᵀ
  const Heads<T> in(q, k, k);
  const Heads<T> vin(q, v, v);
  const float* ap = add.const_data_ptr<float>();
  const int64_t a0 = add.size(0) > 1 ? add.stride(0) : 0;
  const int64_t a1 = add.size(1) > 1 ? add.stride(1) : 0;
  const int64_t ar = add.stride(2);
  const GradIo<T> io(dq, dk, dv, out, dout, lse);
  // gradients of columns that neighbouring ranges share, per range (keyed by its first item):
  // added after the parallel region in range order, so every run sums them in the same order
  struct Shared {
    int64_t hk, j0, j1;
    std::vector<float> dk, dv;  // (j1 − j0) rows of D and Dv values
  };
  std::vector<std::pair<int64_t, std::vector<Shared>>> shared_parts;
  std::mutex shared_lock;

  at::parallel_for(0, Hkv * nblk, 1, [&](int64_t w0, int64_t w1) {
    // columns this range shares with its neighbours' ranges, per end: [0, lo_end) of the first
    // head when the range starts inside it, [hi_start, ·) of the last head likewise
    const int64_t hk_a = w0 / nblk, ta = w0 % nblk;
    const int64_t hk_b = (w1 - 1) / nblk, tb = (w1 - 1) % nblk;
    const int64_t lo_end = ta > 0 ? ta * bq + ws - bq : 0;
    const int64_t hi_start = tb < nblk - 1 ? (tb + 1) * bq : nk + ws;
    std::vector<Shared> mine;
    auto flush = [&](int64_t hk, int64_t c0, int64_t c1, const float* dkt, const float* dvt,
                     int64_t ld) {
      const int64_t j0 = std::max(c0, v_lo), j1 = std::min(c1, v_hi);  // keys that exist
      if (j1 <= j0) return;
      if ((hk == hk_a && j0 < lo_end) || (hk == hk_b && j1 > hi_start)) {  // kept for later
        Shared part{hk, j0, j1, std::vector<float>((j1 - j0) * D, 0.0f),
                    std::vector<float>((j1 - j0) * Dv, 0.0f)};
        add_transposed(dkt + (j0 - c0), ld, D, j1 - j0, part.dk.data(), D);
        add_transposed(dvt + (j0 - c0), ld, Dv, j1 - j0, part.dv.data(), Dv);
        mine.push_back(std::move(part));
        return;
      }
      add_transposed(dkt + (j0 - c0), ld, D, j1 - j0, io.dk_row(hk, k_start + j0), io.dks);
      add_transposed(dvt + (j0 - c0), ld, Dv, j1 - j0, io.dv_row(hk, k_start + j0), io.dvs);
    };
    BandStream<T> kst(in, D, D, k_start, v_lo, v_hi, cap);
    BandStream<T> vst(vin, Dv, Dv, k_start, v_lo, v_hi, cap);
    GradAcc<decltype(flush)> acc(D, Dv, cap, flush);
    Buffer<float> s_buf(bq * ws), dp_buf(bq * ws), qt_buf(D * bq), gt_buf(Dv * bq);
    Buffer<float> qw(kWidens<T> ? bq * D : 0), gw(kWidens<T> ? bq * Dv : 0);  // widened rows
    float* const s = s_buf.get();
    float* const dp = dp_buf.get();
    std::vector<float> delta(bq);
    for (int64_t w = w0; w < w1; ++w) {
      const int64_t hk = w / nblk, t = w % nblk, c = t * bq;
      kst.cover(hk, c, c + ws, nullptr);
      vst.cover(hk, c, c + ws, nullptr);
      acc.cover(hk, c, c + ws);
      const int64_t c_lo = std::clamp<int64_t>(v_lo - c, 0, ws);
      const int64_t c_hi = std::clamp<int64_t>(v_hi - c, c_lo, ws);
      if (c_hi <= c_lo) {  // no key in this window: nothing to add (δ = 0)
        for (int64_t g = 0; g < G; ++g) {
          for (int64_t r = 0; r < bq; ++r) dout_delta.put(hk * G + g, r0 + c + r, 0.0f);
        }
        continue;
      }
      const int64_t kn = std::min(width, c_hi) - c_lo;
      for (int64_t g = 0; g < G; ++g) {
        const int64_t h = hk * G + g, row = r0 + c;
        // q and dO rows: in place (float32) or widened
        const auto [qb, lq] = query_rows(in.q + h * in.qh + row * in.qs, in.qs, bq, D, qw.get());
        const auto [gb, lg] = query_rows(io.g_row(h, row), io.gs, bq, Dv, gw.get());
        const float* at = ap + t * a0 + h * a1;
        if (!own_delta) io.deltas(h, row, bq, Dv, delta.data());
        brgemm(bq, ws, D, lq, kst.ld(), ws, false, qb, kst.keys(c), s, false);
        brgemm(bq, ws, Dv, lg, vst.ld(), ws, false, gb, vst.keys(c), dp, false);
        if (hole != nullptr) {  // a key mask's holes: P = 0 there
          for (int64_t r = 0; r < bq; ++r) mask_holes(s + r * ws, hole, k_start + c, c_lo, c_hi);
        }
        for (int64_t r = 0; r < bq; ++r) {  // s becomes P, dp dS·scale
          if (own_delta) {
            const float dl = grad_row_own(s + r * ws, dp + r * ws, at + r * ar, ws, c_lo, c_hi,
                                          scale, io.lse_at(h, row + r));
            dout_delta.put(h, row + r, dl / scale);
          } else {
            grad_row(s + r * ws, dp + r * ws, at + r * ar, ws, c_lo, c_hi, scale,
                     io.lse_at(h, row + r), delta[r]);
            dout_delta.put(h, row + r, delta[r]);
          }
        }
        // dq rows += dS·k over the keys that exist (float32 k in place, else widened rows)
        if constexpr (Traits<T>::packs_values) {
          brgemm(bq, D, kn, ws, D, io.dqs, true, dp + c_lo, kst.values(c + c_lo),
                 io.dq_row(h, row), false);
        } else {
          brgemm(bq, D, kn, ws, in.ks, io.dqs, true, dp + c_lo,
                 in.k + hk * in.kh + (k_start + c + c_lo) * in.ks, io.dq_row(h, row), false);
        }
        transpose_f32(qb, lq, bq, D, qt_buf.get(), bq);
        transpose_f32(gb, lg, bq, Dv, gt_buf.get(), bq);
        brgemm(D, ws, bq, bq, ws, acc.ld(), true, qt_buf.get(), dp, acc.dkt(c), false);
        brgemm(Dv, ws, bq, bq, ws, acc.ld(), true, gt_buf.get(), s, acc.dvt(c), false);
      }
    }
    acc.finish();
    brgemm_release(false);
    if (!mine.empty()) {
      const std::lock_guard<std::mutex> guard(shared_lock);
      shared_parts.emplace_back(w0, std::move(mine));
    }
  });
  std::sort(shared_parts.begin(), shared_parts.end(),
            [](const auto& a, const auto& b) { return a.first < b.first; });
  for (const auto& [w0, parts] : shared_parts) {
    for (const Shared& part : parts) {
      for (int64_t j = part.j0; j < part.j1; ++j) {
        float* krow = io.dk_row(part.hk, k_start + j);
        float* vrow = io.dv_row(part.hk, k_start + j);
        const float* pk = part.dk.data() + (j - part.j0) * D;
        const float* pv = part.dv.data() + (j - part.j0) * Dv;
        for (int64_t d = 0; d < D; ++d) krow[d] += pk[d];
        for (int64_t d = 0; d < Dv; ++d) vrow[d] += pv[d];
      }
    }
  }
}

// The backward of `segment_forward` for one batch item, every product in float32 (float16 and
// bfloat16 inputs widened as they are packed; out float32), added into dq (H, L, D),
// dk (H_kv, S, D), dv (H_kv, S, Dv): the formulas of `band_backward` over each row's keys in its
// segment (causal: up to the row). A work item is one (segment, key head) with the G query heads
// of the group and all the segment's query blocks inside: it owns the dk/dv rows of its keys
// (accumulated transposed per thread, added once at its end), so nothing is shared between
// threads and every run adds in the same order. Products run in chunks of 512 columns, as in
// the forward.
template <typename T, typename O>
void segment_backward(at::Tensor& dq, at::Tensor& dk, at::Tensor& dv, const at::Tensor& q,
                      const at::Tensor& k, const at::Tensor& v, const at::Tensor& out,
                      const at::Tensor& dout, const at::Tensor& lse, int64_t start, int64_t n,
                      int64_t count, bool causal, int64_t bq, double scale_d, const bool* keys,
                      const DeltaOut& dout_delta) {
  constexpr int64_t kCols = 512;
  const int64_t H = q.size(0), D = q.size(2), Hkv = k.size(0), Dv = v.size(2);
  const int64_t G = H / Hkv;
  const float scale = static_cast<float>(scale_d);
  const int64_t wmax = score_cols(n, false), ldk = wmax + 16;
  // a block's scores in spans of at most kSegmentSpan columns (as the forward), their rows 64
  // bytes off a power of two (one causal call at L = 8192, fp32 fwd+bwd on an AVX2 EPYC:
  // flash/SDPA 1.13–1.20 → 0.96–1.06 in alternating runs)
  const int64_t span = std::min(wmax, kSegmentSpan), lds = span + 16;
  const int64_t nblk = (n + bq - 1) / bq;
  const KeyRuns runs(keys, start, n, count);  // as the forward: columns [first, end) per block
  const Heads<T> in(q, k, v);
  const GradIo<T, O> io(dq, dk, dv, out, dout, lse);
  // kᵀ and vᵀ of a segment's keys (D, ldk), (Dv, ldk): float32 read as is, 16-bit widened
  auto pack_t = [&](const T* x, int64_t xs, int64_t dim, int64_t key0, float* o) {
    if constexpr (kWidens<T>) {
      pack_keys_wide(x, xs, dim, key0, 0, n, 0, wmax, ldk, o, nullptr, 0);
    } else {
      pack_keys<float>(x, xs, dim, key0, 0, n, 0, wmax, ldk, o, nullptr);
    }
  };

  at::parallel_for(0, count * Hkv, 1, [&](int64_t i0, int64_t i1) {
    Buffer<float> kt(D * ldk), vt(Dv * ldk), dkt(D * ldk), dvt(Dv * ldk);
    Buffer<float> s_buf(bq * lds), dp_buf(bq * lds), qt(D * bq), gt(Dv * bq);
    // 16-bit inputs: the segment's key rows (B of dS·k), a block's q and dO rows, widened
    Buffer<float> kw(kWidens<T> ? n * D : 0), qw(kWidens<T> ? bq * D : 0);
    Buffer<float> gw(kWidens<T> ? bq * Dv : 0);
    float* const s = s_buf.get();
    float* const dp = dp_buf.get();
    std::vector<float> delta(bq);
    for (int64_t it = i0; it < i1; ++it) {
      const int64_t seg = it / Hkv, hk = it % Hkv, key0 = start + seg * n;
      const T* keys = in.k + hk * in.kh;
      pack_t(keys, in.ks, D, key0, kt.get());
      pack_t(in.values(hk), in.vs, Dv, key0, vt.get());
      const float* krows;  // key rows from the segment's first, row stride kst
      int64_t kst;
      if constexpr (kWidens<T>) {
        pack_values_wide(keys, in.ks, D, key0, 0, n, 0, n, kw.get(), nullptr, 0);
        krows = kw.get();
        kst = D;
      } else {
        krows = keys + key0 * in.ks;
        kst = in.ks;
      }
      std::fill(dkt.get(), dkt.get() + D * ldk, 0.0f);
      std::fill(dvt.get(), dvt.get() + Dv * ldk, 0.0f);
      // span by span of keys (P needs only lse), each with the query blocks that see it: the
      // span's dkᵀ/dvᵀ columns stay in cache while the blocks add into them (one causal call at
      // L = 16384: 4 MiB each per thread over all columns; fp32 fwd+bwd on an AVX2 EPYC,
      // flash/SDPA 1.03–1.04 block by block → 0.88–0.96 span by span, alternating runs)
      for (int64_t g = 0; g < G; ++g) {
        const int64_t h = hk * G + g;
        for (int64_t a0 = 0; a0 < wmax; a0 += span) {
          for (int64_t t = 0; t < nblk; ++t) {
            const int64_t rows = std::min(bq, n - t * bq), row0 = key0 + t * bq;
            // the block's columns [kb, end) (`KeyRuns`), their part in this span: [cs, ce)
            const int64_t lo = runs.lo[seg], kb = runs.first(seg);
            const int64_t end = runs.end(seg, causal, t * bq + rows);
            const int64_t cs = std::max(a0, kb);
            const int64_t ce = std::min(a0 + span, kb + score_cols(end - kb, false));
            if (end <= lo && a0 == 0) {  // no key of the block: δ = 0
              for (int64_t r = 0; r < rows; ++r) dout_delta.put(h, row0 + r, 0.0f);
            }
            if (end <= lo || cs >= ce) continue;  // no key of the block in this span
            const auto [qb, lq] = query_rows(in.q + h * in.qh + row0 * in.qs, in.qs, rows, D,
                                             qw.get());
            const auto [gb, lg] = query_rows(io.g_row(h, row0), io.gs, rows, Dv, gw.get());
            io.deltas(h, row0, rows, Dv, delta.data());
            for (int64_t r = 0; r < rows; ++r) dout_delta.put(h, row0 + r, delta[r]);
            transpose_f32(qb, lq, rows, D, qt.get(), rows);
            transpose_f32(gb, lg, rows, Dv, gt.get(), rows);
            const int64_t wa = ce - cs;
            for (int64_t c0 = 0; c0 < wa; c0 += kCols) {
              const int64_t nc = std::min(kCols, wa - c0), c = cs + c0;
              brgemm(rows, nc, D, lq, ldk, lds, false, qb, kt.get() + c, s + c0, false);
              brgemm(rows, nc, Dv, lg, ldk, lds, false, gb, vt.get() + c, dp + c0, false);
            }
            const float* ad = runs.row(seg, cs);  // the key mask's holes (null: none)
            const int64_t c_lo = std::clamp<int64_t>(lo - cs, 0, wa);
            for (int64_t r = 0; r < rows; ++r) {  // s becomes P, dp dS·scale
              const int64_t c_hi =
                  std::clamp<int64_t>(runs.end(seg, causal, t * bq + r + 1) - cs, c_lo, wa);
              grad_row(s + r * lds, dp + r * lds, ad, wa, c_lo, c_hi, scale,
                       io.lse_at(h, row0 + r), delta[r]);
            }
            const int64_t wk = std::min(wa, end - cs);  // the span's keys
            for (int64_t c0 = 0; c0 < wk; c0 += kCols) {  // dq rows += dS·k
              brgemm(rows, D, std::min(kCols, wk - c0), lds, kst, io.dqs, true, dp + c0,
                     krows + (cs + c0) * kst, io.dq_row(h, row0), false);
            }
            for (int64_t c0 = 0; c0 < wa; c0 += kCols) {
              const int64_t nc = std::min(kCols, wa - c0), c = cs + c0;
              brgemm(D, nc, rows, rows, lds, ldk, true, qt.get(), dp + c0, dkt.get() + c, false);
              brgemm(Dv, nc, rows, rows, lds, ldk, true, gt.get(), s + c0, dvt.get() + c, false);
            }
          }
        }
      }
      add_transposed(dkt.get(), ldk, D, n, io.dk_row(hk, key0), io.dks);
      add_transposed(dvt.get(), ldk, Dv, n, io.dv_row(hk, key0), io.dvs);
    }
    brgemm_release(false);
  });
}

// Faults in the pages of a large fresh output before the kernel writes it: one madvise
// (MADV_POPULATE_WRITE, Linux >= 5.14) per thread instead of a trap per 4 KiB page inside the
// kernel (window 256, L = 16384, fp32, best of 15 interleaved: 0.0736 → 0.0710 s). Only the
// bytes the view spans; a no-op where the pages exist, an ignored hint elsewhere.
void populate(const at::Tensor& t) {
#if defined(MADV_POPULATE_WRITE)
  int64_t lo = 0, hi = 0;  // element offsets spanned by the view
  for (int64_t d = 0; d < t.dim(); ++d) {
    (t.stride(d) < 0 ? lo : hi) += (t.size(d) - 1) * t.stride(d);
  }
  const int64_t item = t.element_size();
  const auto base = reinterpret_cast<uintptr_t>(t.data_ptr());
  const auto page = static_cast<uintptr_t>(sysconf(_SC_PAGESIZE));
  const uintptr_t a = (base + lo * item) & ~(page - 1);
  const uintptr_t b = (base + (hi + 1) * item + page - 1) & ~(page - 1);
  if (t.numel() == 0 || b - a < (uintptr_t{8} << 20)) return;
  const int64_t pages = static_cast<int64_t>((b - a) / page);
  at::parallel_for(0, pages, pages / 2 + 1, [&](int64_t p0, int64_t p1) {
    madvise(reinterpret_cast<void*>(a + p0 * page), (p1 - p0) * page, MADV_POPULATE_WRITE);
  });
#endif
}

void check(const at::Tensor& x, const char* op, const char* name, int64_t dim) {
  TORCH_CHECK(x.device().is_cpu(), "attnlab_band.", op, ": ", name, " must be on the CPU");
  TORCH_CHECK(x.dim() == dim, "attnlab_band.", op, ": ", name, " must be ", dim, "-D, got ",
              x.dim(), "-D");
  TORCH_CHECK(x.stride(-1) == 1, "attnlab_band.", op, ": ", name, " needs unit last stride");
}

// What both operators ask of q, k, v, out: one CPU batch item, a shared dtype the kernel runs
// (out: also float32 with `float_out`), grouped heads; returns q's dtype.
at::ScalarType check_inputs(const char* op, const at::Tensor& out, const at::Tensor& q, const at::Tensor& k,
                  const at::Tensor& v, int64_t out_dim, bool float_out = false) {
  check(q, op, "q", 3);
  check(k, op, "k", 3);
  check(v, op, "v", 3);
  check(out, op, "out", out_dim);
  TORCH_CHECK(k.scalar_type() == q.scalar_type() && v.scalar_type() == q.scalar_type(),
              "attnlab_band.", op, ": q, k, v must share a dtype");
  TORCH_CHECK(out.scalar_type() == q.scalar_type() ||
                  (float_out && out.scalar_type() == at::kFloat),
              "attnlab_band.", op, ": out must have q's dtype",
              float_out ? " or float32" : "", ", got ", out.scalar_type());
  TORCH_CHECK(q.size(0) % k.size(0) == 0 && v.size(0) == k.size(0) && v.size(1) == k.size(1),
              "attnlab_band.", op, ": bad head counts");
  const at::ScalarType dt = q.scalar_type();
  TORCH_CHECK(dt == at::kFloat || dt == at::kBFloat16 || dt == at::kHalf, "attnlab_band.", op,
              ": float32, bfloat16 or float16 only, got ", dt);
  return dt;
}

// A 4 × 16 × 4 product of ones through oneDNN's micro-kernel with A and B in dtype A (bfloat16
// in VNNI pairs): whether this CPU runs it (oneDNN throws when the CPU lacks the ISA).
template <typename A>
bool brgemm_runs(bool vnni) {
  try {
    std::vector<A> a(4 * 4, A(1.0f)), b(4 * 16, A(1.0f));
    std::vector<float> c(4 * 16);
    brgemm(4, 16, 4, 4, 16, 16, false, a.data(), b.data(), c.data(), vnni);
    brgemm_release(vnni);
    return c[0] == 4.0f;
  } catch (const std::exception&) {
    return false;
  }
}

// Whether oneDNN's micro-kernel multiplies bfloat16 on this CPU (AVX512-BF16 or AMX), asked once.
bool native_bf16() {
  static const bool yes = brgemm_runs<c10::BFloat16>(true);
  return yes;
}

// Whether a forward call in dtype dt multiplies bfloat16 in VNNI pairs (else float32 products,
// 16-bit inputs widened as they are packed): bfloat16, not `widen`, on a CPU that has it. The
// pairs need an even head dim and an even block of rows.
bool bf16_pairs(const char* op, at::ScalarType dt, bool widen, const at::Tensor& q, int64_t bq) {
  if (dt != at::kBFloat16 || widen || !native_bf16()) return false;
  TORCH_CHECK(q.size(2) % 2 == 0 && bq % 2 == 0, "attnlab_band.", op,
              ": bfloat16 pairs need an even head dim and block (widen=True takes any)");
  return true;
}

// What both band operators ask of a call's geometry: blocks of rows inside q, a key limit inside
// k, and an additive tile (1|nblk, 1|H, bq, width).
void check_band_call(const char* op, const at::Tensor& q, const at::Tensor& k,
                     const at::Tensor& add, int64_t r0, int64_t nblk, int64_t bq, int64_t width,
                     int64_t limit) {
  TORCH_CHECK(nblk >= 1 && bq >= 1 && width >= 1, "attnlab_band.", op, ": empty call");
  TORCH_CHECK(r0 >= 0 && r0 + nblk * bq <= q.size(1), "attnlab_band.", op,
              ": rows out of range");
  TORCH_CHECK(limit >= 1 && limit <= k.size(1), "attnlab_band.", op,
              ": limit must be in [1, S], got ", limit);
  TORCH_CHECK((add.size(0) == 1 || add.size(0) == nblk) &&
                  (add.size(1) == 1 || add.size(1) == q.size(0)) && add.size(2) == bq &&
                  add.size(3) == width,
              "attnlab_band.", op, ": add must be (1|nblk, 1|H, bq, width)");
}

// The additive tile padded with −inf to the kernel's row of ws scores (whole vectors).
at::Tensor padded_tile(const at::Tensor& add, int64_t width, int64_t ws) {
  if (ws == width) return add;
  return at::constant_pad_nd(add, {0, ws - width}, -std::numeric_limits<double>::infinity());
}

// The key mask of a band or segment call (one batch item): bool, 1-D over the item's keys, unit
// stride (null when none is given).
const bool* key_mask(const char* op, const std::optional<at::Tensor>& keys,
                         const at::Tensor& k, int64_t end) {
  if (!keys.has_value()) return nullptr;
  const at::Tensor& t = *keys;
  TORCH_CHECK(t.scalar_type() == at::kBool && t.dim() == 1 && t.device().is_cpu() &&
                  (t.stride(0) == 1 || t.size(0) <= 1),
              "attnlab_band.", op, ": keys must be a 1-D unit-stride bool CPU tensor, got ",
              t.scalar_type(), " of shape ", t.sizes());
  TORCH_CHECK(t.size(0) == k.size(1) && end <= t.size(0), "attnlab_band.", op,
              ": keys must hold one entry per key (", k.size(1), "), got ", t.size(0));
  return t.const_data_ptr<bool>();
}

// The attention sinks of a forward call: float32 (H,), unit stride, on the CPU (null when none
// is given): each head's logit joins its rows' denominators (`finish_row`).
const float* sink_logits(const char* op, const std::optional<at::Tensor>& sinks,
                         const at::Tensor& q) {
  if (!sinks.has_value()) return nullptr;
  const at::Tensor& t = *sinks;
  TORCH_CHECK(t.scalar_type() == at::kFloat && t.dim() == 1 && t.device().is_cpu() &&
                  t.size(0) == q.size(0) && (t.stride(0) == 1 || t.size(0) <= 1),
              "attnlab_band.", op, ": sinks must be a unit-stride float32 CPU tensor of shape (",
              q.size(0), ",), got ", t.scalar_type(), " of shape ", t.sizes());
  return t.const_data_ptr<float>();
}

at::Tensor forward_into(at::Tensor out, at::Tensor lse, const at::Tensor& q, const at::Tensor& k,
                        const at::Tensor& v, const at::Tensor& add, int64_t r0, int64_t nblk,
                        int64_t bq, int64_t k_start, int64_t width, int64_t limit, double scale,
                        bool check_inputs_for_nonfinite, bool widen, double softcap,
                        const std::optional<at::Tensor>& keys_,
                        const std::optional<at::Tensor>& sinks_) {
  TORCH_CHECK(softcap >= 0.0, "attnlab_band.forward_into: softcap must be >= 0 (0: none)");
  const float cap = static_cast<float>(softcap);
  const at::ScalarType dt = check_inputs("forward_into", out, q, k, v, 4, /*float_out=*/true);
  const bool bf16 = bf16_pairs("forward_into", dt, widen, q, bq);
  check(add, "forward_into", "add", 4);
  TORCH_CHECK(lse.dim() == 3 && lse.scalar_type() == at::kFloat,
              "attnlab_band.forward_into: lse must be 3-D float32");
  TORCH_CHECK(add.scalar_type() == at::kFloat, "attnlab_band.forward_into: add must be float32");
  check_band_call("forward_into", q, k, add, r0, nblk, bq, width, limit);
  TORCH_CHECK(out.sizes() == at::IntArrayRef({nblk, q.size(0), bq, v.size(2)}) &&
                  lse.sizes() == at::IntArrayRef({nblk, q.size(0), bq}),
              "attnlab_band.forward_into: out must be (nblk, H, bq, Dv), lse (nblk, H, bq)");
  const at::Tensor addp = padded_tile(add, width, score_cols(width, bf16));
  const bool* keys = key_mask("forward_into", keys_, k, 0);
  const float* sinks = sink_logits("forward_into", sinks_, q);
  populate(out);
  std::atomic<bool> bad{false};
  std::atomic<bool>* seen = check_inputs_for_nonfinite ? &bad : nullptr;
  const bool float_out = out.scalar_type() == at::kFloat;  // partial outputs merged in float32
  auto run = [&](auto in_type, auto out_type) {
    using T = decltype(in_type);
    using TO = decltype(out_type);
    band_forward<T, TO>(out, lse, q, k, v, addp, r0, nblk, bq, k_start, width, limit, scale,
                        seen, cap, keys, sinks);
  };
  if (dt == at::kFloat) {
    run(float{}, float{});
  } else if (bf16) {
    float_out ? run(c10::BFloat16{}, float{}) : run(c10::BFloat16{}, c10::BFloat16{});
  } else if (dt == at::kBFloat16) {
    float_out ? run(WideBF16{}, float{}) : run(WideBF16{}, WideBF16{});
  } else {
    float_out ? run(c10::Half{}, float{}) : run(c10::Half{}, c10::Half{});
  }
  return at::empty({bad.load() ? 1 : 0}, q.options().dtype(at::kByte));
}

void segments_into(at::Tensor out, at::Tensor lse, const at::Tensor& q, const at::Tensor& k,
                   const at::Tensor& v, int64_t start, int64_t n, int64_t count, bool causal,
                   int64_t bq, double scale, bool widen, double softcap,
                   const std::optional<at::Tensor>& keys_,
                   const std::optional<at::Tensor>& sinks_) {
  TORCH_CHECK(softcap >= 0.0, "attnlab_band.segments_into: softcap must be >= 0 (0: none)");
  const float cap = static_cast<float>(softcap);  // 0: none
  const at::ScalarType dt = check_inputs("segments_into", out, q, k, v, 3);
  const bool bf16 = bf16_pairs("segments_into", dt, widen, q, bq);
  TORCH_CHECK(lse.dim() == 2 && lse.scalar_type() == at::kFloat,
              "attnlab_band.segments_into: lse must be 2-D float32");
  TORCH_CHECK(n >= 1 && count >= 1 && bq >= 1, "attnlab_band.segments_into: empty call");
  TORCH_CHECK(start >= 0 && start + count * n <= std::min(q.size(1), k.size(1)),
              "attnlab_band.segments_into: segments out of range");
  TORCH_CHECK(out.size(0) == q.size(0) && out.size(1) == q.size(1) && out.size(2) == v.size(2) &&
                  lse.size(0) == q.size(0) && lse.size(1) == q.size(1),
              "attnlab_band.segments_into: out must be (H, L, Dv), lse (H, L)");
  TORCH_CHECK(!bf16 || n % 2 == 0,
              "attnlab_band.segments_into: bfloat16 pairs need an even segment length");
  const bool* keys = key_mask("segments_into", keys_, k, start + count * n);
  const float* sinks = sink_logits("segments_into", sinks_, q);
  populate(out.narrow(1, start, count * n));
  auto run = [&](auto in_type) {
    segment_forward<decltype(in_type)>(out, lse, q, k, v, start, n, count, causal, bq, scale,
                                       cap, keys, sinks);
  };
  if (bf16) {
    run(c10::BFloat16{});
  } else if (dt == at::kBFloat16) {
    run(WideBF16{});
  } else if (dt == at::kHalf) {
    run(c10::Half{});
  } else {
    run(float{});
  }
}

// What both backward operators ask: float32 q, k, v (one batch item, `check_inputs`), dq, dk, dv
// shaped like them, out and dout (H, L, Dv), lse (H, L).
void check_backward(const char* op, const at::Tensor& dq, const at::Tensor& dk,
                    const at::Tensor& dv, const at::Tensor& q, const at::Tensor& k,
                    const at::Tensor& v, const at::Tensor& out, const at::Tensor& dout,
                    const at::Tensor& lse, bool out_like_q = false) {
  check_inputs(op, out, q, k, v, 3, /*float_out=*/true);
  check(dq, op, "dq", 3);
  check(dk, op, "dk", 3);
  check(dv, op, "dv", 3);
  check(dout, op, "dout", 3);
  TORCH_CHECK(dout.scalar_type() == q.scalar_type(), "attnlab_band.", op,
              ": dout must have q's dtype, got ", dout.scalar_type());
  for (const at::ScalarType t :
       {dq.scalar_type(), dk.scalar_type(), dv.scalar_type(), lse.scalar_type()}) {
    TORCH_CHECK(t == at::kFloat, "attnlab_band.", op, ": float32 lse, dq, dk, dv, got ", t);
  }
  TORCH_CHECK(out.scalar_type() == at::kFloat || out_like_q, "attnlab_band.", op,
              ": out must be float32, got ", out.scalar_type());
  TORCH_CHECK(dq.sizes() == q.sizes() && dk.sizes() == k.sizes() && dv.sizes() == v.sizes() &&
                  dout.sizes() == out.sizes() && out.size(0) == q.size(0) &&
                  out.size(1) == q.size(1) && out.size(2) == v.size(2),
              "attnlab_band.", op, ": dq, dk, dv like q, k, v; out and dout (H, L, Dv)");
  TORCH_CHECK(lse.dim() == 2 && lse.size(0) == q.size(0) && lse.size(1) == q.size(1),
              "attnlab_band.", op, ": lse must be (H, L)");
}

// The optional δ output of a backward operator: float32 (H, L) on the CPU.
DeltaOut delta_out(const char* op, const std::optional<at::Tensor>& delta, const at::Tensor& q) {
  if (delta.has_value()) {
    const at::Tensor& t = *delta;
    TORCH_CHECK(t.scalar_type() == at::kFloat && t.dim() == 2 && t.size(0) == q.size(0) &&
                    t.size(1) == q.size(1) && t.device().is_cpu(),
                "attnlab_band.", op, ": delta must be a float32 CPU tensor of shape (",
                q.size(0), ", ", q.size(1), "), got ", t.scalar_type(), " of shape ", t.sizes());
  }
  return DeltaOut(delta);
}

void backward_into(at::Tensor dq, at::Tensor dk, at::Tensor dv, const at::Tensor& q,
                   const at::Tensor& k, const at::Tensor& v, const at::Tensor& out,
                   const at::Tensor& dout, const at::Tensor& lse, const at::Tensor& add,
                   int64_t r0, int64_t nblk, int64_t bq, int64_t k_start, int64_t width,
                   int64_t limit, double scale, bool own_delta,
                   const std::optional<at::Tensor>& keys_,
                   const std::optional<at::Tensor>& delta_) {
  check_backward("backward_into", dq, dk, dv, q, k, v, out, dout, lse);
  const DeltaOut dd = delta_out("backward_into", delta_, q);
  const bool* keys = key_mask("backward_into", keys_, k, 0);
  check(add, "backward_into", "add", 4);
  TORCH_CHECK(add.scalar_type() == at::kFloat, "attnlab_band.backward_into: add must be float32");
  check_band_call("backward_into", q, k, add, r0, nblk, bq, width, limit);
  const at::Tensor addp = padded_tile(add, width, score_cols(width, false));
  auto run = [&](auto in_type) {
    band_backward<decltype(in_type)>(dq, dk, dv, q, k, v, out, dout, lse, addp, r0, nblk, bq,
                                     k_start, width, limit, scale, own_delta, keys, dd);
  };
  switch (q.scalar_type()) {  // every product in float32: 16-bit inputs widened as packed
    case at::kFloat: return run(float{});
    case at::kHalf: return run(c10::Half{});
    default: return run(WideBF16{});
  }
}

void segments_backward_into(at::Tensor dq, at::Tensor dk, at::Tensor dv, const at::Tensor& q,
                            const at::Tensor& k, const at::Tensor& v, const at::Tensor& out,
                            const at::Tensor& dout, const at::Tensor& lse, int64_t start,
                            int64_t n, int64_t count, bool causal, int64_t bq, double scale,
                            const std::optional<at::Tensor>& keys_,
                            const std::optional<at::Tensor>& delta_) {
  check_backward("segments_backward_into", dq, dk, dv, q, k, v, out, dout, lse,
                 /*out_like_q=*/true);
  const DeltaOut dd = delta_out("segments_backward_into", delta_, q);
  TORCH_CHECK(n >= 1 && count >= 1 && bq >= 1, "attnlab_band.segments_backward_into: empty call");
  TORCH_CHECK(start >= 0 && start + count * n <= std::min(q.size(1), k.size(1)),
              "attnlab_band.segments_backward_into: segments out of range");
  const bool* keys = key_mask("segments_backward_into", keys_, k, start + count * n);
  const bool wide_out = out.scalar_type() == at::kFloat;
  auto run = [&](auto in_type) {
    using T = decltype(in_type);
    if (wide_out) {
      segment_backward<T, float>(dq, dk, dv, q, k, v, out, dout, lse, start, n, count, causal,
                                 bq, scale, keys, dd);
    } else if constexpr (!std::is_same_v<T, float>) {
      segment_backward<T, T>(dq, dk, dv, q, k, v, out, dout, lse, start, n, count, causal, bq,
                             scale, keys, dd);
    }
  };
  switch (q.scalar_type()) {  // every product in float32: 16-bit inputs widened as packed
    case at::kFloat: return run(float{});
    case at::kHalf: return run(c10::Half{});
    default: return run(WideBF16{});
  }
}

bool supported(at::ScalarType dtype) {
  // the float32 micro-kernel: float16, and bfloat16 without `native_bf16`, run float32 products
  const bool ours = dtype == at::kFloat || dtype == at::kHalf || dtype == at::kBFloat16;
  return ours && brgemm_runs<float>(false);
}

int64_t segment_span() { return kSegmentSpan; }

bool native(at::ScalarType dtype) {
  return dtype == at::kFloat || (dtype == at::kBFloat16 && native_bf16());
}

}  // namespace

TORCH_LIBRARY(attnlab_band, m) {
  m.def(
      "forward_into(Tensor(a!) out, Tensor(b!) lse, Tensor q, Tensor k, Tensor v, Tensor add, "
      "int r0, int nblk, int bq, int k_start, int width, int limit, float scale, "
      "bool check=False, bool widen=False, float softcap=0.0, Tensor? keys=None, "
      "Tensor? sinks=None) -> Tensor");
  m.def(
      "segments_into(Tensor(a!) out, Tensor(b!) lse, Tensor q, Tensor k, Tensor v, int start, "
      "int n, int count, bool causal, int bq, float scale, bool widen=False, "
      "float softcap=0.0, Tensor? keys=None, Tensor? sinks=None) -> ()");
  m.def(
      "backward_into(Tensor(a!) dq, Tensor(b!) dk, Tensor(c!) dv, Tensor q, Tensor k, Tensor v, "
      "Tensor out, Tensor dout, Tensor lse, Tensor add, int r0, int nblk, int bq, int k_start, "
      "int width, int limit, float scale, bool own_delta=False, Tensor? keys=None, "
      "Tensor(d!)? delta=None) -> ()");
  m.def(
      "segments_backward_into(Tensor(a!) dq, Tensor(b!) dk, Tensor(c!) dv, Tensor q, Tensor k, "
      "Tensor v, Tensor out, Tensor dout, Tensor lse, int start, int n, int count, bool causal, "
      "int bq, float scale, Tensor? keys=None, Tensor(d!)? delta=None) -> ()");
  m.def("supported(ScalarType dtype) -> bool", &supported);
  m.def("native(ScalarType dtype) -> bool", &native);
  m.def("segment_span() -> int", &segment_span);
}

TORCH_LIBRARY_IMPL(attnlab_band, CPU, m) {
  m.impl("forward_into", &forward_into);
  m.impl("segments_into", &segments_into);
  m.impl("backward_into", &backward_into);
  m.impl("segments_backward_into", &segments_backward_into);
}
