// One Llama decoder layer as one op, for the CPU fast path (layer_op.py).
//
// decoder_layer(h, x, ...) -> (h', x') runs exactly the ops the Python layer
// (llama.py: DecoderLayer, Attention, MLP) runs where every one of them is
// a C++ kernel (this project's, or oneDNN's packed matmul), in the same
// order and on the same views:
//
//   qkv  = gemm(x, qkv_w) (+ qkv_bias, fused by oneDNN)   [T, (H + 2 KVH) D]
//   q, k = rope_neox(qkv[:, :(H + KVH) D] as [T, H + KVH, D], cos, sin) split
//          (Qwen3: q, k = rope_neox(q_norm_w * rms_norm(q)), rope_neox(k_norm_w * rms_norm(k)),
//          the per-head norms as torch's ops, as the Python layer runs them on 3-D views)
//   v    = qkv[:, (H + KVH) D:] as [T, KVH, D]
//   write_kv(k, v, K cache, V cache, slot_mapping)
//   o    = paged_attention(q, K cache, V cache, the kernel's sequences)
//          (paged_attention_tree with the step's tree masks where draft
//          trees are among them, as attention.py's paged_attention calls it)
//   h1, x1 = add_rms_norm(gemm(o, o_w), h, post_norm_w)
//   h', x' = add_rms_norm(gemm(silu_and_mul(gemm(x1, gate_up_w)), down_w), h1, next_norm_w)
//
// where gemm is linear.py's: small_gemm's kernel for its packed copy, else
// oneDNN's _linear_pointwise on its blocked copy, with the rows above
// exact_rows padded to a multiple of row_bucket as linear.py pads them, or
// for a GGUF weight kept in its blocks quant_gemm.cpp's layer_linear. So
// its results are the Python path's to the bit. What it saves is the
// Python between those ops: about 90 us a layer (module calls, wrappers
// with their per-call checks, views and slices, and the interpreter's
// dispatch of each op), ~2.7 ms of a SmolLM2-135M decode step (30 layers),
// against a few us here. The ops are called through the dispatcher, by
// name: their libraries (kvferry_gemm, kvferry_fused, kvferry) are loaded by
// the time layer_op.py lets a step take this path (oneDNN's op is torch's).
//
// tp_attention and tp_mlp are the same layer in two calls for a
// tensor-parallel rank, split where its two all-reduces go (see there);
// tp_decoder_layers runs a rank's every layer in one call, the all-reduces
// inside (shm_sums.h).
#include "op_calls.h"  // find_op, plain_linear
#include "shm_sums.h"  // ShmSums: a rank's all-reduce over shared memory

#include <ATen/record_function.h>
#include <torch/library.h>

#include <torch/custom_class.h>

#include <mutex>
#include <optional>
#include <string>
#include <tuple>
#include <vector>

namespace {

using at::Tensor;

// Each other op's handle, looked up on first use. The signatures are the
// kernels' own C++ signatures (the dispatcher checks them).
struct Ops {
  c10::TypedOperatorHandle<Tensor(const Tensor&, const Tensor&, const Tensor&)> rope =
      find_op<Tensor(const Tensor&, const Tensor&, const Tensor&)>("kvferry_fused::rope_neox");
  c10::TypedOperatorHandle<void(const Tensor&, const Tensor&, Tensor, Tensor, const Tensor&)> write_kv =
      find_op<void(const Tensor&, const Tensor&, Tensor, Tensor, const Tensor&)>("kvferry_fused::write_kv");
  c10::TypedOperatorHandle<std::tuple<Tensor, Tensor>(const Tensor&, const Tensor&, const Tensor&, double)>
      add_rms_norm = find_op<std::tuple<Tensor, Tensor>(const Tensor&, const Tensor&, const Tensor&, double)>(
          "kvferry_fused::add_rms_norm");
  c10::TypedOperatorHandle<Tensor(const Tensor&)> silu_and_mul =
      find_op<Tensor(const Tensor&)>("kvferry_fused::silu_and_mul");
  c10::TypedOperatorHandle<void(const Tensor&, const Tensor&, const Tensor&, const Tensor&, const Tensor&,
                                const Tensor&, const Tensor&, double, Tensor)>
      attention = find_op<void(const Tensor&, const Tensor&, const Tensor&, const Tensor&, const Tensor&,
                               const Tensor&, const Tensor&, double, Tensor)>("kvferry::paged_attention");
  c10::TypedOperatorHandle<void(const Tensor&, const Tensor&, const Tensor&, const Tensor&, const Tensor&,
                                const Tensor&, const Tensor&, double, Tensor, const Tensor&)>
      attention_tree = find_op<void(const Tensor&, const Tensor&, const Tensor&, const Tensor&, const Tensor&,
                                    const Tensor&, const Tensor&, double, Tensor, const Tensor&)>(
          "kvferry::paged_attention_tree");

