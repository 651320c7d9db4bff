// Shared by the _ext sources: `_ext.load` pastes this file in place of its #include line, so
// the build cache key covers it. Bit tests for non-finite values of every float dtype.
#pragma once

#include <c10/util/BFloat16.h>
#include <c10/util/Half.h>

#include <cstdint>

namespace attnlab_bits {

// A value is non-finite iff its exponent bits are all ones (inf or NaN).
template <typename T> struct Bits;
template <> struct Bits<float> {
  using U = uint32_t;
  static constexpr U kExp = 0x7f800000u;
};
template <> struct Bits<double> {
  using U = uint64_t;
  static constexpr U kExp = 0x7ff0000000000000ull;
};
template <> struct Bits<c10::BFloat16> {
  using U = uint16_t;
  static constexpr U kExp = 0x7f80u;
};
template <> struct Bits<c10::Half> {
  using U = uint16_t;
  static constexpr U kExp = 0x7c00u;
};

// True iff some of the n contiguous values at p is non-finite (branch-free, vectorisable).
template <typename T>
inline bool span_bad(const T* p, int64_t n) {
  using U = typename Bits<T>::U;
  constexpr U E = Bits<T>::kExp;
  const U* u = reinterpret_cast<const U*>(p);
  U acc = 0;
  for (int64_t j = 0; j < n; ++j) acc |= static_cast<U>(((u[j] & E) == E) ? 1 : 0);
  return acc != 0;
}

}  // namespace attnlab_bits
