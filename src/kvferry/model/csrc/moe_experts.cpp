// A mixture-of-experts layer as one op (model/moe_op.py).
//
// moe_layer(x, gate_w, gate_n, gate_kind, top_k, renormalize, weights_float32, first_expert,
//           gate_up, down, gate_up_n, down_n, kind, shared, shared_n_kind, exact_rows, row_bucket,
//           routed_weights=None, routed_ids=None, expert_prefetch=0) -> out
//   moe.py's SparseMoeBlock.forward before its all-reduce, op for op:
//   logits  = gemm(x, gate_w)                       [T, E] (the router)
//   w, ids  = topk(softmax(logits, float32), top_k)  w / w.sum(-1) if renormalize;
//             (routed_weights, routed_ids) in their place where given;
//             rounded to x's dtype unless weights_float32
//   pairs   = (token, choice) with a local expert (first_expert < 0: every one;
//             else ids in [first_expert, first_expert + E): an expert-parallel rank's),
//             sorted by expert, in pair order within each (torch.argsort(stable=True))
//   ys      = rows e's = down_e(silu_and_mul(gate_up_e(x rows of e)))
//   out     = zeros(float32).index_add_(0, token, float(ys) * w).to(x's dtype)
//   shared  (qwen2_moe: shared = [gate_up_w, down_w, gate_w], shared_n_kind = each one's
//             [n, kind]): out + sigmoid(gemm(x, gate_w)) * down(silu_and_mul(gate_up(x)))
// expert_loop(xs, counts, gate_up, down, gate_up_n, down_n, kind, exact_rows, row_bucket,
//             expert_prefetch=0) -> ys
//   the experts alone over rows already sorted (counts[e] rows of expert e): the
//   block's op where its router or shared expert is not a plain packed matmul.
// expert_prefetch (both ops): 0 the experts' matmuls as plain_linear runs them;
//   1, 2, 3 bf16 small_gemm copies by linear_rows, its prefetch (and at 9-10
//   rows with 3, its one-pass kernel) chosen by rows (ExpertPrefetch below). The router's and shared expert's stay plain_linear's.
//
// gemm is op_calls.h's plain_linear (kind 1 small_gemm's copy, 2 oneDNN's, 3
// oneDNN's in fixed row blocks), the softmax, top-k, sums, the weighting and
// the scatter are the ATen ops moe.py calls, on the same whole tensors, so
// the output is the Python path's to the bit.
//
// What it saves: with several threads each of those ops was its own OpenMP
// region, and each region waited for every thread at its end. On a machine
// where other processes hold cores that is a wait for a descheduled thread,
// a dozen times a layer (the router's matmul, softmax, top-k, sort, gather,
// scatter ...): batch 1 ran at 7-8x its floor at 2 threads. Here the layer is
// one region (at::parallel_for over the threads; the ATen, oneDNN and
// small_gemm calls inside it run on the calling thread, as OpenMP does not
// nest):
//   - the first thread in routes, sorts and gathers (microseconds); another
//     takes the shared expert meanwhile (it needs x alone), and a thread with
//     nothing to do waits for the routing asleep after a brief spin (Event:
//     a spinning or yielding waiter burned a core for as long as the router
//     took, the whole of it where the OS parked the router);
//   - then every thread claims the active experts one at a time (a counter,
//     not a fixed split: a thread the OS parks for a while just takes fewer
//     of them), those with the most rows first (claim_order);
//   - the thread that finishes the last item (routing, shared expert and
//     experts counted alike) weights, scatters and adds the shared expert;
//     the others leave, and the region's end is the one wait.
// Fewer active experts than threads still splits by expert: each expert's
// weights are read by one core, which is what a thread's bandwidth allows.
#include "op_calls.h"

#include <ATen/Parallel.h>
#include <ATen/ThreadLocalState.h>
#include <torch/library.h>

#include <atomic>
#include <algorithm>
#include <condition_variable>
#include <limits>
#include <mutex>
#include <vector>