  // The kernel's attention over the step's sequences into out: with draft
  // trees among them (tree_masks [S, 64] int64 ancestor bits, attention.py's
  // kernel_tree_masks) the op that takes their masks, else the causal one.
  void attend(const Tensor& q, const Tensor& k_cache, const Tensor& v_cache, const Tensor& block_tables,
              const Tensor& seq_lens, const Tensor& query_starts, const Tensor& query_lens, double scale,
              const Tensor& out, const std::optional<Tensor>& tree_masks) const {
    if (tree_masks.has_value())
      attention_tree.call(q, k_cache, v_cache, block_tables, seq_lens, query_starts, query_lens, scale, out,
                          *tree_masks);
    else
      attention.call(q, k_cache, v_cache, block_tables, seq_lens, query_starts, query_lens, scale, out);
  }
};

// The same ops writing into given buffers (decoder_layers' workspace), looked
// up on the workspace's first use: their libraries are loaded by then.
struct OutOps {
  c10::TypedOperatorHandle<void(const Tensor&, const Tensor&, const Tensor&, Tensor)> rope =
      find_op<void(const Tensor&, const Tensor&, const Tensor&, Tensor)>("kvferry_fused::rope_neox_out");
  c10::TypedOperatorHandle<void(const Tensor&, const Tensor&, const Tensor&, double, Tensor, Tensor)> add_rms_norm =
      find_op<void(const Tensor&, const Tensor&, const Tensor&, double, Tensor, Tensor)>(
          "kvferry_fused::add_rms_norm_out");
  c10::TypedOperatorHandle<void(const Tensor&, Tensor)> silu_and_mul =
      find_op<void(const Tensor&, Tensor)>("kvferry_fused::silu_and_mul_out");
  c10::TypedOperatorHandle<void(const Tensor&, const Tensor&, int64_t, int64_t, Tensor)> linear =
      find_op<void(const Tensor&, const Tensor&, int64_t, int64_t, Tensor)>("kvferry_quant::layer_linear_out");
  c10::TypedOperatorHandle<void(const Tensor&, at::TensorList, at::IntArrayRef, Tensor)> linear_parts =
      find_op<void(const Tensor&, at::TensorList, at::IntArrayRef, Tensor)>("kvferry_quant::layer_linear_parts_out");
};

const OutOps& out_ops() {
  static const OutOps handles;
  return handles;
}

const Ops& ops() {
  static const Ops handles;  // a failed lookup throws, and the next call tries again
  return handles;
}

// One matmul as linear.py's linear(x, weight, bias, packed) runs it: kind 1
// is small_gemm's copy (a bias, only under --deterministic's method, added
// after the product as linear.py adds it), kind 2 oneDNN's, kind 3 oneDNN's
// in blocks of exactly row_bucket rows, the last padded with zeros (linear.py's
// linear_fixed_blocks: --deterministic's matmul on AMX CPUs). kQuantKind + t:
// a GGUF weight of ggml type t, its uint8 blocks [n, bytes_per_row].
constexpr int64_t kQuantKind = 100;
// kQuantParts: a fused GGUF layer kept as several weights (shards of different
// types: a Q4_K_M file's q/k in Q4_K and v in Q6_K), the parts and their types
// in the op's *_parts / *_part_types lists: quant_gemm.cpp's layer_linear_parts,
// the path GGUFLinearMethod takes for them.
constexpr int64_t kQuantParts = 99;
struct Matmul {
  int64_t exact_rows, row_bucket;
  Tensor operator()(const Tensor& x, const Tensor& w, int64_t n, int64_t kind,
                    const std::optional<Tensor>& bias = std::nullopt, at::TensorList parts = {},
                    at::IntArrayRef part_types = {}) const {
    if (kind == kQuantParts) {
      static const auto op = find_op<Tensor(const Tensor&, at::TensorList, at::IntArrayRef)>(
          "kvferry_quant::layer_linear_parts");
      Tensor y = op.call(x, parts, part_types);
      TORCH_CHECK(y.size(1) == n, "decoder_layer: the parts' rows are not the layer's output width");
      return bias.has_value() ? at::add(y, *bias) : y;
    }
    if (kind >= kQuantKind) {
      // A GGUF weight's blocks (layers/gguf.py): quant_gemm.cpp's layer_linear,
      // the path quant.linear takes, in x's dtype; the bias after, as GGUFLinearMethod adds it.
      static const auto op = find_op<Tensor(const Tensor&, const Tensor&, int64_t, int64_t)>(
          "kvferry_quant::layer_linear");
      Tensor y = op.call(x, w, kind - kQuantKind, n);
      return bias.has_value() ? at::add(y, *bias) : y;
    }
    TORCH_CHECK(kind >= 1 && kind <= 3,
                "decoder_layer: matmul kind must be 1 (small_gemm), 2 or 3 (oneDNN), 99 (GGUF parts) or 100 + a ggml type");
    return plain_linear(x, w, n, kind, exact_rows, row_bucket, bias);
  }
};

// The attention half of a layer on x [T, hidden] (the layer's input norm):
// qkv, RoPE (Qwen3: the per-head norms first), the KV write, paged attention,
// and o_proj's product [T, o_n], before the residual add.
Tensor attention_product(const Ops& op, const Matmul& gemm, const Tensor& x, const Tensor& cos, const Tensor& sin,
                         const Tensor& kv_cache_layer, const Tensor& slot_mapping, const Tensor& block_tables,
                         const Tensor& seq_lens, const Tensor& query_starts, const Tensor& query_lens,
                         const std::optional<Tensor>& tree_masks,
                         const Tensor& qkv_w, int64_t qkv_n, int64_t qkv_kind, const std::optional<Tensor>& qkv_bias,
                         const Tensor& o_w, int64_t o_n, int64_t o_kind, int64_t num_heads, int64_t num_kv_heads,
                         double scale, const std::optional<Tensor>& q_norm_w, const std::optional<Tensor>& k_norm_w,
                         double qk_eps, at::TensorList qkv_parts, at::IntArrayRef qkv_part_types) {
  TORCH_CHECK(kv_cache_layer.dim() == 5 && kv_cache_layer.size(0) == 2 && kv_cache_layer.size(3) == num_kv_heads,
              "decoder_layer: kv_cache_layer must be [2, num_blocks, block_size, KVH, D]");
  const int64_t T = x.size(0), D = kv_cache_layer.size(4);
  const int64_t q_size = num_heads * D, kv_size = num_kv_heads * D;
  TORCH_CHECK(qkv_n == q_size + 2 * kv_size, "decoder_layer: qkv_n is not (H + 2 KVH) * D");

  const Tensor qkv = gemm(x, qkv_w, qkv_n, qkv_kind, qkv_bias, qkv_parts, qkv_part_types);
  const Tensor v = qkv.narrow(1, q_size + kv_size, kv_size).view({T, num_kv_heads, D});
  Tensor q, k;
  TORCH_CHECK(q_norm_w.has_value() == k_norm_w.has_value(), "decoder_layer: q and k norms go together");
  if (q_norm_w.has_value()) {
    // RMSNorm.forward on a 3-D view: weight * F.rms_norm(x, (D,), None, eps).
    const auto head_norm = [&](const Tensor& x, const Tensor& w) {
      return op.rope.call(at::mul(w, at::rms_norm(x, {D}, std::nullopt, qk_eps)), cos, sin);
    };
    q = head_norm(qkv.narrow(1, 0, q_size).view({T, num_heads, D}), *q_norm_w);
    k = head_norm(qkv.narrow(1, q_size, kv_size).view({T, num_kv_heads, D}), *k_norm_w);
  } else {
    const Tensor qk =
        op.rope.call(qkv.narrow(1, 0, q_size + kv_size).view({T, num_heads + num_kv_heads, D}), cos, sin);
    q = qk.narrow(1, 0, num_heads);
    k = qk.narrow(1, num_heads, num_kv_heads);
  }
  const Tensor k_cache = kv_cache_layer.select(0, 0), v_cache = kv_cache_layer.select(0, 1);
  op.write_kv.call(k, v, k_cache.view({-1, num_kv_heads, D}), v_cache.view({-1, num_kv_heads, D}), slot_mapping);
  Tensor out = at::empty(q.sizes(), q.options());
  op.attend(q, k_cache, v_cache, block_tables, seq_lens, query_starts, query_lens, scale, out, tree_masks);
  return gemm(out.view({T, q_size}), o_w, o_n, o_kind);
}

// The MLP on x1 [T, hidden] (the post-attention norm): down_proj's product
// of silu_and_mul(gate_up), before the residual add.
Tensor mlp_product(const Ops& op, const Matmul& gemm, const Tensor& x1, const Tensor& gate_up_w, int64_t gate_up_n,
                   int64_t gate_up_kind, const Tensor& down_w, int64_t down_n, int64_t down_kind,
                   at::TensorList gate_up_parts, at::IntArrayRef gate_up_part_types) {
  const Tensor up =
      op.silu_and_mul.call(gemm(x1, gate_up_w, gate_up_n, gate_up_kind, std::nullopt, gate_up_parts, gate_up_part_types));
  return gemm(up, down_w, down_n, down_kind);
}

void check_input(const Tensor& x) {
  TORCH_CHECK(x.dim() == 2, "decoder_layer: x must be [tokens, hidden]");
  TORCH_CHECK(x.scalar_type() == at::kBFloat16 || x.scalar_type() == at::kFloat,
              "decoder_layer: bfloat16 or float32 only");
}

// h, x [T, hidden] (x = the layer's input norm of h); cos, sin [T, D / 2] in
// the model's dtype; kv_cache_layer [2, num_blocks, block_size, KVH, D];
// slot_mapping [T]; block_tables .. query_lens: the paged kernel's sequences
// (every sequence of the step); tree_masks: their draft trees' ancestor bits
// ([S, 64] int64, paged_attention_tree's), or none; *_w: the packed weights, *_n their output
// widths, *_kind whose copy (see Matmul); q_norm_w, k_norm_w: Qwen3's
// per-head norms, or none; qkv_parts .. gate_up_part_types: the GGUF parts
// of a fused layer of kind kQuantParts (empty otherwise).
std::tuple<Tensor, Tensor> decoder_layer(
    const Tensor& h, const Tensor& x, const Tensor& cos, const Tensor& sin, const Tensor& kv_cache_layer,
    const Tensor& slot_mapping, const Tensor& block_tables, const Tensor& seq_lens, const Tensor& query_starts,
    const Tensor& query_lens, const std::optional<Tensor>& tree_masks, const Tensor& qkv_w, int64_t qkv_n,
    int64_t qkv_kind, const std::optional<Tensor>& qkv_bias, const Tensor& o_w, int64_t o_n, int64_t o_kind,
    const Tensor& post_norm_w,
    double post_eps, const Tensor& gate_up_w, int64_t gate_up_n, int64_t gate_up_kind, const Tensor& down_w,
    int64_t down_n, int64_t down_kind, const Tensor& next_norm_w, double next_eps, int64_t num_heads,
    int64_t num_kv_heads, double scale, int64_t exact_rows, int64_t row_bucket,
    const std::optional<Tensor>& q_norm_w, const std::optional<Tensor>& k_norm_w, double qk_eps,
    at::TensorList qkv_parts, at::IntArrayRef qkv_part_types, at::TensorList gate_up_parts,
    at::IntArrayRef gate_up_part_types) {
  check_input(x);
  TORCH_CHECK(h.sizes() == x.sizes(), "decoder_layer: h and x must be [tokens, hidden]");
  const Ops& op = ops();
  const Matmul gemm{exact_rows, row_bucket};
  const Tensor o = attention_product(op, gemm, x, cos, sin, kv_cache_layer, slot_mapping, block_tables, seq_lens,
                                     query_starts, query_lens, tree_masks, qkv_w, qkv_n, qkv_kind, qkv_bias, o_w,
                                     o_n, o_kind, num_heads, num_kv_heads, scale, q_norm_w, k_norm_w, qk_eps,
                                     qkv_parts, qkv_part_types);
  auto [h1, x1] = op.add_rms_norm.call(o, h, post_norm_w, post_eps);
  return op.add_rms_norm.call(mlp_product(op, gemm, x1, gate_up_w, gate_up_n, gate_up_kind, down_w, down_n, down_kind,
                                          gate_up_parts, gate_up_part_types),
                              h1, next_norm_w, next_eps);
}

// A model's layers, each one's decoder_layer arguments after the step's
// tensors, held once (layer_op.py builds it when the weights are packed):
// decoder_layers runs them all in one call. Through Python each layer's call
// converted its ~40 arguments to the dispatcher's boxed values and back
// (about 20 us a layer, 0.6 ms of a 30-layer step); here they are read in place.
struct LayerSpec {
  Tensor qkv_w;
  int64_t qkv_n, qkv_kind;
  std::optional<Tensor> qkv_bias;
  Tensor o_w;
  int64_t o_n, o_kind;
  Tensor post_norm_w;
  double post_eps;
  Tensor gate_up_w;
  int64_t gate_up_n, gate_up_kind;
  Tensor down_w;
  int64_t down_n, down_kind;
  Tensor next_norm_w;
  double next_eps;
  int64_t num_heads, num_kv_heads;
  double scale;
  int64_t exact_rows, row_bucket;
  std::optional<Tensor> q_norm_w, k_norm_w;
  double qk_eps;
  std::vector<Tensor> qkv_parts;
  std::vector<int64_t> qkv_part_types;
  std::vector<Tensor> gate_up_parts;
  std::vector<int64_t> gate_up_part_types;
};

// A GGUF matmul (kind 99 or 100 + a ggml type) without a bias: one the
// workspace's layer writes into its buffer (quant_gemm.cpp's *_out ops).
bool quant_matmul(int64_t kind) { return kind == kQuantParts || kind >= kQuantKind; }

// Steps of up to this many rows (decode sizes) run in LayerStack's workspace.
constexpr int64_t kWorkspaceRows = 32;

// decoder_layers' buffers for a step of T rows, reused by every layer: each
// layer had allocated ~10 outputs and made ~12 views (the KV cache's per
// layer among them) through the allocator and the dispatcher, ~25 us of a
// ~300 us layer at batch 1. The intermediates of a layer are dead once it
// ends, so one set serves them all; the stream between layers alternates
// between two pairs (a layer reads one and writes the other), and the last
// layer writes a fresh pair, the tensors the caller keeps.
struct Workspace {
  int64_t rows = -1;
  at::ScalarType dtype = at::kFloat;
  Tensor qkv, qk_in, v, qk, q, k, attn, attn2d, o, h1, x1, gate_up, up, down, h[2], x[2];
  // Each layer's K and V caches ([num_blocks, block_size, KVH, D], the
  // attention's) and their [slots, KVH, D] views (write_kv's), over the
  // pool's memory without owning it: they are rebuilt whenever the pool
  // passed in is not the one they were made from (its address, shape,
  // strides and dtype), so a pool freed in between is never read through
  // them, nor kept alive by them.
  const void* kv_data = nullptr;
  std::vector<int64_t> kv_sizes, kv_strides;
  at::ScalarType kv_dtype = at::kFloat;
  std::vector<Tensor> k_cache, v_cache, k_slots, v_slots;
};

struct LayerStack : torch::CustomClassHolder {
  std::vector<LayerSpec> layers;
  // Whether every layer's matmuls are GGUF dots without a bias, of layer 0's
  // shapes, without Qwen3's head norms: the layers the workspace runs.
  bool uniform_quant = true;
  Workspace ws;
  std::mutex ws_mutex;  // one step at a time in the workspace (another runs as before)
  int64_t max_workspace_rows = kWorkspaceRows;  // 0: every step as before (benches compare the two)

