// A mixture-of-experts layer's expert loop as one op (model/moe_op.py).
//
// expert_loop(xs, counts, gate_up, down, gate_up_n, down_n, kind, exact_rows, row_bucket) -> ys
//   xs:      [P, H] the (token, expert) pairs' rows, sorted by expert (moe.py's fused_experts)
//   counts:  [E] rows per local expert, summing to P
//   gate_up: E packed copies of each expert's [2I, H] stack slice; down: E of [H, I]
//   kind:    whose copy (linear.py / decoder_layer.cpp): 1 small_gemm's, 2 oneDNN's,
//            3 oneDNN's in blocks of exactly row_bucket rows
//   ys:      [P, H], rows e's = down_e(silu_and_mul(gate_up_e(xs rows of e)))
//
// Each expert's two matmuls are the ones linear.py's linear() makes for the
// same rows (the same op, the same padding above exact_rows), so its rows
// are the Python loop's. What this saves:
// - the Python between them, ~20 us an expert (the module calls, slices,
//   the result's copy into ys);
// - with several threads, a parallel region per matmul. Here the active
//   experts are split among the threads in one region (at::parallel_for, by
//   weight bytes: every expert's are the same, so by count); inside it
//   oneDNN's and small_gemm's own parallel loops run on the calling thread
//   (OpenMP does not nest), so each thread streams its experts' weights
//   alone and the threads meet once per layer, not twice per expert. On a
//   machine where other processes hold cores, a region per matmul waited
//   for a descheduled thread every time (22-37x the floor at 2 threads).
// Fewer active experts than threads (batch 1: 8 experts) still splits by
// expert: each expert's weights are read by one core, which is what a
// thread's bandwidth allows anyway.
#include <ATen/ATen.h>
#include <ATen/Parallel.h>
#include <ATen/ThreadLocalState.h>
#include <ATen/core/dispatch/Dispatcher.h>
#include <ATen/core/stack.h>
#include <torch/library.h>

#include <string>
#include <vector>

namespace {

using at::Tensor;

template <typename Fn>
c10::TypedOperatorHandle<Fn> find_op(const char* name) {
  return c10::Dispatcher::singleton().findSchemaOrThrow(name, "").typed<Fn>();
}

using GemmFn = Tensor(const Tensor&, const Tensor&, int64_t);

Tensor onednn_linear(const c10::OperatorHandle& op, const Tensor& x, const Tensor& w) {
  torch::jit::Stack stack;
  stack.reserve(6);
  stack.emplace_back(x);
  stack.emplace_back(w);
  stack.emplace_back(std::optional<Tensor>());
  stack.emplace_back(std::string("none"));
  stack.emplace_back(c10::List<std::optional<at::Scalar>>());
  stack.emplace_back(std::string(""));
  op.callBoxed(&stack);
  return stack.back().toTensor();
}

struct Gemm {
  int64_t kind, exact_rows, row_bucket;
  const c10::OperatorHandle* onednn;
  const c10::TypedOperatorHandle<GemmFn>* small;

