// Shared by the _ext sources: `_ext.load` pastes this file in place of its #include line, so
// the build cache key covers it. A float32 exp for softmax numerators that vectorizes in plain
// loops (no libm call per lane), and the bit casts it needs.
#pragma once

#include <algorithm>
#include <cmath>
#include <cstdint>
#include <cstring>

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

// exp(x) for x <= 0 in float64 (the float64 path is a reference, not a fast path).
inline double exp_neg(double x) { return std::exp(x); }

}  // namespace attnlab_exp
