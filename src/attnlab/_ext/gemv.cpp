// A linear layer on a few rows, streaming its weight once: decode steps (attnlab/models, see
// attnlab/modules/stream_linear.py).
//
//   attnlab_gemv::linear(x, w, b, rows_per_pass=0) -> y
//       x (..., K) whose M = numel / K rows (M <= kMaxRows) view as (M, K) with unit stride in K;
//       w (N, K) contiguous (nn.Linear's weight); b (N,) contiguous or None; float32 or
//       bfloat16, all one dtype:
//           y = x·wᵀ + b   (..., N) in x's dtype, float32 accumulation, one rounding.
//       rows_per_pass: rows of w streamed side by side (1, 2 or 4; 0: this CPU's default for
//       the dtype, `default_rows_per_pass`).
//   attnlab_gemv::supported(dtype) -> bool: this build has the kernel for that dtype (float32
//       and bfloat16 everywhere: AVX-512F / AVX512-BF16 loops where the CPU has them, else the
//       portable 8-lane loop below, which compilers turn into AVX2 FMAs).
//
// Why: with a few rows the product is bound by reading w. torch's kernel reads a (4 × 512) ·
// (512 × 1368) bfloat16 weight at ~11–17 GB/s on one AMD EPYC core, where a plain streaming loop
// reads at ~30 GB/s. Here each weight row is read once, in order, against every row of x (held
// in L1): one 16-lane float32 accumulator per (row of x, row of w), fused multiply-adds in
// float32 or AVX512-BF16 pair dot products (bfloat16 products are exact in float32), reduced at
// the end of the row. Rows of w are split between threads.
#include <ATen/ATen.h>
#include <ATen/Parallel.h>
#include <torch/library.h>

#if defined(__AVX512F__)
#include <immintrin.h>
#endif

#include <algorithm>
#include <cstdint>
#include <cstring>
#include <optional>
#include <type_traits>
#include <vector>

