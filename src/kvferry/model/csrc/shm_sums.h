// The shared-memory all-reduce of parallel/shm_all_reduce.py in C++, so that a
// tensor-parallel rank's decoder layers run in one call with their sums inside
// (decoder_layer.cpp: tp_decoder_layers), and so that a rank waiting for its
// peer sleeps on a futex instead of napping.
//
// The segment and the protocol are ShmAllReduce's (see there): int64 flags,
// one per rank, then two buffers of one slot per rank. A rank's flag is the
// number of calls it has made, so the Python side and this one continue each
// other's count. Call seq: copy into this rank's slot of buffer seq % 2,
// store seq into the flag (release: a peer that sees the flag sees the data),
// wait until every flag is >= seq (acquire), then sum the slots exactly as
// the Python side does (the same ATen ops: the same bits).
//
// Waiting: spin (yielding) for kSpinNs, as a peer on its own core arrives
// within microseconds; then sleep on the peer's flag as a futex (its low 32
// bits) in slices of kSliceNs, checking between slices that the peer's
// process is alive and that the group's timeout has not passed. Python's
// wait napped instead (50 us doubling to 1 ms): a peer that arrived during a
// nap was seen up to a nap later, and on a loaded host naps grew to 1 ms.
//
// Waking: after each store the flag's owner makes a FUTEX_WAKE only when a
// peer sleeps on that flag. Each flag has a count of its sleepers beside it
// (the segment's header: world flags, then world counts); a sleeper adds
// itself before its last look at the flag, the owner reads the count after
// its store, both sequentially consistent, so either the sleeper sees the
// new flag and does not sleep or the owner sees the sleeper and wakes it
// (and FUTEX_WAIT itself fails on a flag that moved in between). Balanced
// ranks rarely sleep: a wake after every store was a syscall per all-reduce
// that nobody waited on (33 a decode step of a 16-layer model, per rank).
#pragma once

#include <ATen/ATen.h>
#include <torch/custom_class.h>

#include <linux/futex.h>
#include <sched.h>
#include <signal.h>
#include <sys/syscall.h>
#include <time.h>
#include <unistd.h>

#include <cerrno>
#include <chrono>
#include <climits>
#include <cstdint>
#include <cstring>
#include <fstream>
#include <iterator>
#include <string>
#include <vector>

namespace {

// A peer on its own core arrives within microseconds of this rank when the
// ranks' work is balanced; past this the waiter sleeps. While it spins it
// yields between looks: on a loaded host the peer may be queued on this very
// core (a pause-only spin there cost a [1, 2048] sum twice the wall time).
constexpr int64_t kSpinNs = 100'000;
// How often a sleeping waiter looks at its peer's process and the timeout.
constexpr int64_t kSliceNs = 50'000'000;
// Errors start with this, so Python can tell a failed collective (CollectiveError) from other errors.
constexpr const char* kShmError = "shm collective: ";

inline int64_t now_ns() {
  return std::chrono::duration_cast<std::chrono::nanoseconds>(std::chrono::steady_clock::now().time_since_epoch())
      .count();
}

// Python's _alive: a pid that answers signal 0 and is not a zombie.
inline bool process_alive(int64_t pid) {
  if (kill(pid_t(pid), 0) != 0 && errno != EPERM) return false;
  std::ifstream f("/proc/" + std::to_string(pid) + "/stat");
  if (!f) return false;
  const std::string stat((std::istreambuf_iterator<char>(f)), std::istreambuf_iterator<char>());
  const size_t close = stat.rfind(')');
  return close != std::string::npos && close + 2 < stat.size() && stat[close + 2] != 'Z';
}

struct ShmSums : torch::CustomClassHolder {
  Tensor flags_tensor, data_tensor;  // keep the views of the segment (and so its mapping) alive
  int64_t* flags;
  int64_t* sleepers;  // sleepers[r]: how many ranks sleep on flags[r] now
  int64_t wakes_made = 0;  // FUTEX_WAKE calls this rank made (the tests' view of the syscalls)
  uint8_t* data;
  int64_t rank, world, slot_bytes;
  std::vector<int64_t> pids;
  double timeout_s;

  // flags: int64 [2 world] over the segment (each rank's flag, then each flag's
  // count of sleepers); data: uint8 [2 world slot_bytes] after it.
  ShmSums(Tensor flags_, Tensor data_, int64_t rank_, int64_t slot_bytes_, std::vector<int64_t> pids_,
          double timeout_s_)
      : flags_tensor(std::move(flags_)), data_tensor(std::move(data_)), rank(rank_), slot_bytes(slot_bytes_),
        pids(std::move(pids_)), timeout_s(timeout_s_) {
    world = flags_tensor.numel() / 2;
    TORCH_CHECK(flags_tensor.scalar_type() == at::kLong && flags_tensor.is_contiguous() &&
                    flags_tensor.numel() == 2 * world && world > 0,
                "ShmSums: int64 flags, then as many sleeper counts");
    TORCH_CHECK(data_tensor.scalar_type() == at::kByte && data_tensor.numel() == 2 * world * slot_bytes,
                "ShmSums: data must be 2 x world_size slots of bytes");
    TORCH_CHECK(0 <= rank && rank < world && int64_t(pids.size()) == world, "ShmSums: rank or pids out of range");
    TORCH_CHECK(reinterpret_cast<uintptr_t>(flags_tensor.data_ptr()) % 8 == 0, "ShmSums: flags must be aligned");
    flags = flags_tensor.data_ptr<int64_t>();
    sleepers = flags + world;
    data = data_tensor.data_ptr<uint8_t>();
  }

  // This rank's calls so far (its flag).
  int64_t calls() const { return __atomic_load_n(&flags[rank], __ATOMIC_RELAXED); }

