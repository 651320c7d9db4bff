// The flash backend's NaN-rule cleaning as one CPU operator (see attnlab/functional/nan_rule.py,
// `clean_flagged`).
//
//   attnlab_flash::clean_copy(x) -> Tensor
//       nan_to_num(x, 0, 0, 0) when x holds a NaN/±inf entry, else an EMPTY tensor (numel 0):
//       for finite inputs the cost is one read of x, and the caller keeps x itself (no copy).
//       Whether a copy was made is told by the result's shape, so the caller branches on
//       metadata and never reads a tensor value on the host.
#include <ATen/ATen.h>
#include <ATen/Parallel.h>
#include <torch/library.h>

#include <atomic>
#include <cstdint>

#include "nonfinite.h"

namespace {

using attnlab_bits::Bits;
using attnlab_bits::span_bad;

template <typename T>
bool any_bad(const at::Tensor& x) {
  // x is contiguous: scan it in chunks (every thread stops once some chunk found one)
  const T* p = x.const_data_ptr<T>();
  const int64_t n = x.numel();
  constexpr int64_t kChunk = 1 << 14;
  std::atomic<bool> found{false};
  at::parallel_for(0, (n + kChunk - 1) / kChunk, 1, [&](int64_t begin, int64_t end) {
    for (int64_t c = begin; c < end && !found.load(std::memory_order_relaxed); ++c) {
      const int64_t a = c * kChunk, b = std::min(n, a + kChunk);
      if (span_bad(p + a, b - a)) found.store(true, std::memory_order_relaxed);
    }
  });
  return found.load();
}

at::Tensor clean_copy(const at::Tensor& x_) {
  TORCH_CHECK(x_.device().is_cpu(), "attnlab_flash.clean_copy: CPU tensors only");
  const at::Tensor x = x_.is_contiguous() ? x_ : x_.contiguous();
  bool bad = false;
  switch (x.scalar_type()) {
    case at::kFloat: bad = any_bad<float>(x); break;
    case at::kDouble: bad = any_bad<double>(x); break;
    case at::kBFloat16: bad = any_bad<c10::BFloat16>(x); break;
    case at::kHalf: bad = any_bad<c10::Half>(x); break;
    default: TORCH_CHECK(false, "attnlab_flash.clean_copy: unsupported dtype ", x.scalar_type());
  }
  if (!bad) return at::empty({0}, x_.options());
  return at::nan_to_num(x_, 0.0, 0.0, 0.0);
}

}  // namespace

TORCH_LIBRARY(attnlab_flash, m) { m.def("clean_copy(Tensor x) -> Tensor"); }

TORCH_LIBRARY_IMPL(attnlab_flash, CPU, m) { m.impl("clean_copy", &clean_copy); }