  // decoder_layer's arguments from qkv_w on, in its order.
  void add(Tensor qkv_w, int64_t qkv_n, int64_t qkv_kind, std::optional<Tensor> qkv_bias, Tensor o_w, int64_t o_n,
           int64_t o_kind, Tensor post_norm_w, double post_eps, Tensor gate_up_w, int64_t gate_up_n,
           int64_t gate_up_kind, Tensor down_w, int64_t down_n, int64_t down_kind, Tensor next_norm_w,
           double next_eps, int64_t num_heads, int64_t num_kv_heads, double scale, int64_t exact_rows,
           int64_t row_bucket, std::optional<Tensor> q_norm_w, std::optional<Tensor> k_norm_w, double qk_eps,
           std::vector<Tensor> qkv_parts, std::vector<int64_t> qkv_part_types, std::vector<Tensor> gate_up_parts,
           std::vector<int64_t> gate_up_part_types) {
    layers.push_back(LayerSpec{std::move(qkv_w), qkv_n, qkv_kind, std::move(qkv_bias), std::move(o_w), o_n, o_kind,
                               std::move(post_norm_w), post_eps, std::move(gate_up_w), gate_up_n, gate_up_kind,
                               std::move(down_w), down_n, down_kind, std::move(next_norm_w), next_eps, num_heads,
                               num_kv_heads, scale, exact_rows, row_bucket, std::move(q_norm_w), std::move(k_norm_w),
                               qk_eps, std::move(qkv_parts), std::move(qkv_part_types), std::move(gate_up_parts),
                               std::move(gate_up_part_types)});
    const LayerSpec& l = layers.back();
    const LayerSpec& first = layers.front();
    uniform_quant = uniform_quant && quant_matmul(l.qkv_kind) && quant_matmul(l.o_kind) &&
                    quant_matmul(l.gate_up_kind) && quant_matmul(l.down_kind) && !l.qkv_bias.has_value() &&
                    !l.q_norm_w.has_value() && l.qkv_n == first.qkv_n && l.o_n == first.o_n &&
                    l.gate_up_n == first.gate_up_n && l.down_n == first.down_n && l.num_heads == first.num_heads &&
                    l.num_kv_heads == first.num_kv_heads && l.gate_up_n % 2 == 0;
  }