namespace {

constexpr int64_t kMaxRows = 8;  // rows of x: one accumulator each per row of w
constexpr int64_t kAhead = 4;    // software prefetch distance, in rows of w

// Rows of w per pass by default: one, read strictly in order, on AMD (Zen 4: the fastest);
// elsewhere four in float32 and two in bfloat16 (one core of a Xeon with AMX, the 41 weights of
// a 38M-parameter model, best of 9, 1 / 2 / 4 rows per pass: float32 one row of x 13.22 / 11.51
// / 11.31 ms, four rows 14.91 / 13.96 / 12.28; bfloat16 one row 6.46 / 5.80 / 5.82, four rows
// 7.69 / 7.17 / 8.63 ms).
int64_t default_rows_per_pass(at::ScalarType dtype) {
  static const bool amd = __builtin_cpu_is("amd");
  return amd ? 1 : dtype == at::kFloat ? 4 : 2;
}

#if defined(__AVX512F__)
// y[m][n0 .. n0 + NR) for all m < M: NR (1, 2 or 4) rows of w against every row of x.
template <int M, int NR>
inline void rows_f32(const float* x, int64_t xs, const float* w, int64_t K, const float* b,
                     float* out, int64_t os) {
  __m512 acc[M][NR];
  for (int m = 0; m < M; ++m)
    for (int r = 0; r < NR; ++r) acc[m][r] = _mm512_setzero_ps();
  for (int64_t k = 0; k < K; k += 16) {
    const __mmask16 mk = K - k >= 16 ? __mmask16(0xFFFF) : __mmask16((1u << (K - k)) - 1);
    __m512 wv[NR];
    for (int r = 0; r < NR; ++r) {
      // the same columns of the next pass's rows: one pass ahead of the hardware prefetcher,
      // which restarts on every short row
      _mm_prefetch(reinterpret_cast<const char*>(w + (kAhead + r) * K + k), _MM_HINT_T0);
      wv[r] = _mm512_maskz_loadu_ps(mk, w + r * K + k);
    }
    for (int m = 0; m < M; ++m) {
      const __m512 xv = _mm512_maskz_loadu_ps(mk, x + m * xs + k);
      for (int r = 0; r < NR; ++r) acc[m][r] = _mm512_fmadd_ps(xv, wv[r], acc[m][r]);
    }
  }
  for (int m = 0; m < M; ++m)
    for (int r = 0; r < NR; ++r) {
      // the float32 sum plus the bias, rounded once to the output dtype (as torch's addmm)
      const float bias = b ? static_cast<float>(b[r]) : 0.0f;
      out[m * os + r] = _mm512_reduce_add_ps(acc[m][r]) + bias;
    }
}
#endif

#if defined(__AVX512BF16__)
template <int M, int NR>
inline void rows_bf16(const c10::BFloat16* x, int64_t xs, const c10::BFloat16* w, int64_t K,
                      const c10::BFloat16* b, c10::BFloat16* out, int64_t os) {
  __m512 acc[M][NR];
  for (int m = 0; m < M; ++m)
    for (int r = 0; r < NR; ++r) acc[m][r] = _mm512_setzero_ps();
  for (int64_t k = 0; k < K; k += 32) {
    const int64_t left = K - k;
    const __mmask32 mk = left >= 32 ? __mmask32(0xFFFFFFFFu) : __mmask32((1u << left) - 1);
    __m512bh wv[NR];
    for (int r = 0; r < NR; ++r) {
      _mm_prefetch(reinterpret_cast<const char*>(w + (kAhead + r) * K + k), _MM_HINT_T0);
      wv[r] = (__m512bh)_mm512_maskz_loadu_epi16(mk, w + r * K + k);
    }
    for (int m = 0; m < M; ++m) {
      const __m512bh xv = (__m512bh)_mm512_maskz_loadu_epi16(mk, x + m * xs + k);
      for (int r = 0; r < NR; ++r) acc[m][r] = _mm512_dpbf16_ps(acc[m][r], xv, wv[r]);
    }
  }
  for (int m = 0; m < M; ++m)
    for (int r = 0; r < NR; ++r) {
      // the float32 sum plus the bias, rounded once to the output dtype (as torch's addmm)
      const float bias = b ? static_cast<float>(b[r]) : 0.0f;
      out[m * os + r] = _mm512_reduce_add_ps(acc[m][r]) + bias;
    }
}
#endif

// The same as rows_f32 / rows_bf16 in portable C++ (GCC/Clang vector types of 8 floats: one
// AVX2 register, so that M × NR accumulators stay in the 16 registers): each weight row is read
// once, in order, against every row of x; bfloat16 is widened exactly (its bits << 16) before
// the float32 FMAs; the K % 8 tail is read through zero-padded copies. Used where the CPU lacks
// AVX-512F (float32) or AVX512-BF16 (bfloat16).
using V8 = float __attribute__((vector_size(32)));

inline V8 load8(const float* p) {
  V8 v;
  std::memcpy(&v, p, sizeof(v));
  return v;
}

inline V8 load8(const c10::BFloat16* p) {
  using U16 = uint16_t __attribute__((vector_size(16)));
  using U32 = uint32_t __attribute__((vector_size(32)));
  U16 h;
  std::memcpy(&h, p, sizeof(h));
  const U32 u = __builtin_convertvector(h, U32) << 16;
  V8 v;
  std::memcpy(&v, &u, sizeof(v));
  return v;
}

inline float sum8(V8 v) {
  float t[8];
  std::memcpy(t, &v, sizeof(t));
  return ((t[0] + t[4]) + (t[1] + t[5])) + ((t[2] + t[6]) + (t[3] + t[7]));
}

template <int M, int NR, typename T>
inline void rows_portable(const T* x, int64_t xs, const T* w, int64_t K, const T* b, T* out,
                          int64_t os) {
  V8 acc[M][NR];
  for (int m = 0; m < M; ++m)
    for (int r = 0; r < NR; ++r) acc[m][r] = V8{};
  int64_t k = 0;
  for (; k + 8 <= K; k += 8) {
    V8 wv[NR];
    for (int r = 0; r < NR; ++r) {
      __builtin_prefetch(w + (kAhead + r) * K + k, 0, 3);
      wv[r] = load8(w + r * K + k);
    }
    for (int m = 0; m < M; ++m) {
      const V8 xv = load8(x + m * xs + k);
      for (int r = 0; r < NR; ++r) acc[m][r] += xv * wv[r];
    }
  }
  if (k < K) {  // the tail through zero-padded copies
    T wt[NR][8] = {}, xt[M][8] = {};
    for (int r = 0; r < NR; ++r) std::copy(w + r * K + k, w + r * K + K, wt[r]);
    for (int m = 0; m < M; ++m) std::copy(x + m * xs + k, x + m * xs + K, xt[m]);
    for (int m = 0; m < M; ++m)
      for (int r = 0; r < NR; ++r) acc[m][r] += load8(xt[m]) * load8(wt[r]);
  }
  for (int m = 0; m < M; ++m)
    for (int r = 0; r < NR; ++r) {
      // the float32 sum plus the bias, rounded once to the output dtype (as torch's addmm)
      const float bias = b ? static_cast<float>(b[r]) : 0.0f;
      out[m * os + r] = sum8(acc[m][r]) + bias;
    }
}

// y (M, N) float32 for a compile-time number of rows M of x, `pass` (1, 2 or 4) rows of w at a
// time; rows of w split between threads (grain: ~256 KiB of weight).
template <typename T, int M>
void run_rows(const T* x, int64_t xs, const T* w, int64_t N, int64_t K, const T* b, T* y,
              int64_t pass) {
  const int64_t grain = std::max<int64_t>(4, (int64_t{1} << 18) / (K * sizeof(T)));
  at::parallel_for(0, N, grain, [&](int64_t n0, int64_t n1) {
    auto rows = [&](auto nr, int64_t n) {
      constexpr int NR = decltype(nr)::value;
      if constexpr (std::is_same_v<T, float>) {
#if defined(__AVX512F__)
        rows_f32<M, NR>(x, xs, w + n * K, K, b ? b + n : nullptr, y + n, N);
#else
        rows_portable<M, NR>(x, xs, w + n * K, K, b ? b + n : nullptr, y + n, N);
#endif
      } else {
#if defined(__AVX512BF16__)
        rows_bf16<M, NR>(x, xs, w + n * K, K, b ? b + n : nullptr, y + n, N);
#else
        rows_portable<M, NR>(x, xs, w + n * K, K, b ? b + n : nullptr, y + n, N);
#endif
      }
    };
    int64_t n = n0;
    if (pass == 4) {
      for (; n + 4 <= n1; n += 4) rows(std::integral_constant<int, 4>{}, n);
    }
    if (pass >= 2) {
      for (; n + 2 <= n1; n += 2) rows(std::integral_constant<int, 2>{}, n);
    }
    for (; n < n1; ++n) rows(std::integral_constant<int, 1>{}, n);
  });
}

template <typename T>
void run(const T* x, int64_t xs, int64_t M, const T* w, int64_t N, int64_t K, const T* b, T* y,
         int64_t pass) {
  switch (M) {
    case 1: return run_rows<T, 1>(x, xs, w, N, K, b, y, pass);
    case 2: return run_rows<T, 2>(x, xs, w, N, K, b, y, pass);
    case 3: return run_rows<T, 3>(x, xs, w, N, K, b, y, pass);
    case 4: return run_rows<T, 4>(x, xs, w, N, K, b, y, pass);
    case 5: return run_rows<T, 5>(x, xs, w, N, K, b, y, pass);
    case 6: return run_rows<T, 6>(x, xs, w, N, K, b, y, pass);
    case 7: return run_rows<T, 7>(x, xs, w, N, K, b, y, pass);
    default: return run_rows<T, 8>(x, xs, w, N, K, b, y, pass);
  }
}

bool supported(at::ScalarType dtype) {
  return dtype == at::kFloat || dtype == at::kBFloat16;
}

at::Tensor linear(const at::Tensor& x_in, const at::Tensor& w, const std::optional<at::Tensor>& b,
                  int64_t rows_per_pass) {
  TORCH_CHECK(rows_per_pass == 0 || rows_per_pass == 1 || rows_per_pass == 2 || rows_per_pass == 4,
              "attnlab_gemv.linear: rows_per_pass must be 0, 1, 2 or 4, got ", rows_per_pass);
  const int64_t pass =
      rows_per_pass == 0 ? default_rows_per_pass(x_in.scalar_type()) : rows_per_pass;
  TORCH_CHECK(x_in.device().is_cpu() && w.device().is_cpu(), "attnlab_gemv.linear: CPU tensors");
  TORCH_CHECK(x_in.dim() >= 1 && w.dim() == 2 && x_in.size(-1) == w.size(1),
              "attnlab_gemv.linear: x (..., K) and w (N, K), got ", x_in.sizes(), " and ",
              w.sizes());
  const at::Tensor x = x_in.reshape({-1, w.size(1)});  // (M, K): a view for decode inputs
  TORCH_CHECK(x.size(0) <= kMaxRows, "attnlab_gemv.linear: at most ", kMaxRows, " rows, got ",
              x.size(0));
  TORCH_CHECK(x.scalar_type() == w.scalar_type(), "attnlab_gemv.linear: x and w share a dtype");
  TORCH_CHECK(supported(x.scalar_type()), "attnlab_gemv.linear: no kernel for ",
              x.scalar_type(), " on this CPU");
  TORCH_CHECK(w.is_contiguous() && (x.size(1) <= 1 || x.stride(1) == 1),
              "attnlab_gemv.linear: w contiguous, x with unit stride in K");
  const int64_t M = x.size(0), K = x.size(1), N = w.size(0);
  const bool has_b = b.has_value() && b->defined();
  TORCH_CHECK(!has_b || (b->dim() == 1 && b->size(0) == N && b->is_contiguous() &&
                         b->scalar_type() == x.scalar_type()),
              "attnlab_gemv.linear: b must be (N,), contiguous, in x's dtype");
  std::vector<int64_t> shape(x_in.sizes().begin(), x_in.sizes().end());
  shape.back() = N;
  at::Tensor y = at::empty(shape, x.options());  // (..., N), contiguous: rows N apart
  if (M > 0 && N > 0) {
    if (x.scalar_type() == at::kFloat) {
      run<float>(x.const_data_ptr<float>(), x.stride(0), M, w.const_data_ptr<float>(), N, K,
                 has_b ? b->const_data_ptr<float>() : nullptr, y.data_ptr<float>(), pass);
    } else {
      using BF = c10::BFloat16;
      run<BF>(x.const_data_ptr<BF>(), x.stride(0), M, w.const_data_ptr<BF>(), N, K,
              has_b ? b->const_data_ptr<BF>() : nullptr, y.data_ptr<BF>(), pass);
    }
  }
  return y;
}

}  // namespace

TORCH_LIBRARY(attnlab_gemv, m) {
  m.def("linear(Tensor x, Tensor w, Tensor? b, int rows_per_pass=0) -> Tensor");
  m.def("default_rows_per_pass(ScalarType dtype) -> int", &default_rows_per_pass);
  m.def("supported(ScalarType dtype) -> bool", &supported);
}

TORCH_LIBRARY_IMPL(attnlab_gemv, CPU, m) { m.impl("linear", &linear); }
