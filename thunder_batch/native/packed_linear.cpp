// float32 y = x @ w.T (+ b) for few rows of x, from weights packed once: the decode step's linears.
//
// At 1-16 rows a linear layer is a read of its weights. The weight is packed once into blocks of 16
// output features, [ceil(O/16), I, 16]: one 64-byte load holds 16 outputs' weights for one input, so
// the whole matrix is read as one sequential stream, each value once, multiplied by every row of x
// (a broadcast x[r, i]) into accumulators that hold 16 outputs each: no horizontal sums. Blocks of
// outputs are shared among torch's threads (work_sharing.h). AVX-512F, or AVX2 + FMA (a block as two ymm,
// chosen per call from the CPU; callers check for AVX2 + FMA first). Each output is one float32 FMA chain
// over the inputs in order, on both paths: the same result to the bit. bfloat16: packed_linear_bf16.cpp.
//
#include <ATen/ATen.h>
#include <ATen/Parallel.h>
#include <torch/library.h>

#include "ops.h"
#include "packed_tiles.h"

namespace {

using namespace packed;

// Inputs ahead that each weight stream is prefetched (2 KiB): from 4 rows up the hardware prefetcher alone
// left the loop waiting on memory (at 8 rows 22 GB/s against a 31 GB/s plain read; RESULTS.md).
constexpr int64_t kAhead = 32;

// acc[r][b]: outputs of block (blk0 + b) for row (m0 + r); R rows x NB blocks of accumulators.
template <int R, int NB>
AVX512 void tile(const float* x, int64_t I, const float* packed, int64_t blk0, int64_t m0, float* y, int64_t O) {
  __m512 acc[R][NB];
  for (int r = 0; r < R; ++r)
    for (int b = 0; b < NB; ++b) acc[r][b] = _mm512_setzero_ps();
  const float* base = packed + blk0 * I * kBlock;
  for (int64_t i = 0; i < I; ++i) {
    __m512 wv[NB];
    for (int b = 0; b < NB; ++b) {
      _mm_prefetch(reinterpret_cast<const char*>(base + (b * I + i + kAhead) * kBlock), _MM_HINT_T0);
      wv[b] = _mm512_loadu_ps(base + (b * I + i) * kBlock);
    }
    for (int r = 0; r < R; ++r) {
      const __m512 xv = _mm512_set1_ps(x[(m0 + r) * I + i]);
      for (int b = 0; b < NB; ++b) acc[r][b] = _mm512_fmadd_ps(xv, wv[b], acc[r][b]);
    }
  }
  for (int r = 0; r < R; ++r)
    for (int b = 0; b < NB; ++b) {
      const int64_t o = (blk0 + b) * kBlock, n = std::min<int64_t>(kBlock, O - o);
      _mm512_mask_storeu_ps(y + (m0 + r) * O + o, __mmask16((1u << n) - 1), acc[r][b]);
    }
}

template <int R, int NB>
AVX512 void tiles(const float* x, int64_t I, const float* packed, int64_t blk0, int64_t blk1, int64_t m0, float* y,
                  int64_t O) {
  int64_t blk = blk0;
  for (; blk + NB <= blk1; blk += NB) tile<R, NB>(x, I, packed, blk, m0, y, O);
  for (; blk < blk1; ++blk) tile<R, 1>(x, I, packed, blk, m0, y, O);
}

// One pass of the R <= 7 rows left after the 16- and 8-row passes, R x NB blocks (at most 24 of the 32
// registers hold accumulators). A pass reads its group of weights from L2 again: rows split into passes of
// 4, 2, 1 ran 6 rows at 19.5 GB/s against 25.5 at 4 rows, 23 in one 6 x 4 pass (RESULTS.md).
AVX512 void pass(int64_t R, const float* x, int64_t I, const float* packed, int64_t g0, int64_t g1, int64_t m0,
                 float* y, int64_t O) {
  switch (R) {
    case 7: return tiles<7, 3>(x, I, packed, g0, g1, m0, y, O);
    case 6: return tiles<6, 4>(x, I, packed, g0, g1, m0, y, O);
    case 5: return tiles<5, 4>(x, I, packed, g0, g1, m0, y, O);
    case 4: return tiles<4, 4>(x, I, packed, g0, g1, m0, y, O);
    case 3: return tiles<3, 4>(x, I, packed, g0, g1, m0, y, O);
    case 2: return tiles<2, 2>(x, I, packed, g0, g1, m0, y, O);
    default: return tiles<1, 4>(x, I, packed, g0, g1, m0, y, O);
  }
}

// Every row against each L2 group of blocks (256 KiB of weights, read from memory once), in passes of 16
// rows x 1 block, 8 x 3, then one pass of the rest: measured best on a 2-core AVX-512 Xeon at 1-64 rows
// (benchmarks/RESULTS.md).
AVX512 void rows(const float* x, int64_t M, int64_t I, const float* packed, int64_t blk0, int64_t blk1, float* y,
                 int64_t O) {
  const int64_t group = group_512(I, sizeof(float));
  for (int64_t g0 = blk0; g0 < blk1; g0 += group) {
    const int64_t g1 = std::min(blk1, g0 + group);
    int64_t m = 0;
    for (; m + 16 <= M; m += 16) tiles<16, 1>(x, I, packed, g0, g1, m, y, O);
    for (; m + 8 <= M; m += 8) tiles<8, 3>(x, I, packed, g0, g1, m, y, O);
    if (m < M) pass(M - m, x, I, packed, g0, g1, m, y, O);
  }
}

// AVX2 + FMA: acc[r][2b + h] holds outputs 8h..8h+7 of block (blk0 + b) for row (m0 + r); 16 ymm
// registers hold R * NB * 2 accumulators, the weights of one input and a broadcast x. `w` points at
// block blk0's weights [I, 16].
template <int R, int NB>
AVX2 void tile_avx2(const float* x, int64_t I, const float* w, int64_t blk0, int64_t m0, float* y, int64_t O) {
  __m256 acc[R][2 * NB];
  UNROLL for (int r = 0; r < R; ++r)
    UNROLL for (int v = 0; v < 2 * NB; ++v) acc[r][v] = _mm256_setzero_ps();
  for (int64_t i = 0; i < I; ++i) {
    __m256 wv[2 * NB];
    UNROLL for (int v = 0; v < 2 * NB; ++v) wv[v] = _mm256_loadu_ps(w + ((v / 2) * I + i) * kBlock + (v % 2) * 8);
    UNROLL for (int r = 0; r < R; ++r) {
      const __m256 xv = _mm256_broadcast_ss(x + (m0 + r) * I + i);
      UNROLL for (int v = 0; v < 2 * NB; ++v) acc[r][v] = _mm256_fmadd_ps(xv, wv[v], acc[r][v]);
    }
  }
  UNROLL for (int r = 0; r < R; ++r)
    UNROLL for (int v = 0; v < 2 * NB; ++v) {
      const int64_t o = (blk0 + v / 2) * kBlock + (v % 2) * 8;
      store_avx2(y + (m0 + r) * O + o, acc[r][v], O - o);
    }
}

template <int R, int NB>  // blocks [blk0, blk1) for rows m0..m0+R-1; w: block blk0's weights
AVX2 void tiles_avx2(const float* x, int64_t I, const float* w, int64_t blk0, int64_t blk1, int64_t m0, float* y,
                     int64_t O) {
  int64_t blk = blk0;
  for (; blk + NB <= blk1; blk += NB) tile_avx2<R, NB>(x, I, w + (blk - blk0) * I * kBlock, blk, m0, y, O);
  for (; blk < blk1; ++blk) tile_avx2<R, 1>(x, I, w + (blk - blk0) * I * kBlock, blk, m0, y, O);
}

// Every row of x against blocks [g0, g1), whose weights (w) fit in L2, read from memory once: passes of at
// most 6 rows (12 accumulators, 2 weights and a broadcast fill the 16 registers; 1 row: 4 blocks at once).
AVX2 void group_avx2(const float* x, int64_t M, int64_t I, const float* w, int64_t g0, int64_t g1, float* y,
                     int64_t O) {
  even_passes(M, 6, [&](int64_t m, int64_t rows) {
    switch (rows) {
      case 6: return tiles_avx2<6, 1>(x, I, w, g0, g1, m, y, O);
      case 5: return tiles_avx2<5, 1>(x, I, w, g0, g1, m, y, O);
      case 4: return tiles_avx2<4, 1>(x, I, w, g0, g1, m, y, O);
      case 3: return tiles_avx2<3, 1>(x, I, w, g0, g1, m, y, O);
      case 2: return tiles_avx2<2, 2>(x, I, w, g0, g1, m, y, O);
      default: return tiles_avx2<1, 4>(x, I, w, g0, g1, m, y, O);
    }
  });
}

AVX2 void rows_avx2(const float* x, int64_t M, int64_t I, const float* packed, int64_t blk0, int64_t blk1,
                    float* y, int64_t O) {
  const int64_t group = l2_group(I, sizeof(float));
  for (int64_t g0 = blk0; g0 < blk1; g0 += group)
    group_avx2(x, M, I, packed + g0 * I * kBlock, g0, std::min(blk1, g0 + group), y, O);
}

at::Tensor pack_linear_weight(const at::Tensor& w) {
  TORCH_CHECK(w.dim() == 2 && w.scalar_type() == at::kFloat && w.device().is_cpu(),
              "pack_linear_weight: a float32 CPU weight [out, in]");
  const int64_t O = w.size(0), I = w.size(1), blocks = (O + kBlock - 1) / kBlock;
  at::Tensor padded = at::zeros({blocks * kBlock, I}, w.options());
  padded.narrow(0, 0, O).copy_(w);
  return padded.view({blocks, kBlock, I}).transpose(1, 2).contiguous();  // [blocks, I, 16]
}

}  // namespace