namespace {

// How the experts' bf16 small_gemm matmuls prefetch (moe_op.py's
// expert_prefetch): kLinear as small_gemm's linear (prefetcht0 of the next
// column block); kByRows none up to kNoPrefetchRows rows, prefetcht1 of the
// next block above (small_gemm.cpp's linear_prefetch: on Zen 4 each is the
// faster there, by 10-35% on cold experts); kByRowsAhead as kByRows but
// prefetcht1 of the weight stream itself from kNoPrefetchRows + 1 to
// kAheadMaxRows rows (linear_prefetch's mode 3: 5-10% faster there on Zen 4,
// slower from 9 rows, whose second row block reads the block from L2);
// kOnePass as kByRowsAhead, but at kAheadMaxRows + 1 to kOnePassMaxRows rows
// small_gemm's one-pass micro-kernel (linear_rows' wide: every row's
// accumulators over one pass of the weight stream, not two row blocks the
// second of which re-reads the block from L2), with the in-stream prefetcht1:
// on Zen 4, cold experts, 24% faster at 9 rows, 15% at 10.
// Neither prefetching nor the one-pass kernel changes any bits.
enum ExpertPrefetch : int64_t { kLinear = 0, kByRows = 1, kByRowsAhead = 2, kOnePass = 3 };
constexpr int64_t kNoPrefetchRows = 6;
constexpr int64_t kAheadMaxRows = 8;
constexpr int64_t kOnePassMaxRows = 10;  // small_gemm.cpp's MR_WIDE_MAX

// Every expert's two matmuls (each one's packed copy, one kind for all).
struct Experts {
  at::TensorList gate_up, down;
  int64_t gate_up_n, down_n, kind, exact_rows, row_bucket, prefetch;

  Tensor matmul(const Tensor& rows, const Tensor& w, int64_t n) const {
    if (prefetch != kLinear && kind == 1 && w.scalar_type() == at::kBFloat16) {
      static const auto linear_rows =
          find_op<Tensor(const Tensor&, const Tensor&, int64_t, int64_t, int64_t)>("kvferry_gemm::linear_rows");
      const int64_t m = rows.size(0);
      const bool ahead = prefetch == kByRowsAhead || prefetch == kOnePass;
      const bool one_pass = prefetch == kOnePass && m > kAheadMaxRows && m <= kOnePassMaxRows;
      // small_gemm's modes: 1 none; 3 prefetcht1 in the stream; 2 prefetcht1 of the next block
      const int64_t mode = m <= kNoPrefetchRows ? 1 : ((ahead && m <= kAheadMaxRows) || one_pass ? 3 : 2);
      return linear_rows.call(rows, w, n, mode, one_pass ? 1 : 0);
    }
    return plain_linear(rows, w, n, kind, exact_rows, row_bucket);
  }

  Tensor operator()(int64_t e, const Tensor& rows) const {
    static const auto silu_and_mul = find_op<Tensor(const Tensor&)>("kvferry_fused::silu_and_mul");
    const Tensor h = silu_and_mul.call(matmul(rows, gate_up[e], gate_up_n));
    return matmul(h, down[e], down_n);
  }
};

Experts check_experts(at::TensorList gate_up, at::TensorList down, int64_t gate_up_n, int64_t down_n, int64_t kind,
                      int64_t exact_rows, int64_t row_bucket, int64_t prefetch) {
  TORCH_CHECK(gate_up.size() == down.size(), "moe: one gate_up and one down weight per expert");
  TORCH_CHECK(kind >= 1 && kind <= 3, "moe: kind must be 1 (small_gemm), 2 or 3 (oneDNN)");
  TORCH_CHECK(prefetch >= kLinear && prefetch <= kOnePass, "moe: expert_prefetch must be 0, 1, 2 or 3, got ",
              prefetch);
  return Experts{gate_up, down, gate_up_n, down_n, kind, exact_rows, row_bucket, prefetch};
}

// A one-shot event the threads of a region wait on: set once (to a non-zero
// state) by one thread. A waiter spins briefly (routing at batch 1 takes
// tens of microseconds), then sleeps on a condition variable: spinning or
// yielding burns a core for as long as the setter takes, and on a shared
// machine the setter may be the thread the OS parked.
class Event {
 public:
  void set(int state) {
    {
      std::lock_guard<std::mutex> lock(mutex_);
      state_.store(state, std::memory_order_release);
    }
    ready_.notify_all();  // no system call where no thread sleeps
  }

  int wait() {
    for (int spins = 0; spins < kSpins; ++spins) {
      if (const int s = state_.load(std::memory_order_acquire)) return s;
#if defined(__x86_64__) || defined(__i386__)
      __builtin_ia32_pause();
#endif
    }
    std::unique_lock<std::mutex> lock(mutex_);
    ready_.wait(lock, [&] { return state_.load(std::memory_order_acquire) != 0; });
    return state_.load(std::memory_order_acquire);
  }