  uint8_t* slot(int64_t seq, int64_t r) const { return data + ((seq % 2) * world + r) * slot_bytes; }

  // One call: x's bytes into this rank's slot, the flag, and the wait for every
  // peer's. Returns the call's number (its buffer is seq % 2).
  int64_t exchange(const Tensor& x, const char* name) {
    const int64_t nbytes = x.numel() * int64_t(x.element_size());
    TORCH_CHECK(x.is_contiguous() && nbytes <= slot_bytes, kShmError, name, ": ", nbytes,
                " bytes do not fit a slot of ", slot_bytes);
    const int64_t seq = calls() + 1;
    std::memcpy(slot(seq, rank), x.data_ptr(), size_t(nbytes));
    // After the data; sequentially consistent, so that the sleepers' count is read after it (see the top).
    __atomic_store_n(&flags[rank], seq, __ATOMIC_SEQ_CST);
    if (__atomic_load_n(&sleepers[rank], __ATOMIC_SEQ_CST) > 0) {
      syscall(SYS_futex, reinterpret_cast<uint32_t*>(&flags[rank]), FUTEX_WAKE, INT_MAX, nullptr, nullptr, 0);
      ++wakes_made;
    }
    wait(seq, name);
    return seq;
  }

  void wait(int64_t seq, const char* name) const {
    const int64_t start = now_ns();
    int64_t last_check = start;
    for (int64_t r = 0; r < world; ++r) {
      if (r == rank) continue;
      int64_t* flag = &flags[r];
      for (;;) {
        const int64_t seen = __atomic_load_n(flag, __ATOMIC_ACQUIRE);
        if (seen >= seq) break;
        const int64_t now = now_ns();
        if (now - start < kSpinNs) {
          sched_yield();
          continue;
        }
        // Counted among the flag's sleepers before the last look at it: its
        // owner, storing after that look, sees the count and wakes us.
        __atomic_add_fetch(&sleepers[r], 1, __ATOMIC_SEQ_CST);
        const int64_t last = __atomic_load_n(flag, __ATOMIC_SEQ_CST);
        if (last < seq) {  // sleeps unless the flag moved since this look
          const timespec slice{0, kSliceNs};
          syscall(SYS_futex, reinterpret_cast<uint32_t*>(flag), FUTEX_WAIT, uint32_t(uint64_t(last)), &slice, nullptr,
                  0);
        }
        __atomic_sub_fetch(&sleepers[r], 1, __ATOMIC_SEQ_CST);
        if (now_ns() - last_check >= kSliceNs) {
          last_check = now_ns();
          check_peers(seq, double(last_check - start) / 1e9, name);
        }
      }
    }
  }

  void check_peers(int64_t seq, double waited_s, const char* name) const {
    for (int64_t r = 0; r < world; ++r) {
      if (__atomic_load_n(&flags[r], __ATOMIC_ACQUIRE) < seq && !process_alive(pids[size_t(r)]))
        TORCH_CHECK(false, kShmError, "rank ", rank, " of ", world, ": ", name, " failed: rank ", r, " (pid ",
                    pids[size_t(r)], ") is gone");
    }
    if (waited_s > timeout_s) {
      std::string late;
      for (int64_t r = 0; r < world; ++r)
        if (__atomic_load_n(&flags[r], __ATOMIC_ACQUIRE) < seq) late += (late.empty() ? "" : ", ") + std::to_string(r);
      TORCH_CHECK(false, kShmError, "rank ", rank, " of ", world, ": ", name, " failed: rank(s) [", late,
                  "] did not answer within ", timeout_s, "s");
    }
  }

  Tensor slot_view(int64_t seq, int64_t r, const Tensor& like) const {
    return at::from_blob(slot(seq, r), {like.numel()}, like.options());
  }

  // ShmAllReduce._reduce_chunk: the same sums in the same order.
  void reduce_chunk(const Tensor& x) {
    const int64_t seq = exchange(x, "all_reduce");
    const auto dtype = x.scalar_type();
    if (world == 2 && (dtype == at::kFloat || dtype == at::kBFloat16 || dtype == at::kHalf || dtype == at::kDouble)) {
      x.add_(slot_view(seq, 1 - rank, x));
    } else if (dtype == at::kFloat && world >= 2) {  // one rank: the copy below
      at::add_out(const_cast<Tensor&>(x), slot_view(seq, 0, x), slot_view(seq, 1, x));
      for (int64_t r = 2; r < world; ++r) x.add_(slot_view(seq, r, x));
    } else {
      Tensor total = slot_view(seq, 0, x).to(at::kFloat);
      for (int64_t r = 1; r < world; ++r) total.add_(slot_view(seq, r, x));
      x.copy_(total);
    }
  }

  // x (contiguous, floating, CPU) summed over the ranks in place, in calls of a slot each.
  void all_reduce_(const Tensor& x) {
    TORCH_CHECK(x.is_contiguous() && x.is_floating_point() && x.device().is_cpu(),
                "ShmSums.all_reduce_: a contiguous floating-point CPU tensor");
    const Tensor flat = x.view({-1});
    const int64_t per_call = slot_bytes / int64_t(x.element_size());
    for (int64_t start = 0; start < flat.numel(); start += per_call)
      reduce_chunk(flat.narrow(0, start, std::min(per_call, flat.numel() - start)));
  }

  // For Python's all_gather: x into the slots and the wait; the call's number.
  int64_t exchange_py(Tensor x) { return exchange(x.contiguous().view({-1}), "all_gather"); }
  void all_reduce_py(Tensor x) { all_reduce_(x); }
  int64_t calls_py() const { return calls(); }
  int64_t wakes_py() const { return wakes_made; }
};

}  // namespace
