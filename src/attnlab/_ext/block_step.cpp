// One decode step of a Transformer block in one call: the operators the Python modules would run,
// in the same order, without a Python round trip between them (attnlab/models/fused_step.py).
//
//   attnlab_block::step(x, k_cache!, v_cache!, length, cos, sin, norm1_w, norm1_b, qkv_w, qkv_b,
//                       o_w, o_b, norm2_w, norm2_b, mlp_w, mlp_b, interleaved, heads, kv_heads,
//                       norm, eps1, eps2, activation, prenorm, scale, streamed, rows_per_pass) -> y
//       x (B, 1, E): one new token per row. Pre-LN (prenorm) / post-LN:
//           h = x + attn(norm1(x)),  y = h + mlp(norm2(h))   /   h = norm1(x + attn(x)),
//           y = norm2(h + mlp(h)),
//       attn: [q k v] = h·qkv_wᵀ + qkv_b split into H, H_kv, H_kv heads of D; k rotated at the
//           new token's position `length` (RoPE table rows cos/sin (N, R/2), R = 2·cos.size(1),
//           pairs interleaved or halves; none without cos), k and v written at row `length` of the caches
//           (B, H_kv, capacity, D), then softmax(rope(q)·Kᵀ·scale)·V over rows 0…length of the
//           caches (attnlab_nan's decode kernel: NaN rule built in), heads merged, ·o_wᵀ + o_b;
//       mlp: two weights — act(h·W₁ᵀ + b₁)·W₂ᵀ + b₂; three (gate, up, down) — SwiGLU,
//           (act(h·W_gᵀ + b_g) ⊙ (h·W_uᵀ + b_u))·W_dᵀ + b_d;
//       norm: "rms" (attnlab_nan::rms_norm, weight only) or "layer" (at::layer_norm), with ε
//           eps1 for norm1 and eps2 for norm2;
//       activation: "gelu", "gelu_tanh", "relu" or "silu";
//       streamed: bit i set → linear i (qkv, out, then the MLP's) runs attnlab_gemv::linear
//           (rows_per_pass as there), else at::linear.
//
// Every operator is the one the modules call (the attnlab_nan and attnlab_gemv operators through
// the dispatcher, the rest through ATen), on the same operands in the same order, so the result
// and the caches are the modules' bits. Why: a decode step on a small model is ~40 operator calls
// per block, and at one to four rows the Python between them costs about as much as streaming
// the weights (8 layers, d_model 512: ~2 of ~6 ms per step on a Xeon, RESULTS.md).
#include <ATen/ATen.h>
#include <ATen/core/dispatch/Dispatcher.h>
#include <torch/library.h>

#include <cstdint>
#include <optional>
#include <string>