  int64_t size() const { return int64_t(layers.size()); }
  void set_workspace_rows(int64_t rows) { max_workspace_rows = rows; }
  // The rows of the last step the workspace ran (-1: none yet), for tests.
  int64_t workspace_rows() const { return ws.rows; }

  // The buffers for T rows of x's dtype (kept while steps keep that size) and
  // the caches' views of kv_cache [L, 2, num_blocks, block_size, KVH, D].
  void prepare(int64_t T, const Tensor& x, const Tensor& kv_cache) {
    const LayerSpec& l = layers.front();
    const int64_t D = kv_cache.size(5), H = l.num_heads, KVH = l.num_kv_heads;
    const int64_t hidden = x.size(1);
    TORCH_CHECK(l.qkv_n == (H + 2 * KVH) * D, "decoder_layer: qkv_n is not (H + 2 KVH) * D");
    if (ws.rows != T || ws.dtype != x.scalar_type()) {
      const auto opts = x.options();
      ws.rows = T;
      ws.dtype = x.scalar_type();
      ws.qkv = at::empty({T, l.qkv_n}, opts);
      ws.qk_in = ws.qkv.narrow(1, 0, (H + KVH) * D).view({T, H + KVH, D});
      ws.v = ws.qkv.narrow(1, (H + KVH) * D, KVH * D).view({T, KVH, D});
      ws.qk = at::empty({T, H + KVH, D}, opts);
      ws.q = ws.qk.narrow(1, 0, H);
      ws.k = ws.qk.narrow(1, H, KVH);
      ws.attn = at::empty({T, H, D}, opts);
      ws.attn2d = ws.attn.view({T, H * D});
      ws.o = at::empty({T, l.o_n}, opts);
      ws.h1 = at::empty({T, hidden}, opts);
      ws.x1 = at::empty({T, hidden}, opts);
      ws.gate_up = at::empty({T, l.gate_up_n}, opts);
      ws.up = at::empty({T, l.gate_up_n / 2}, opts);
      ws.down = at::empty({T, l.down_n}, opts);
      for (int j = 0; j < 2; ++j) {
        ws.h[j] = at::empty({T, hidden}, opts);
        ws.x[j] = at::empty({T, hidden}, opts);
      }
    }
    if (ws.kv_data != kv_cache.data_ptr() || ws.kv_sizes != kv_cache.sizes().vec() ||
        ws.kv_strides != kv_cache.strides().vec() || ws.kv_dtype != kv_cache.scalar_type() ||
        int64_t(ws.k_cache.size()) != size()) {
      ws.k_cache.clear(), ws.v_cache.clear(), ws.k_slots.clear(), ws.v_slots.clear();
      const auto opts = kv_cache.options();
      const at::IntArrayRef st = kv_cache.strides();
      const std::vector<int64_t> cache_sizes(kv_cache.sizes().begin() + 2, kv_cache.sizes().end());
      const std::vector<int64_t> cache_strides(st.begin() + 2, st.end());
      auto* base = static_cast<char*>(kv_cache.data_ptr());
      for (int64_t i = 0; i < size(); ++i) {
        for (int64_t kv = 0; kv < 2; ++kv) {
          void* at_ = base + (i * st[0] + kv * st[1]) * int64_t(kv_cache.element_size());
          Tensor cache = at::from_blob(at_, cache_sizes, cache_strides, opts);
          Tensor slots = at::from_blob(at_, {cache_sizes[0] * cache_sizes[1], KVH, D}, opts);
          (kv == 0 ? ws.k_cache : ws.v_cache).push_back(cache);
          (kv == 0 ? ws.k_slots : ws.v_slots).push_back(slots);
        }
      }
      ws.kv_data = kv_cache.data_ptr();
      ws.kv_sizes = kv_cache.sizes().vec();
      ws.kv_strides = kv_cache.strides().vec();
      ws.kv_dtype = kv_cache.scalar_type();
    }
  }

