// How the kernels split their work among torch's threads (its OpenMP pool).
#pragma once

#include <ATen/Parallel.h>

#include <algorithm>
#include <atomic>
#include <cstdint>
#include <vector>

namespace packed {

// Blocks [0, blocks) split among torch's threads as even ranges, each taken `chunk` blocks at a time from
// its front by its thread; a thread done with its own range takes chunks from the back of the others'. A
// thread the OS takes away for a while (a server's HTTP process and its clients share the cores) so leaves
// the rest of its range to the others instead of making them wait at the op's end; on a quiet machine the
// ranges end together, as fixed halves did. work(b0, b1) runs once per chunk; each output is computed by
// one thread in one pass, so the result does not depend on who took it. A range's two ends share one
// 64-bit word (blocks < 2^32), so a take from either end is one compare-and-swap.
class Ranges {
 public:
  explicit Ranges(int64_t n) : slots_(n) {}
  void set(int64_t t, int64_t b0, int64_t b1) { slots_[t].v.store(uint64_t(b0) << 32 | uint64_t(b1)); }
  // [b0, b1): up to `chunk` blocks of range t, from its front or its back; false when it is empty.
  bool take(int64_t t, int64_t chunk, bool front, int64_t& b0, int64_t& b1) {
    std::atomic<uint64_t>& v = slots_[t].v;
    uint64_t now = v.load(std::memory_order_relaxed), next;
    do {
      const int64_t f = int64_t(now >> 32), b = int64_t(now & 0xffffffffu);
      if (f >= b) return false;
      b0 = front ? f : std::max(f, b - chunk);
      b1 = front ? std::min(b, f + chunk) : b;
      next = front ? uint64_t(b1) << 32 | uint64_t(b) : uint64_t(f) << 32 | uint64_t(b0);
    } while (!v.compare_exchange_weak(now, next, std::memory_order_relaxed));
    return true;
  }

 private:
  struct alignas(64) Slot {
    std::atomic<uint64_t> v{0};
  };
  std::vector<Slot> slots_;
};

template <class Work>
inline void share_blocks(int64_t blocks, int64_t chunk, Work work) {
  const int64_t threads = std::min<int64_t>(at::get_num_threads(), (blocks + chunk - 1) / chunk);
  if (threads <= 1 || at::in_parallel_region()) return work(0, blocks);
  Ranges ranges(threads);
  for (int64_t t = 0; t < threads; ++t) ranges.set(t, blocks * t / threads, blocks * (t + 1) / threads);
  at::parallel_for(0, threads, 1, [&](int64_t t0, int64_t t1) {
    int64_t b0, b1;
    for (int64_t t = t0; t < t1; ++t)
      while (ranges.take(t, chunk, true, b0, b1)) work(b0, b1);
    for (int64_t k = 1; k < threads; ++k)
      while (ranges.take((t0 + k) % threads, chunk, false, b0, b1)) work(b0, b1);
  });
}

}  // namespace packed
