// A probe of `share_blocks` for the tests: per block, the thread that took it and how many times it was
// taken, when each chunk takes `chunk_us` microseconds and the last thread stops for `stall_us` after its
// first chunk (as if the OS had taken it away).
#include <ATen/ATen.h>
#include <torch/library.h>

#include <chrono>
#include <thread>

#include "work_sharing.h"

namespace {

at::Tensor share_blocks_probe(int64_t blocks, int64_t chunk, int64_t chunk_us, int64_t stall_us) {
  at::Tensor taken = at::zeros({blocks, 2}, at::kLong);  // [blocks, (thread, times taken)]
  int64_t* tp = taken.data_ptr<int64_t>();
  const int64_t last = at::get_num_threads() - 1;
  std::atomic<bool> stalled{false};
  packed::share_blocks(blocks, chunk, [&](int64_t b0, int64_t b1) {
    const int64_t me = at::get_thread_num();
    for (int64_t b = b0; b < b1; ++b) {
      tp[2 * b] = me;
      __atomic_fetch_add(&tp[2 * b + 1], 1, __ATOMIC_RELAXED);
    }
    std::this_thread::sleep_for(std::chrono::microseconds(chunk_us));
    if (me == last && !stalled.exchange(true)) std::this_thread::sleep_for(std::chrono::microseconds(stall_us));
  });
  return taken;
}

}  // namespace

TORCH_LIBRARY_FRAGMENT(thunder_batch, m) {
  m.def("share_blocks_probe(int blocks, int chunk, int chunk_us, int stall_us) -> Tensor", &share_blocks_probe);
}