  // Layer i in the workspace: decoder_layer's ops in its order, on the same
  // values (so the same bits), each writing into its buffer.
  void layer_in_workspace(int64_t i, const Tensor& h, const Tensor& x, Tensor& h_out, Tensor& x_out,
                          const Tensor& cos, const Tensor& sin, const Tensor& slot_mapping,
                          const Tensor& block_tables, const Tensor& seq_lens, const Tensor& query_starts,
                          const Tensor& query_lens, const std::optional<Tensor>& tree_masks) {
    const LayerSpec& l = layers[size_t(i)];
    const Ops& op = ops();
    const OutOps& out = out_ops();
    auto linear = [&](const Tensor& in, const Tensor& w, int64_t kind, at::TensorList parts, at::IntArrayRef types,
                      const Tensor& y) {
      if (kind == kQuantParts) out.linear_parts.call(in, parts, types, y);
      else out.linear.call(in, w, kind - kQuantKind, y.size(1), y);
    };
    // Profiles see each layer as before (the per-layer op is not dispatched here).
    RECORD_FUNCTION("kvferry_layer::decoder_layer", std::vector<c10::IValue>());
    linear(x, l.qkv_w, l.qkv_kind, l.qkv_parts, l.qkv_part_types, ws.qkv);
    out.rope.call(ws.qk_in, cos, sin, ws.qk);
    op.write_kv.call(ws.k, ws.v, ws.k_slots[size_t(i)], ws.v_slots[size_t(i)], slot_mapping);
    op.attend(ws.q, ws.k_cache[size_t(i)], ws.v_cache[size_t(i)], block_tables, seq_lens, query_starts, query_lens,
              l.scale, ws.attn, tree_masks);
    linear(ws.attn2d, l.o_w, l.o_kind, {}, {}, ws.o);
    out.add_rms_norm.call(ws.o, h, l.post_norm_w, l.post_eps, ws.h1, ws.x1);
    linear(ws.x1, l.gate_up_w, l.gate_up_kind, l.gate_up_parts, l.gate_up_part_types, ws.gate_up);
    out.silu_and_mul.call(ws.gate_up, ws.up);
    linear(ws.up, l.down_w, l.down_kind, {}, {}, ws.down);
    out.add_rms_norm.call(ws.down, ws.h1, l.next_norm_w, l.next_eps, h_out, x_out);
  }
};

// Every layer of `stack` in turn, as the Python loop over decoder_layer runs
// them (layer i on kv_cache[i]): the same calls in the same order, so the
// same bits. kv_cache [L, 2, num_blocks, block_size, KVH, D].
std::tuple<Tensor, Tensor> decoder_layers(const c10::intrusive_ptr<LayerStack>& stack, const Tensor& h_in,
                                          const Tensor& x_in, const Tensor& cos, const Tensor& sin,
                                          const Tensor& kv_cache, const Tensor& slot_mapping,
                                          const Tensor& block_tables, const Tensor& seq_lens,
                                          const Tensor& query_starts, const Tensor& query_lens,
                                          const std::optional<Tensor>& tree_masks) {
  TORCH_CHECK(kv_cache.dim() == 6 && kv_cache.size(0) >= stack->size(),
              "decoder_layers: kv_cache must be [num_layers, 2, num_blocks, block_size, KVH, D]");
  const int64_t T = x_in.dim() == 2 ? x_in.size(0) : 0;
  if (stack->uniform_quant && stack->size() > 0 && T > 0 && T <= stack->max_workspace_rows && x_in.is_contiguous() &&
      h_in.sizes() == x_in.sizes() && h_in.stride(1) == 1 &&
      (x_in.scalar_type() == at::kBFloat16 || x_in.scalar_type() == at::kFloat) &&
      kv_cache.size(4) == stack->layers.front().num_kv_heads && kv_cache.is_contiguous()) {
    std::unique_lock<std::mutex> lock(stack->ws_mutex, std::try_to_lock);
    if (lock.owns_lock()) {
      stack->prepare(T, x_in, kv_cache);
      Workspace& ws = stack->ws;
      const int64_t L = stack->size();
      Tensor h_last = at::empty(x_in.sizes(), x_in.options()), x_last = at::empty(x_in.sizes(), x_in.options());
      for (int64_t i = 0; i < L; ++i) {
        const Tensor& h = i == 0 ? h_in : ws.h[(i - 1) % 2];
        const Tensor& x = i == 0 ? x_in : ws.x[(i - 1) % 2];
        Tensor& h_out = i == L - 1 ? h_last : ws.h[i % 2];
        Tensor& x_out = i == L - 1 ? x_last : ws.x[i % 2];
        stack->layer_in_workspace(i, h, x, h_out, x_out, cos, sin, slot_mapping, block_tables, seq_lens,
                                  query_starts, query_lens, tree_masks);
      }
      return {h_last, x_last};
    }
  }
  // Each layer through the dispatcher, unboxed (a fraction of a microsecond):
  // profiles and tests still see every layer's decoder_layer.
  static const auto layer = find_op<decltype(decoder_layer)>("kvferry_layer::decoder_layer");
  Tensor h = h_in, x = x_in;
  for (int64_t i = 0; i < stack->size(); ++i) {
    const LayerSpec& l = stack->layers[size_t(i)];
    std::tie(h, x) = layer.call(
        h, x, cos, sin, kv_cache.select(0, i), slot_mapping, block_tables, seq_lens, query_starts, query_lens,
        tree_masks, l.qkv_w, l.qkv_n, l.qkv_kind, l.qkv_bias, l.o_w, l.o_n, l.o_kind, l.post_norm_w, l.post_eps,
        l.gate_up_w, l.gate_up_n, l.gate_up_kind, l.down_w, l.down_n, l.down_kind, l.next_norm_w, l.next_eps,
        l.num_heads, l.num_kv_heads, l.scale, l.exact_rows, l.row_bucket, l.q_norm_w, l.k_norm_w, l.qk_eps,
        l.qkv_parts, l.qkv_part_types, l.gate_up_parts, l.gate_up_part_types);
  }
  return {h, x};
}

// A tensor-parallel rank's layer is the same ops in two calls, each ending
// where the Python layer's row-parallel matmul all-reduces (layers/parallel.py):
//
//   o = tp_attention(x, ...)                      o_proj's partial product (this rank's heads)
//   all_reduce(o)                                 in Python, over the rank's group
//   h1, d = tp_mlp(o, h, ...)                     h1, x1 = add_rms_norm(o, h); d = down_proj's partial product
//   all_reduce(d); h', x' = add_rms_norm(d, h1, next_norm)
//
// so its results are the Python TP layer's to the bit, as decoder_layer's are
// the Python layer's.
Tensor tp_attention(const Tensor& x, const Tensor& cos, const Tensor& sin, const Tensor& kv_cache_layer,
                    const Tensor& slot_mapping, const Tensor& block_tables, const Tensor& seq_lens,
                    const Tensor& query_starts, const Tensor& query_lens, const std::optional<Tensor>& tree_masks,
                    const Tensor& qkv_w, int64_t qkv_n, int64_t qkv_kind, const std::optional<Tensor>& qkv_bias,
                    const Tensor& o_w, int64_t o_n, int64_t o_kind, int64_t num_heads, int64_t num_kv_heads,
                    double scale, int64_t exact_rows, int64_t row_bucket, const std::optional<Tensor>& q_norm_w,
                    const std::optional<Tensor>& k_norm_w, double qk_eps, at::TensorList qkv_parts,
                    at::IntArrayRef qkv_part_types) {
  check_input(x);
  const Matmul gemm{exact_rows, row_bucket};
  return attention_product(ops(), gemm, x, cos, sin, kv_cache_layer, slot_mapping, block_tables, seq_lens,
                           query_starts, query_lens, tree_masks, qkv_w, qkv_n, qkv_kind, qkv_bias, o_w, o_n, o_kind,
                           num_heads, num_kv_heads, scale, q_norm_w, k_norm_w, qk_eps, qkv_parts, qkv_part_types);
}

std::tuple<Tensor, Tensor> tp_mlp(const Tensor& o, const Tensor& h, const Tensor& post_norm_w, double post_eps,
                                  const Tensor& gate_up_w, int64_t gate_up_n, int64_t gate_up_kind,
                                  const Tensor& down_w, int64_t down_n, int64_t down_kind, int64_t exact_rows,
                                  int64_t row_bucket, at::TensorList gate_up_parts,
                                  at::IntArrayRef gate_up_part_types) {
  check_input(o);
  TORCH_CHECK(h.sizes() == o.sizes(), "tp_mlp: o and h must be [tokens, hidden]");
  const Ops& op = ops();
  const Matmul gemm{exact_rows, row_bucket};
  auto [h1, x1] = op.add_rms_norm.call(o, h, post_norm_w, post_eps);
  return {h1, mlp_product(op, gemm, x1, gate_up_w, gate_up_n, gate_up_kind, down_w, down_n, down_kind, gate_up_parts,
                          gate_up_part_types)};
}

// Every layer of a tensor-parallel rank's stack in one call, with its two
// all-reduces a layer over shared memory (ShmSums): run_tp_layer's calls in
// its order (tp_attention, all-reduce, tp_mlp, all-reduce, add_rms_norm), so
// the same bits. Through Python a layer was two calls and two all-reduces of
// Python (their copy, flag and wait), ~0.25 ms of CPU a layer at batch 1.
std::tuple<Tensor, Tensor> tp_decoder_layers(const c10::intrusive_ptr<LayerStack>& stack,
                                             const c10::intrusive_ptr<ShmSums>& sums, const Tensor& h_in,
                                             const Tensor& x_in, const Tensor& cos, const Tensor& sin,
                                             const Tensor& kv_cache, const Tensor& slot_mapping,
                                             const Tensor& block_tables, const Tensor& seq_lens,
                                             const Tensor& query_starts, const Tensor& query_lens,
                                             const std::optional<Tensor>& tree_masks) {
  TORCH_CHECK(kv_cache.dim() == 6 && kv_cache.size(0) >= stack->size(),
              "tp_decoder_layers: kv_cache must be [num_layers, 2, num_blocks, block_size, KVH, D]");
  check_input(x_in);
  TORCH_CHECK(h_in.sizes() == x_in.sizes(), "tp_decoder_layers: h and x must be [tokens, hidden]");
  const Ops& op = ops();
  Tensor h = h_in, x = x_in;
  for (int64_t i = 0; i < stack->size(); ++i) {
    RECORD_FUNCTION("kvferry_layer::tp_layer", std::vector<c10::IValue>());
    const LayerSpec& l = stack->layers[size_t(i)];
    const Matmul gemm{l.exact_rows, l.row_bucket};
    Tensor o = attention_product(op, gemm, x, cos, sin, kv_cache.select(0, i), slot_mapping, block_tables, seq_lens,
                                 query_starts, query_lens, tree_masks, l.qkv_w, l.qkv_n, l.qkv_kind, l.qkv_bias, l.o_w,
                                 l.o_n, l.o_kind, l.num_heads, l.num_kv_heads, l.scale, l.q_norm_w, l.k_norm_w,
                                 l.qk_eps, l.qkv_parts, l.qkv_part_types)
                     .contiguous();
    sums->all_reduce_(o);
    auto [h1, x1] = op.add_rms_norm.call(o, h, l.post_norm_w, l.post_eps);
    Tensor d = mlp_product(op, gemm, x1, l.gate_up_w, l.gate_up_n, l.gate_up_kind, l.down_w, l.down_n, l.down_kind,
                           l.gate_up_parts, l.gate_up_part_types)
                   .contiguous();
    sums->all_reduce_(d);
    std::tie(h, x) = op.add_rms_norm.call(d, h1, l.next_norm_w, l.next_eps);
  }
  return {h, x};
}

}  // namespace