namespace {

using at::Tensor;
using OptTensor = std::optional<Tensor>;

template <class Sig>
c10::TypedOperatorHandle<Sig> handle(const char* name) {
  return c10::Dispatcher::singleton().findSchemaOrThrow(name, "").typed<Sig>();
}

// Looked up at first use: the extension defining each must be loaded by then (the Python caller
// checks that, and skips the gemv operator when no linear is streamed).
Tensor rms_norm(const Tensor& x, const Tensor& w, double eps) {
  static const auto op = handle<Tensor(const Tensor&, const Tensor&, double)>("attnlab_nan::rms_norm");
  return op.call(x, w, eps);
}

Tensor gemv(const Tensor& x, const Tensor& w, const OptTensor& b, int64_t rows_per_pass) {
  static const auto op = handle<Tensor(const Tensor&, const Tensor&, const OptTensor&, int64_t)>(
      "attnlab_gemv::linear");
  return op.call(x, w, b, rows_per_pass);
}

Tensor rope_rows(const Tensor& x, const Tensor& cos, const Tensor& sin, int64_t start,
                 int64_t rotary_dim, bool interleaved) {
  static const auto op = handle<Tensor(const Tensor&, const Tensor&, const Tensor&, int64_t,
                                       int64_t, bool)>("attnlab_nan::rope_rows");
  return op.call(x, cos, sin, start, rotary_dim, interleaved);
}

Tensor rope_decode_attend(const Tensor& q, const Tensor& k, const Tensor& v, const Tensor& cos,
                          const Tensor& sin, int64_t q_start, int64_t rotary_dim,
                          bool interleaved, double scale) {
  static const auto op =
      handle<Tensor(const Tensor&, const Tensor&, const Tensor&, const Tensor&, const Tensor&,
                    int64_t, int64_t, bool, int64_t, bool, double)>(
          "attnlab_nan::rope_decode_attend");
  // keys already rotated (k_start unused): the cache holds them after RoPE
  return op.call(q, k, v, cos, sin, q_start, 0, false, rotary_dim, interleaved, scale);
}

Tensor decode_attend(const Tensor& q, const Tensor& k, const Tensor& v, double scale) {
  static const auto op =
      handle<Tensor(const Tensor&, const Tensor&, const Tensor&, double,
                    const std::optional<Tensor>&, double, const std::optional<Tensor>&)>(
          "attnlab_nan::decode_attend");
  // every cached key, no soft-capping, no sinks
  return op.call(q, k, v, scale, std::nullopt, 0.0, std::nullopt);
}

struct Linears {
  int64_t streamed;
  int64_t rows_per_pass;
  Tensor operator()(int i, const Tensor& x, const Tensor& w, const OptTensor& b) const {
    return (streamed >> i) & 1 ? gemv(x, w, b, rows_per_pass) : at::linear(x, w, b);
  }
};

enum class Norm { kRms, kLayer };
enum class Act { kGelu, kGeluTanh, kRelu, kSilu };

Norm parse_norm(c10::string_view s) {
  if (s == "rms") return Norm::kRms;
  TORCH_CHECK(s == "layer", "attnlab_block::step: norm must be 'rms' or 'layer', got '",
              std::string(s), "'");
  return Norm::kLayer;
}

Act parse_act(c10::string_view s) {
  if (s == "gelu") return Act::kGelu;
  if (s == "gelu_tanh") return Act::kGeluTanh;
  if (s == "relu") return Act::kRelu;
  TORCH_CHECK(s == "silu", "attnlab_block::step: activation must be gelu, gelu_tanh, relu or ",
              "silu, got '", std::string(s), "'");
  return Act::kSilu;
}

Tensor normed(Norm kind, const Tensor& x, const OptTensor& w, const OptTensor& b, double eps) {
  if (kind == Norm::kRms) return rms_norm(x, *w, eps);
  return at::layer_norm(x, {x.size(-1)}, w, b, eps);
}

// In place on a fresh tensor: the values of F.gelu / F.relu / F.silu (the same kernels).
void activate_(Tensor& g, Act act) {
  switch (act) {
    case Act::kGelu: at::gelu_(g, "none"); break;
    case Act::kGeluTanh: at::gelu_(g, "tanh"); break;
    case Act::kRelu: at::relu_(g); break;
    case Act::kSilu: at::silu_(g); break;
  }
}

Tensor step(const Tensor& x, Tensor& k_cache, Tensor& v_cache, int64_t length,
            const OptTensor& cos, const OptTensor& sin, const OptTensor& norm1_w,
            const OptTensor& norm1_b, const Tensor& qkv_w, const OptTensor& qkv_b,
            const Tensor& o_w, const OptTensor& o_b, const OptTensor& norm2_w,
            const OptTensor& norm2_b, at::TensorList mlp_w, const c10::List<OptTensor>& mlp_b,
            bool interleaved, int64_t heads,
            int64_t kv_heads, c10::string_view norm, double eps1, double eps2,
            c10::string_view activation, bool prenorm,
            double scale, int64_t streamed, int64_t rows_per_pass) {
  const Norm nk = parse_norm(norm);
  const Act act = parse_act(activation);
  TORCH_CHECK(x.dim() == 3 && x.size(1) == 1, "attnlab_block::step: x must be (B, 1, E), got ",
              x.sizes());
  TORCH_CHECK(k_cache.dim() == 4 && v_cache.dim() == 4 && k_cache.size(0) == x.size(0) &&
                  k_cache.size(1) == kv_heads && v_cache.sizes() == k_cache.sizes(),
              "attnlab_block::step: caches must both be (B, kv_heads, capacity, D), got ",
              k_cache.sizes(), " and ", v_cache.sizes());
  TORCH_CHECK(k_cache.scalar_type() == x.scalar_type() &&
                  v_cache.scalar_type() == x.scalar_type(),
              "attnlab_block::step: caches must have x's dtype");
  TORCH_CHECK(0 <= length && length < k_cache.size(2),
              "attnlab_block::step: length must leave a free cache row, got ", length, " of ",
              k_cache.size(2));
  TORCH_CHECK(mlp_w.size() == 2 || mlp_w.size() == 3,
              "attnlab_block::step: mlp_w holds 2 or 3 weights, got ", mlp_w.size());
  TORCH_CHECK(mlp_b.size() == mlp_w.size(), "attnlab_block::step: one mlp_b per mlp_w");
  TORCH_CHECK(nk == Norm::kLayer || (norm1_w && norm2_w),
              "attnlab_block::step: an RMS norm needs its weights");
  TORCH_CHECK(cos.has_value() == sin.has_value(),
              "attnlab_block::step: cos and sin go together");
  const int64_t B = x.size(0), D = k_cache.size(3);
  TORCH_CHECK(heads > 0 && heads % kv_heads == 0 && qkv_w.dim() == 2 &&
                  qkv_w.size(0) == (heads + 2 * kv_heads) * D,
              "attnlab_block::step: qkv_w must be ((heads + 2·kv_heads)·D, E), got ",
              qkv_w.sizes());
  const Linears linear{streamed, rows_per_pass};

  // attention
  const Tensor h = prenorm ? normed(nk, x, norm1_w, norm1_b, eps1) : x;
  const Tensor qkv = linear(0, h, qkv_w, qkv_b);  // (B, 1, (H + 2 H_kv) D)
  const auto parts =
      qkv.view({B, 1, heads + 2 * kv_heads, D}).transpose(1, 2).split_with_sizes(
          {heads, kv_heads, kv_heads}, 1);  // (B, ·, 1, D) each
  const Tensor k = cos ? rope_rows(parts[1], *cos, *sin, length, 2 * cos->size(1), interleaved)
                       : parts[1];
  k_cache.narrow(2, length, 1).copy_(k);
  v_cache.narrow(2, length, 1).copy_(parts[2]);
  const Tensor keys = k_cache.narrow(2, 0, length + 1), values = v_cache.narrow(2, 0, length + 1);
  Tensor a = cos ? rope_decode_attend(parts[0], keys, values, *cos, *sin, length,
                                      2 * cos->size(1), interleaved, scale)
                 : decode_attend(parts[0], keys, values, scale);
  a = a.to(x.scalar_type()).transpose(1, 2).reshape({B, 1, heads * D});  // (B, 1, H D)
  a = linear(1, a, o_w, o_b);                                              // (B, 1, E)
  const Tensor res = prenorm ? at::add(x, a) : normed(nk, at::add(x, a), norm1_w, norm1_b, eps1);

  // MLP
  const Tensor m_in = prenorm ? normed(nk, res, norm2_w, norm2_b, eps2) : res;
  Tensor g = linear(2, m_in, mlp_w[0], mlp_b.get(0));
  activate_(g, act);
  Tensor m;
  if (mlp_w.size() == 3) {
    g.mul_(linear(3, m_in, mlp_w[1], mlp_b.get(1)));
    m = linear(4, g, mlp_w[2], mlp_b.get(2));
  } else {
    m = linear(3, g, mlp_w[1], mlp_b.get(1));
  }
  return prenorm ? at::add(res, m) : normed(nk, at::add(res, m), norm2_w, norm2_b, eps2);
}

}  // namespace

TORCH_LIBRARY(attnlab_block, m) {
  m.def(
      "step(Tensor x, Tensor(a!) k_cache, Tensor(b!) v_cache, int length, Tensor? cos, "
      "Tensor? sin, Tensor? norm1_w, Tensor? norm1_b, Tensor qkv_w, Tensor? qkv_b, Tensor o_w, "
      "Tensor? o_b, Tensor? norm2_w, Tensor? norm2_b, Tensor[] mlp_w, Tensor?[] mlp_b, "
      "bool interleaved, int heads, int kv_heads, str norm, float eps1, float eps2, "
      "str activation, bool prenorm, float scale, int streamed, int rows_per_pass) -> Tensor");
}

TORCH_LIBRARY_IMPL(attnlab_block, CPU, m) { m.impl("step", &step); }