  Tensor operator()(const Tensor& x, const Tensor& w, int64_t n) const {
    if (kind == 1) return small->call(x, w, n);
    const int64_t rows = x.size(0);
    if (kind == 3) {  // linear_fixed_blocks
      Tensor out = at::empty({rows, n}, x.options());
      for (int64_t s = 0; s < rows; s += row_bucket) {
        const int64_t m = std::min(row_bucket, rows - s);
        Tensor block = at::zeros({row_bucket, x.size(1)}, x.options());
        block.narrow(0, 0, m).copy_(x.narrow(0, s, m));
        out.narrow(0, s, m).copy_(onednn_linear(*onednn, block, w).narrow(0, 0, m));
      }
      return out;
    }
    const int64_t padded = rows <= exact_rows ? rows : (rows + row_bucket - 1) / row_bucket * row_bucket;
    if (padded == rows) return onednn_linear(*onednn, x.contiguous(), w);
    Tensor xp = at::empty({padded, x.size(1)}, x.options());
    xp.narrow(0, 0, rows).copy_(x);
    xp.narrow(0, rows, padded - rows).zero_();
    return onednn_linear(*onednn, xp, w).narrow(0, 0, rows);
  }
};

Tensor expert_loop(const Tensor& xs, at::IntArrayRef counts, at::TensorList gate_up, at::TensorList down,
                   int64_t gate_up_n, int64_t down_n, int64_t kind, int64_t exact_rows, int64_t row_bucket) {
  TORCH_CHECK(xs.dim() == 2 && xs.is_contiguous(), "expert_loop: xs must be a contiguous [pairs, hidden]");
  const int64_t E = static_cast<int64_t>(counts.size());
  TORCH_CHECK(static_cast<int64_t>(gate_up.size()) == E && static_cast<int64_t>(down.size()) == E,
              "expert_loop: one gate_up and one down weight per count");
  TORCH_CHECK(kind >= 1 && kind <= 3, "expert_loop: kind must be 1 (small_gemm), 2 or 3 (oneDNN)");
  std::vector<int64_t> active, start;  // the experts with rows, and each one's first row
  int64_t total = 0;
  for (int64_t e = 0; e < E; ++e) {
    TORCH_CHECK(counts[e] >= 0, "expert_loop: negative count");
    if (counts[e]) {
      active.push_back(e);
      start.push_back(total);
    }
    total += counts[e];
  }
  TORCH_CHECK(total == xs.size(0), "expert_loop: counts sum to ", total, ", xs has ", xs.size(0), " rows");
  Tensor ys = at::empty({total, down_n}, xs.options());
  if (active.empty()) return ys;
  static const c10::OperatorHandle onednn =
      c10::Dispatcher::singleton().findSchemaOrThrow("mkldnn::_linear_pointwise", "");
  static const auto silu_and_mul = find_op<Tensor(const Tensor&)>("kvferry_fused::silu_and_mul");
  const bool bf16 = xs.scalar_type() == at::kBFloat16;
  std::optional<c10::TypedOperatorHandle<GemmFn>> small;
  if (kind == 1) small = find_op<GemmFn>(bf16 ? "kvferry_gemm::linear" : "kvferry_gemm::linear_f32");
  const Gemm gemm{kind, exact_rows, row_bucket, &onednn, small ? &*small : nullptr};
  const int64_t A = static_cast<int64_t>(active.size());
  // The caller's thread-local state (inference mode, dispatch keys) for the
  // workers' calls: ys is an inference tensor under torch.inference_mode.
  const at::ThreadLocalState caller;
  // One region for the layer; grain 1: each thread a contiguous run of experts.
  at::parallel_for(0, A, 1, [&](int64_t a0, int64_t a1) {
    at::ThreadLocalStateGuard guard(caller);
    for (int64_t a = a0; a < a1; ++a) {
      const int64_t e = active[a], s = start[a], n = counts[e];
      const Tensor h = silu_and_mul.call(gemm(xs.narrow(0, s, n), gate_up[e], gate_up_n));
      ys.narrow(0, s, n).copy_(gemm(h, down[e], down_n));
    }
  });
  return ys;
}

}  // namespace

TORCH_LIBRARY(kvferry_moe, m) {
  m.def("expert_loop(Tensor xs, int[] counts, Tensor[] gate_up, Tensor[] down, int gate_up_n, int down_n, "
        "int kind, int exact_rows, int row_bucket) -> Tensor");
  m.impl("expert_loop", c10::DispatchKey::CPU, TORCH_FN(expert_loop));
  // oneDNN's packed weights are MkldnnCPU tensors: a call with them dispatches there.
  m.impl("expert_loop", c10::DispatchKey::MkldnnCPU, TORCH_FN(expert_loop));
}
