// What the one-call ops (decoder_layer.cpp, moe_experts.cpp) share: looking
// up another library's op by name, and calling a packed plain matmul exactly
// as linear.py's linear() calls it, so their results are the Python path's
// to the bit.
//
// Included by a .cpp next to it (paged_kernel.py passes this folder as an
// include path and keys each build's cache name on the headers its source
// includes, so an edit here rebuilds them). Everything is in an unnamed
// namespace: each kernel is its own library, and nothing here should be
// shared between them (or clash) when several are loaded in one process.
#pragma once

#include <ATen/ATen.h>
#include <ATen/core/dispatch/Dispatcher.h>
#include <ATen/core/stack.h>

#include <algorithm>
#include <optional>
#include <string>

namespace {

using at::Tensor;

// An op registered by a library loaded before the caller's first call (the
// dispatcher checks the C++ signature Fn against the schema).
template <typename Fn>
c10::TypedOperatorHandle<Fn> find_op(const char* name) {
  return c10::Dispatcher::singleton().findSchemaOrThrow(name, "").typed<Fn>();
}

using GemmFn = Tensor(const Tensor&, const Tensor&, int64_t);

// small_gemm's op for x's dtype, looked up when a layer first has its packed
// copy (its library is not loaded where small_gemm does not apply).
inline const c10::TypedOperatorHandle<GemmFn>& small_gemm_op(bool bf16) {
  if (bf16) {
    static const auto handle = find_op<GemmFn>("kvferry_gemm::linear");
    return handle;
  }
  static const auto handle = find_op<GemmFn>("kvferry_gemm::linear_f32");
  return handle;
}

// Tensor? and str? arguments make oneDNN's op awkward to call typed; one
// boxed call costs about a microsecond more.
inline Tensor onednn_linear(const Tensor& x, const Tensor& w, const std::optional<Tensor>& bias) {
  static const c10::OperatorHandle op =
      c10::Dispatcher::singleton().findSchemaOrThrow("mkldnn::_linear_pointwise", "");
  torch::jit::Stack stack;
  stack.reserve(6);
  stack.emplace_back(x);
  stack.emplace_back(w);
  stack.emplace_back(bias);
  stack.emplace_back(std::string("none"));
  stack.emplace_back(c10::List<std::optional<at::Scalar>>());
  stack.emplace_back(std::string(""));
  op.callBoxed(&stack);
  return stack.back().toTensor();
}

// x [rows, in] times a packed plain weight (+ bias) -> [rows, n], as
// linear.py runs it: kind 1 small_gemm's copy (a bias, only under
// --deterministic's method, added after the product as linear.py adds it);
// 2 oneDNN's (the bias fused), the rows above exact_rows padded with zeros
// to a multiple of row_bucket; 3 oneDNN's in blocks of exactly row_bucket
// rows, the last padded (linear_fixed_blocks, --deterministic's matmul on
// AMX CPUs).
inline Tensor plain_linear(const Tensor& x, const Tensor& w, int64_t n, int64_t kind, int64_t exact_rows,
                           int64_t row_bucket, const std::optional<Tensor>& bias = std::nullopt) {
  TORCH_CHECK(kind >= 1 && kind <= 3, "plain_linear: kind must be 1 (small_gemm), 2 or 3 (oneDNN), got ", kind);
  if (kind == 1) {
    Tensor y = small_gemm_op(w.scalar_type() == at::kBFloat16).call(x, w, n);  // small_gemm.linear's choice
    return bias.has_value() ? y.add_(*bias) : y;
  }
  const int64_t rows = x.size(0);
  if (kind == 3) {
    Tensor out = at::empty({rows, n}, x.options());
    for (int64_t s = 0; s < rows; s += row_bucket) {
      const int64_t m = std::min(row_bucket, rows - s);
      Tensor block = at::zeros({row_bucket, x.size(1)}, x.options());
      block.narrow(0, 0, m).copy_(x.narrow(0, s, m));
      out.narrow(0, s, m).copy_(onednn_linear(block, w, bias).narrow(0, 0, m));
    }
    return out;
  }
  const int64_t padded = rows <= exact_rows ? rows : (rows + row_bucket - 1) / row_bucket * row_bucket;
  if (padded == rows) return onednn_linear(x.contiguous(), w, bias);
  Tensor xp = at::empty({padded, x.size(1)}, x.options());
  xp.narrow(0, 0, rows).copy_(x);
  xp.narrow(0, rows, padded - rows).zero_();
  return onednn_linear(xp, w, bias).narrow(0, 0, rows);
}

}  // namespace