at::Tensor packed::packed_linear(const at::Tensor& x, const at::Tensor& packed, const c10::optional<at::Tensor>& bias,
                                 int64_t out_features) {
  TORCH_CHECK(x.scalar_type() == at::kFloat && x.device().is_cpu(), "packed_linear: float32 CPU input");
  TORCH_CHECK(packed.dim() == 3 && packed.size(1) == x.size(-1) && packed.size(2) == kBlock &&
                  packed.size(0) * kBlock >= out_features && packed.is_contiguous(),
              "packed_linear: packed weight from pack_linear_weight for this input width");
  const int64_t I = x.size(-1), O = out_features;
  const at::Tensor x2 = x.reshape({-1, I}).contiguous();
  const int64_t M = x2.size(0);
  at::Tensor y = at::empty({M, O}, x.options());
  const float* xp = x2.data_ptr<float>();
  const float* wp = packed.data_ptr<float>();
  float* yp = y.data_ptr<float>();
  const int64_t blocks = (O + kBlock - 1) / kBlock;
  const int64_t chunk = group_512(I, sizeof(float));  // a thread takes one L2 group at a time
  const bool avx512 = __builtin_cpu_supports("avx512f");
  share_blocks(blocks, chunk, [&](int64_t b0, int64_t b1) {
    if (avx512)
      rows(xp, M, I, wp, b0, b1, yp, O);
    else
      rows_avx2(xp, M, I, wp, b0, b1, yp, O);
  });
  if (bias.has_value()) y.add_(*bias);
  auto shape = x.sizes().vec();
  shape.back() = O;
  return y.view(shape);
}

void packed::packed_block_rows(const float* x, int64_t M, int64_t I, const float* block, int64_t blk, float* y,
                               int64_t O) {
  group_avx2(x, M, I, block, blk, blk + 1, y, O);
}

TORCH_LIBRARY_FRAGMENT(thunder_batch, m) {
  m.def("pack_linear_weight(Tensor w) -> Tensor");
  m.def("packed_linear(Tensor x, Tensor packed, Tensor? bias, int out_features) -> Tensor");
}

TORCH_LIBRARY_IMPL(thunder_batch, CPU, m) {
  m.impl("pack_linear_weight", pack_linear_weight);
  m.impl("packed_linear", packed::packed_linear);
}
