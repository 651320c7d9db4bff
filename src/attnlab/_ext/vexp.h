// Shared by the _ext sources: `_ext.load` pastes this file in place of its #include line, so
// the build cache key covers it. A float32 exp for softmax numerators that vectorizes in plain
// loops (no libm call per lane), and the bit casts it needs.
#pragma once

#include <algorithm>
#include <cmath>
#include <cstdint>
#include <cstring>
#if !defined(__AVX512F__) && defined(__AVX2__) && defined(__FMA__)
#include <immintrin.h>
#endif

namespace attnlab_exp {

inline uint32_t bits(float f) {
  uint32_t u;
  std::memcpy(&u, &f, 4);
  return u;
}

inline float from_bits(uint32_t u) {
  float f;
  std::memcpy(&f, &u, 4);
  return f;
}

// exp(x) for x <= 0 with ~1 ulp error (Cephes expf: x = n·ln2 + r, |r| <= ln2/2, degree-6
// polynomial in fused multiply-adds; n rounded with the 1.5·2^23 trick so the loop
// vectorizes); exactly 0 below −87.3 (and for −inf): a masked key weighs exactly nothing.
inline float exp_neg(float x) {
  const float xc = std::max(x, -87.3f);
  const float n = std::fma(xc, 1.44269504088896341f, 12582912.0f) - 12582912.0f;
  const float r = std::fma(n, 2.12194440e-4f, std::fma(n, -0.693359375f, xc));
  float p = 1.9875691500e-4f;
  p = std::fma(p, r, 1.3981999507e-3f);
  p = std::fma(p, r, 8.3334519073e-3f);
  p = std::fma(p, r, 4.1665795894e-2f);
  p = std::fma(p, r, 1.6666665459e-1f);
  p = std::fma(p, r, 5.0000001201e-1f);
  p = std::fma(p * r, r, r + 1.0f);
  const float two_n = from_bits(static_cast<uint32_t>(static_cast<int32_t>(n) + 127) << 23);
  return x < -87.3f ? 0.0f : p * two_n;
}

#if !defined(__AVX512F__) && defined(__AVX2__) && defined(__FMA__)
// exp_neg on 8 lanes, operation for operation (the same results as the scalar function).
inline __m256 exp_neg8(__m256 x) {
  const __m256 lim = _mm256_set1_ps(-87.3f);
  const __m256 xc = _mm256_max_ps(lim, x);  // NaN stays NaN, as in std::max(x, lim)
  const __m256 big = _mm256_set1_ps(12582912.0f);
  const __m256 n =
      _mm256_sub_ps(_mm256_fmadd_ps(xc, _mm256_set1_ps(1.44269504088896341f), big), big);
  const __m256 r = _mm256_fmadd_ps(
      n, _mm256_set1_ps(2.12194440e-4f), _mm256_fmadd_ps(n, _mm256_set1_ps(-0.693359375f), xc));
  __m256 p = _mm256_fmadd_ps(_mm256_set1_ps(1.9875691500e-4f), r, _mm256_set1_ps(1.3981999507e-3f));
  p = _mm256_fmadd_ps(p, r, _mm256_set1_ps(8.3334519073e-3f));
  p = _mm256_fmadd_ps(p, r, _mm256_set1_ps(4.1665795894e-2f));
  p = _mm256_fmadd_ps(p, r, _mm256_set1_ps(1.6666665459e-1f));
  p = _mm256_fmadd_ps(p, r, _mm256_set1_ps(5.0000001201e-1f));
  p = _mm256_fmadd_ps(_mm256_mul_ps(p, r), r, _mm256_add_ps(r, _mm256_set1_ps(1.0f)));
  const __m256i e = _mm256_slli_epi32(
      _mm256_add_epi32(_mm256_cvttps_epi32(n), _mm256_set1_epi32(127)), 23);
  const __m256 y = _mm256_mul_ps(p, _mm256_castsi256_ps(e));
  return _mm256_andnot_ps(_mm256_cmp_ps(x, lim, _CMP_LT_OQ), y);  // x < −87.3: 0
}
#endif

// exp(x) for x <= 0 in float64 (the float64 path is a reference, not a fast path).
inline double exp_neg(double x) { return std::exp(x); }

// tanh(x) in float32 within ~2 ulp that vectorizes in plain loops (Gemma 2's logit
// soft-capping): x + x·z·P(z), z = x², for |x| < 0.625 (Cephes' float fit), else
// sign(x)·(1 − e)/(1 + e) with e = exp(−2|x|), |x| clamped to 9 (tanh(9) rounds to 1).
// band_attn.cpp's tanh16 / tanh8 are its explicit 16- and 8-lane forms.
inline float tanh_f(float x) {
  const float ax = std::min(std::fabs(x), 9.0f);
  const float z = x * x;
  float p = std::fma(-5.70498872745e-3f, z, 2.06390887954e-2f);
  p = std::fma(p, z, -5.37397155531e-2f);
  p = std::fma(p, z, 1.33314422036e-1f);
  p = std::fma(p, z, -3.33332819422e-1f);
  const float small = std::fma(x * z, p, x);
  const float e = exp_neg(-2.0f * ax);
  const float big = std::copysign((1.0f - e) / (1.0f + e), x);
  return ax < 0.625f ? small : big;
}

// tanh in float64: std::tanh (the reference path).
inline double tanh_f(double x) { return std::tanh(x); }

}  // namespace attnlab_exp