 private:
  static constexpr int kSpins = 256;  // a few microseconds of pause
  std::atomic<int> state_{0};
  std::mutex mutex_;
  std::condition_variable ready_;
};

// The order the threads claim the active experts in: most rows first (ties
// in expert order), so that the last items, which one thread may be left
// running while the others have nothing more to claim, are the shortest.
// The order changes no bits: each expert's rows are its own.
std::vector<int64_t> claim_order(const std::vector<int64_t>& active, at::IntArrayRef counts) {
  std::vector<int64_t> order(active.size());
  for (size_t a = 0; a < order.size(); ++a) order[a] = static_cast<int64_t>(a);
  std::stable_sort(order.begin(), order.end(),
                   [&](int64_t a, int64_t b) { return counts[active[a]] > counts[active[b]]; });
  return order;
}

// Work items over `items`, claimed one at a time by whichever thread is free,
// inside one parallel region; `last()` runs on the thread that completes the
// last item. An item that throws ends its thread's part (the region rethrows),
// and `last` then never runs.
template <typename Item, typename Last>
void claim_items(std::atomic<int64_t>& next, std::atomic<int64_t>& done, int64_t items, const Item& item,
                 const Last& last) {
  for (int64_t i; (i = next.fetch_add(1, std::memory_order_relaxed)) < items;) {
    item(i);
    // acq_rel: the last thread sees every other item's writes.
    if (done.fetch_add(1, std::memory_order_acq_rel) + 1 == items) last();
  }
}

Tensor expert_loop(const Tensor& xs, at::IntArrayRef counts, at::TensorList gate_up, at::TensorList down,
                   int64_t gate_up_n, int64_t down_n, int64_t kind, int64_t exact_rows, int64_t row_bucket,
                   int64_t expert_prefetch) {
  TORCH_CHECK(xs.dim() == 2 && xs.is_contiguous(), "expert_loop: xs must be a contiguous [pairs, hidden]");
  const Experts experts =
      check_experts(gate_up, down, gate_up_n, down_n, kind, exact_rows, row_bucket, expert_prefetch);
  const int64_t E = static_cast<int64_t>(counts.size());
  TORCH_CHECK(static_cast<int64_t>(gate_up.size()) == E, "expert_loop: one gate_up and one down weight per count");
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
  const int64_t A = static_cast<int64_t>(active.size());
  if (A == 0) return ys;
  // The caller's thread-local state (inference mode, dispatch keys) for the
  // workers' calls: ys is an inference tensor under torch.inference_mode.
  const at::ThreadLocalState caller;
  const std::vector<int64_t> order = claim_order(active, counts);
  std::atomic<int64_t> next{0}, done{0};
  at::parallel_for(0, std::min<int64_t>(A, at::get_num_threads()), 1, [&](int64_t, int64_t) {
    at::ThreadLocalStateGuard guard(caller);
    claim_items(next, done, A, [&](int64_t i) {
      const int64_t a = order[i], e = active[a], s = start[a], n = counts[e];
      ys.narrow(0, s, n).copy_(experts(e, xs.narrow(0, s, n)));
    }, [] {});
  });
  return ys;
}

// The (token, choice) pairs with a local expert, sorted by expert.
struct Routed {
  std::vector<int64_t> counts, active, start;  // rows per local expert; those with rows, each one's first row
  std::vector<int64_t> order;  // indices into active, in the order the threads claim them (claim_order)
  Tensor token;   // [P] int64: each sorted pair's token
  Tensor weight;  // [P] float32: its routing weight
  Tensor xs;      // [P, H]: x's rows in that order
};

// moe.py's fused_experts before its loop: a counting sort by local expert,
// pairs in their order within each (what argsort(stable=True) gives).
Routed sort_pairs(const Tensor& x, const Tensor& ids, const Tensor& weights, int64_t E, int64_t first_expert) {
  const bool everyone = first_expert < 0;  // no expert parallelism: every id is local
  const int64_t first = everyone ? 0 : first_expert, k = ids.size(1), P = ids.numel();
  const Tensor idc = ids.contiguous();
  const Tensor wf = weights.to(at::kFloat).contiguous();  // exact: the Python path's .float()
  const int64_t* id = idc.data_ptr<int64_t>();
  const float* wp = wf.data_ptr<float>();
  Routed r;
  r.counts.assign(E, 0);
  for (int64_t p = 0; p < P; ++p) {
    const int64_t e = id[p] - first;
    if (e >= 0 && e < E) {
      ++r.counts[e];
    } else {
      TORCH_CHECK(!everyone, "moe_layer: the router chose expert ", id[p], " of ", E);
    }
  }
  std::vector<int64_t> slot(E);
  int64_t total = 0;
  for (int64_t e = 0; e < E; ++e) {
    slot[e] = total;
    if (r.counts[e]) {
      r.active.push_back(e);
      r.start.push_back(total);
    }
    total += r.counts[e];
  }
  r.token = at::empty({total}, idc.options());
  r.weight = at::empty({total}, wf.options());
  int64_t* tok = r.token.data_ptr<int64_t>();
  float* w = r.weight.data_ptr<float>();
  for (int64_t p = 0; p < P; ++p) {
    const int64_t e = id[p] - first;
    if (e >= 0 && e < E) {
      const int64_t i = slot[e]++;
      tok[i] = p / k;
      w[i] = wp[p];
    }
  }
  r.xs = x.index_select(0, r.token);
  r.order = claim_order(r.active, r.counts);
  return r;
}

// A dense matmul's packed copy and its width and kind (the shared expert's three).
struct Mat {
  const Tensor& w;
  int64_t n, kind;
};

enum Routing : int { kRouted = 1, kFailed = 2 };  // the Event's states

Tensor moe_layer(const Tensor& x, const Tensor& gate_w, int64_t gate_n, int64_t gate_kind, int64_t top_k,
                 bool renormalize, bool weights_float32, int64_t first_expert, at::TensorList gate_up,
                 at::TensorList down, int64_t gate_up_n, int64_t down_n, int64_t kind, at::TensorList shared,
                 at::IntArrayRef shared_n_kind, int64_t exact_rows, int64_t row_bucket,
                 const std::optional<Tensor>& routed_weights, const std::optional<Tensor>& routed_ids,
                 int64_t expert_prefetch) {
  TORCH_CHECK(x.dim() == 2 && x.is_contiguous(), "moe_layer: x must be a contiguous [tokens, hidden]");
  const Experts experts =
      check_experts(gate_up, down, gate_up_n, down_n, kind, exact_rows, row_bucket, expert_prefetch);
  TORCH_CHECK(shared.empty() || (shared.size() == 3 && shared_n_kind.size() == 6),
              "moe_layer: shared is [] or [gate_up, down, gate] with shared_n_kind their [n, kind] each");
  const int64_t E = static_cast<int64_t>(gate_up.size()), T = x.size(0);
  // A chosen routing (bench/profile_moe.py times a given number of active
  // experts through the served op): the router still runs, as its cost is
  // the step's, and its choice is replaced. Checked here, not in the region.
  TORCH_CHECK(routed_weights.has_value() == routed_ids.has_value(),
              "moe_layer: routed_weights and routed_ids go together");
  if (routed_ids) {
    TORCH_CHECK(routed_ids->scalar_type() == at::kLong && routed_ids->sizes() == at::IntArrayRef({T, top_k}),
                "moe_layer: routed_ids must be int64 [tokens, top_k]");
    TORCH_CHECK(at::isFloatingType(routed_weights->scalar_type()) &&
                    routed_weights->sizes() == at::IntArrayRef({T, top_k}),
                "moe_layer: routed_weights must be floating [tokens, top_k]");
  }
  const bool has_shared = !shared.empty();
  auto gemm = [&](const Tensor& rows, const Mat& m) {
    return plain_linear(rows, m.w, m.n, m.kind, exact_rows, row_bucket);
  };
  static const auto silu_and_mul = find_op<Tensor(const Tensor&)>("kvferry_fused::silu_and_mul");

  // Work: routing (the first thread in), the shared expert (any thread: it
  // needs x alone, so a thread takes it while the first routes), then the
  // active experts one at a time. Each counts in `done` when finished; the
  // thread that finishes the last of the `total` scatters.
  Routed r;
  Tensor ys, shared_out, shared_logit, out;
  // Set by the router before its own count; until then no count can be the
  // last (the router's is missing), whatever a thread reads here.
  std::atomic<int64_t> total{std::numeric_limits<int64_t>::max()};
  auto route = [&] {
    Tensor w, ids;
    std::tie(w, ids) = at::topk(at::softmax(gemm(x, Mat{gate_w, gate_n, gate_kind}), -1, at::kFloat), top_k, -1);
    if (renormalize) w = w / w.sum(-1, true);
    if (routed_ids) {
      w = *routed_weights;
      ids = *routed_ids;
    }
    if (!weights_float32) w = w.to(x.scalar_type());  // Qwen rounds them to the model's dtype (HF)
    r = sort_pairs(x, ids, w, E, first_expert);
    ys = at::empty({r.xs.size(0), down_n}, x.options());
    total.store(1 + (has_shared ? 1 : 0) + static_cast<int64_t>(r.active.size()), std::memory_order_relaxed);
  };
  auto shared_expert = [&] {
    const Tensor h = silu_and_mul.call(gemm(x, Mat{shared[0], shared_n_kind[0], shared_n_kind[1]}));
    shared_out = gemm(h, Mat{shared[1], shared_n_kind[2], shared_n_kind[3]});
    shared_logit = gemm(x, Mat{shared[2], shared_n_kind[4], shared_n_kind[5]});
  };
  auto expert = [&](int64_t i) {
    const int64_t a = r.order[i], e = r.active[a], s = r.start[a], n = r.counts[e];
    ys.narrow(0, s, n).copy_(experts(e, r.xs.narrow(0, s, n)));
  };
  auto combine = [&] {
    Tensor sum = at::zeros({T, down_n}, x.options().dtype(at::kFloat));
    sum.index_add_(0, r.token, ys.to(at::kFloat).mul_(r.weight.unsqueeze(1)));
    out = sum.to(x.scalar_type());
    if (has_shared) out = out + at::sigmoid(shared_logit) * shared_out;
  };

  const at::ThreadLocalState caller;  // inference mode, dispatch keys: the workers' calls run under the caller's
  std::atomic<bool> routing_taken{false}, shared_taken{!has_shared};
  std::atomic<int64_t> next{0}, done{0};
  Event routed;
  // acq_rel: the last thread sees every other item's writes (ys, shared_out).
  auto finished = [&] {
    if (done.fetch_add(1, std::memory_order_acq_rel) + 1 == total.load(std::memory_order_relaxed)) combine();
  };
  auto take_shared = [&] {
    if (!shared_taken.exchange(true, std::memory_order_acq_rel)) {
      shared_expert();
      finished();
    }
  };
  at::parallel_for(0, at::get_num_threads(), 1, [&](int64_t, int64_t) {
    at::ThreadLocalStateGuard guard(caller);
    if (!routing_taken.exchange(true, std::memory_order_acq_rel)) {
      try {
        route();
      } catch (...) {
        routed.set(kFailed);  // the others stop waiting; the region rethrows
        throw;
      }
      routed.set(kRouted);
      finished();  // the last count where no expert here was chosen (expert parallelism) and no shared one waits
    } else {
      take_shared();
      if (routed.wait() == kFailed) return;
    }
    take_shared();
    const int64_t A = static_cast<int64_t>(r.active.size());
    for (int64_t a; (a = next.fetch_add(1, std::memory_order_relaxed)) < A;) {
      expert(a);
      finished();
    }
  });
  return out;
}

}  // namespace

TORCH_LIBRARY(kvferry_moe, m) {
  m.def("expert_loop(Tensor xs, int[] counts, Tensor[] gate_up, Tensor[] down, int gate_up_n, int down_n, "
        "int kind, int exact_rows, int row_bucket, int expert_prefetch=0) -> Tensor");
  m.def("moe_layer(Tensor x, Tensor gate_w, int gate_n, int gate_kind, int top_k, bool renormalize, "
        "bool weights_float32, int first_expert, Tensor[] gate_up, Tensor[] down, int gate_up_n, int down_n, "
        "int kind, Tensor[] shared, int[] shared_n_kind, int exact_rows, int row_bucket, "
        "Tensor? routed_weights=None, Tensor? routed_ids=None, int expert_prefetch=0) -> Tensor");
  // oneDNN's packed weights are MkldnnCPU tensors: a call with them dispatches there.
  for (auto key : {c10::DispatchKey::CPU, c10::DispatchKey::MkldnnCPU}) {
    m.impl("expert_loop", key, TORCH_FN(expert_loop));
    m.impl("moe_layer", key, TORCH_FN(moe_layer));
  }
}
