// What the float32 and bfloat16 packed linears share: the block of 16 output features, the AVX2 tail
// store, the L2 groups of blocks, the split of M rows into register-sized passes, and the AMX kernel.
#pragma once

#include <immintrin.h>

#include <algorithm>
#include <cstdint>
#include <vector>

#include "work_sharing.h"

#define AVX512 __attribute__((target("avx512f")))
#define AVX2 __attribute__((target("avx2,fma")))
// Unrolled in full, the accumulator arrays live in registers (g++ 12 otherwise stores them every step).
#define UNROLL _Pragma("GCC unroll 16")

namespace packed {

constexpr int64_t kBlock = 16;  // output features per packed block (one zmm of float32, two ymm)
using bf16 = uint16_t;

// AMX (packed_linear_amx.cpp): whether its bfloat16 kernel runs a linear of this input width here (the
// CPU's AMX-BF16, the OS's permission, `in` a multiple of 32), and the kernel on blocks [blk0, blk1).
bool amx_runs(int64_t in_features);
void rows_amx(const bf16* x, int64_t M, int64_t I, const bf16* packed, const float* bias, int64_t blk0, int64_t blk1,
              bf16* y, int64_t O);

AVX2 inline void store_avx2(float* y, __m256 v, int64_t n) {  // the first n (<= 8, maybe <= 0) floats of v
  if (n >= 8) return _mm256_storeu_ps(y, v);
  const __m256i lane = _mm256_setr_epi32(0, 1, 2, 3, 4, 5, 6, 7);
  _mm256_maskstore_ps(y, _mm256_cmpgt_epi32(_mm256_set1_epi32(int(std::max<int64_t>(n, 0))), lane), v);
}

inline int64_t l2_group(int64_t I, int64_t bytes, int64_t group_bytes = 128 << 10) {  // blocks per group
  return std::max<int64_t>(1, group_bytes / (I * kBlock * bytes));
}

// Blocks per L2 group of the AVX-512 kernels (fp32, vdpbf16ps: 256 KiB) and of the AMX kernel (pairs of
// blocks); a linear's threads also take their work one such group at a time (work_sharing.h).
inline int64_t group_512(int64_t I, int64_t bytes) { return l2_group(I, bytes, 256 << 10); }
inline int64_t amx_group(int64_t I) { return std::max<int64_t>(2, group_512(I, sizeof(bf16))); }

// A float buffer of at least `floats` for this thread, kept across calls (the widened blocks of quantized_linear.cpp
// and plain_linear.cpp): a fresh one per block was an mmap and its page faults each time.
inline float* thread_buffer(int64_t floats) {
  thread_local std::vector<float> buffer;
  if (int64_t(buffer.size()) < floats) buffer.resize(floats);
  return buffer.data();
}

// M rows in passes of at most `most` rows, as even as they go (8 rows: 4 + 4, not 6 + 2): pass(m0, rows).
template <class Pass>
inline void even_passes(int64_t M, int64_t most, Pass pass) {
  const int64_t passes = (M + most - 1) / most;
  for (int64_t p = 0, m = 0; p < passes; ++p) {
    const int64_t rows = M / passes + (p < M % passes);
    pass(m, rows);
    m += rows;
  }
}

}  // namespace packed