TORCH_LIBRARY(kvferry_layer, m) {
  m.def(
      "decoder_layer(Tensor h, Tensor x, Tensor cos, Tensor sin, Tensor(a!) kv_cache_layer, Tensor slot_mapping, "
      "Tensor block_tables, Tensor seq_lens, Tensor query_starts, Tensor query_lens, Tensor? tree_masks, "
      "Tensor qkv_w, int qkv_n, int qkv_kind, Tensor? qkv_bias, Tensor o_w, int o_n, int o_kind, "
      "Tensor post_norm_w, float post_eps, "
      "Tensor gate_up_w, int gate_up_n, int gate_up_kind, Tensor down_w, int down_n, int down_kind, "
      "Tensor next_norm_w, float next_eps, int num_heads, int num_kv_heads, float scale, int exact_rows, "
      "int row_bucket, Tensor? q_norm_w, Tensor? k_norm_w, float qk_eps, Tensor[] qkv_parts, "
      "int[] qkv_part_types, Tensor[] gate_up_parts, int[] gate_up_part_types) -> (Tensor, Tensor)");
  m.impl("decoder_layer", c10::DispatchKey::CPU, TORCH_FN(decoder_layer));
  // oneDNN's packed weights are MkldnnCPU tensors: a call with one dispatches there.
  m.impl("decoder_layer", c10::DispatchKey::MkldnnCPU, TORCH_FN(decoder_layer));
  m.def(
      "tp_attention(Tensor x, Tensor cos, Tensor sin, Tensor(a!) kv_cache_layer, Tensor slot_mapping, "
      "Tensor block_tables, Tensor seq_lens, Tensor query_starts, Tensor query_lens, Tensor? tree_masks, "
      "Tensor qkv_w, int qkv_n, int qkv_kind, Tensor? qkv_bias, Tensor o_w, int o_n, int o_kind, "
      "int num_heads, int num_kv_heads, "
      "float scale, int exact_rows, int row_bucket, Tensor? q_norm_w, Tensor? k_norm_w, float qk_eps, "
      "Tensor[] qkv_parts, int[] qkv_part_types) -> Tensor");
  m.impl("tp_attention", c10::DispatchKey::CPU, TORCH_FN(tp_attention));
  m.impl("tp_attention", c10::DispatchKey::MkldnnCPU, TORCH_FN(tp_attention));
  m.def(
      "tp_mlp(Tensor o, Tensor h, Tensor post_norm_w, float post_eps, Tensor gate_up_w, int gate_up_n, "
      "int gate_up_kind, Tensor down_w, int down_n, int down_kind, int exact_rows, int row_bucket, "
      "Tensor[] gate_up_parts, int[] gate_up_part_types) -> (Tensor, Tensor)");
  m.impl("tp_mlp", c10::DispatchKey::CPU, TORCH_FN(tp_mlp));
  m.impl("tp_mlp", c10::DispatchKey::MkldnnCPU, TORCH_FN(tp_mlp));
  m.class_<LayerStack>("LayerStack")
      .def(torch::init<>())
      .def("add", &LayerStack::add)
      .def("size", &LayerStack::size)
      .def("set_workspace_rows", &LayerStack::set_workspace_rows)
      .def("workspace_rows", &LayerStack::workspace_rows);
  m.class_<ShmSums>("ShmSums")
      .def(torch::init<Tensor, Tensor, int64_t, int64_t, std::vector<int64_t>, double>())
      .def("all_reduce_", &ShmSums::all_reduce_py)
      .def("exchange", &ShmSums::exchange_py)
      .def("calls", &ShmSums::calls_py)
      .def("wakes", &ShmSums::wakes_py);
  m.def(
      "tp_decoder_layers(__torch__.torch.classes.kvferry_layer.LayerStack stack, "
      "__torch__.torch.classes.kvferry_layer.ShmSums sums, Tensor h, Tensor x, Tensor cos, Tensor sin, "
      "Tensor(a!) kv_cache, Tensor slot_mapping, Tensor block_tables, Tensor seq_lens, Tensor query_starts, "
      "Tensor query_lens, Tensor? tree_masks=None) -> (Tensor, Tensor)");
  m.impl("tp_decoder_layers", c10::DispatchKey::CPU, TORCH_FN(tp_decoder_layers));
  m.def(
      "decoder_layers(__torch__.torch.classes.kvferry_layer.LayerStack stack, Tensor h, Tensor x, Tensor cos, "
      "Tensor sin, Tensor(a!) kv_cache, Tensor slot_mapping, Tensor block_tables, Tensor seq_lens, "
      "Tensor query_starts, Tensor query_lens, Tensor? tree_masks=None) -> (Tensor, Tensor)");
  m.impl("decoder_layers", c10::DispatchKey::CPU, TORCH_FN(decoder_layers));
}
