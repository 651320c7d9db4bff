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

#include <algorithm>
#include <atomic>
#include <cstdint>
#include <utility>

#include "nonfinite.h"

namespace {

using attnlab_bits::Bits;
using attnlab_bits::span_bad;

// Whether x holds a NaN/±inf entry, read in place whatever its strides. Only which values x
// holds matters, not their order: dims of one index or of stride 0 (expanded) are dropped, the
// others taken in order of stride, and the innermost ones laid out densely merge into rows of
// contiguous values. So any permutation of a dense block — (B, L, H, D).transpose(1, 2), the
// layout transformers hands over — is one span, and a slice x[:, :, a:b] of a (B, H, L, D)
// tensor is B·H rows of (b − a)·D values.
template <typename T>
bool any_bad(const at::Tensor& x) {
  const T* p = x.const_data_ptr<T>();
  c10::SmallVector<std::pair<int64_t, int64_t>, 8> dims;  // (stride, size)
  for (int64_t i = 0; i < x.dim(); ++i) {
    if (x.size(i) > 1 && x.stride(i) != 0) dims.emplace_back(x.stride(i), x.size(i));
  }
  std::sort(dims.begin(), dims.end());
  int64_t inner = 1;
  size_t dense = 0;
  while (dense < dims.size() && dims[dense].first == inner) inner *= dims[dense++].second;
  // the rows' dims, largest stride first
  c10::SmallVector<int64_t, 8> size, stride;
  for (size_t i = dims.size(); i-- > dense;) {
    size.push_back(dims[i].second);
    stride.push_back(dims[i].first);
  }
  const int64_t nd = static_cast<int64_t>(size.size());
  int64_t rows = 1;
  for (const int64_t n : size) rows *= n;
  // work units of about kChunk values: a piece of a long row, or a run of short rows; every
  // thread stops once some unit found one
  constexpr int64_t kChunk = 1 << 14;
  const int64_t pieces = (inner + kChunk - 1) / kChunk;  // per row
  const int64_t run = pieces > 1 ? 1 : std::max<int64_t>(1, kChunk / inner);  // rows per unit
  const int64_t units = pieces > 1 ? rows * pieces : (rows + run - 1) / run;
  std::atomic<bool> found{false};
  at::parallel_for(0, units, 1, [&](int64_t begin, int64_t end) {
    c10::SmallVector<int64_t, 8> index(nd);
    for (int64_t u = begin; u < end && !found.load(std::memory_order_relaxed); ++u) {
      const int64_t r0 = pieces > 1 ? u / pieces : u * run;
      const int64_t r1 = pieces > 1 ? r0 + 1 : std::min(rows, r0 + run);
      int64_t offset = 0, rest = r0;  // row r0's first value
      for (int64_t i = nd - 1; i >= 0; --i) {
        index[i] = rest % size[i];
        rest /= size[i];
        offset += index[i] * stride[i];
      }
      bool bad = false;
      for (int64_t r = r0; r < r1 && !bad; ++r) {
        if (pieces > 1) {
          const int64_t a = u % pieces * kChunk;
          bad = span_bad(p + offset + a, std::min(kChunk, inner - a));
        } else {
          bad = span_bad(p + offset, inner);
        }
        for (int64_t i = nd - 1; i >= 0; --i) {  // the next row: an odometer over the dims
          offset += stride[i];
          if (++index[i] < size[i]) break;
          offset -= size[i] * stride[i];
          index[i] = 0;
        }
      }
      if (bad) found.store(true, std::memory_order_relaxed);
    }
  });
  return found.load();
}

at::Tensor clean_copy(const at::Tensor& x) {
  TORCH_CHECK(x.device().is_cpu(), "attnlab_flash.clean_copy: CPU tensors only");
  if (x.numel() == 0) return at::empty({0}, x.options());
  bool bad = false;
  switch (x.scalar_type()) {  // read in place, whatever its strides (no contiguous copy)
    case at::kFloat: bad = any_bad<float>(x); break;
    case at::kDouble: bad = any_bad<double>(x); break;
    case at::kBFloat16: bad = any_bad<c10::BFloat16>(x); break;
    case at::kHalf: bad = any_bad<c10::Half>(x); break;
    default: TORCH_CHECK(false, "attnlab_flash.clean_copy: unsupported dtype ", x.scalar_type());
  }
  if (!bad) return at::empty({0}, x.options());
  return at::nan_to_num(x, 0.0, 0.0, 0.0);
}

}  // namespace

TORCH_LIBRARY(attnlab_flash, m) { m.def("clean_copy(Tensor x) -> Tensor"); }

TORCH_LIBRARY_IMPL(attnlab_flash, CPU, m) { m.impl("clean_copy", &clean_copy); }
