// float32 y = x @ w.T (+ b) for few rows of x, from weights packed once: the decode step's linears.
//
// At 1-16 rows a linear layer is a read of its weights. The weight is packed once into blocks of 16
// output features, [ceil(O/16), I, 16]: one 64-byte load holds 16 outputs' weights for one input, so
// the whole matrix is read as one sequential stream, each value once, multiplied by every row of x
// (a broadcast x[r, i]) into accumulators that hold 16 outputs each: no horizontal sums. Blocks of
// outputs are split across threads (torch's OpenMP pool). AVX-512F, or AVX2 + FMA (a block as two ymm,
// chosen per call from the CPU; callers check for AVX2 + FMA first). Each output is one float32 FMA chain
// over the inputs in order, on both paths: the same result to the bit.
//
// bfloat16 (`packed_linear_bf16`): the weight is packed as [ceil(O/16), I/2, 16, 2], one 64-byte load
// holding 16 outputs' weights for two consecutive inputs, the layout AVX512-BF16's `vdpbf16ps` multiplies
// against a broadcast pair (x[r, 2i], x[r, 2i+1]): 32 multiply-adds per load into float32 accumulators
// that start from the bias, rounded to bfloat16 once at the end (as llama.cpp's bf16 dot product). Each
// output is one float32 chain over the input pairs in order. Without AVX512-BF16, AVX2 + FMA widen the
// same loads to float32 (bfloat16 is float32's upper half) and chain over the inputs in order.

#include <ATen/ATen.h>
#include <ATen/Parallel.h>
#include <immintrin.h>

#include <cstring>
#include <vector>
#include <torch/library.h>

#define AVX512 __attribute__((target("avx512f")))
#define AVX2 __attribute__((target("avx2,fma")))
// Unrolled in full, the accumulator arrays live in registers (g++ 12 otherwise stores them every step).
#define UNROLL _Pragma("GCC unroll 16")

namespace {

constexpr int64_t kBlock = 16;  // output features per packed block (one zmm of float32, two ymm)

// acc[r][b]: outputs of block (blk0 + b) for row (m0 + r); R rows x NB blocks of accumulators.
template <int R, int NB>
AVX512 void tile(const float* x, int64_t I, const float* packed, int64_t blk0, int64_t m0, float* y, int64_t O) {
  __m512 acc[R][NB];
  for (int r = 0; r < R; ++r)
    for (int b = 0; b < NB; ++b) acc[r][b] = _mm512_setzero_ps();
  const float* base = packed + blk0 * I * kBlock;
  for (int64_t i = 0; i < I; ++i) {
    __m512 wv[NB];
    for (int b = 0; b < NB; ++b) wv[b] = _mm512_loadu_ps(base + (b * I + i) * kBlock);
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

// Rows per tile and blocks per tile: measured best on a 2-core AVX-512 machine (benchmarks/RESULTS.md).
template <int R, int NB>
AVX512 void tiles(const float* x, int64_t I, const float* packed, int64_t blk0, int64_t blk1, int64_t m0, float* y,
           int64_t O) {
  int64_t blk = blk0;
  for (; blk + NB <= blk1; blk += NB) tile<R, NB>(x, I, packed, blk, m0, y, O);
  for (; blk < blk1; ++blk) tile<R, 1>(x, I, packed, blk, m0, y, O);
}

AVX512 void rows(const float* x, int64_t M, int64_t I, const float* packed, int64_t blk0, int64_t blk1, float* y,
          int64_t O) {
  int64_t m = 0;
  for (; m + 8 <= M; m += 8) tiles<8, 2>(x, I, packed, blk0, blk1, m, y, O);
  for (; m + 4 <= M; m += 4) tiles<4, 4>(x, I, packed, blk0, blk1, m, y, O);
  for (; m + 2 <= M; m += 2) tiles<2, 2>(x, I, packed, blk0, blk1, m, y, O);
  for (; m < M; ++m) tiles<1, 4>(x, I, packed, blk0, blk1, m, y, O);
}

// AVX2 + FMA: acc[r][2b + h] holds outputs 8h..8h+7 of block (blk0 + b) for row (m0 + r); 16 ymm
// registers hold R * NB * 2 accumulators, the weights of one input and a broadcast x. `w` points at
// block blk0's weights [I, 16].
AVX2 inline void store_avx2(float* y, __m256 v, int64_t n) {  // the first n (<= 8, maybe <= 0) floats of v
  if (n >= 8) return _mm256_storeu_ps(y, v);
  const __m256i lane = _mm256_setr_epi32(0, 1, 2, 3, 4, 5, 6, 7);
  _mm256_maskstore_ps(y, _mm256_cmpgt_epi32(_mm256_set1_epi32(int(std::max<int64_t>(n, 0))), lane), v);
}

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

// Every row of x against blocks [g0, g1), whose weights (w) fit in L2: row groups of at most 4 take
// turns on them (the accumulators of 8 rows would not fit in 16 registers), read from memory once.
AVX2 void group_avx2(const float* x, int64_t M, int64_t I, const float* w, int64_t g0, int64_t g1, float* y,
                     int64_t O) {
  int64_t m = 0;
  for (; m + 4 <= M; m += 4) tiles_avx2<4, 1>(x, I, w, g0, g1, m, y, O);
  for (; m + 2 <= M; m += 2) tiles_avx2<2, 2>(x, I, w, g0, g1, m, y, O);
  for (; m < M; ++m) tiles_avx2<1, 4>(x, I, w, g0, g1, m, y, O);
}

AVX2 int64_t l2_group(int64_t I, int64_t bytes) {  // blocks per group: 128 KiB of weights
  return std::max<int64_t>(1, (128 << 10) / (I * kBlock * bytes));
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

at::Tensor packed_linear(const at::Tensor& x, const at::Tensor& packed, const c10::optional<at::Tensor>& bias,
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
  const int64_t grain = std::max<int64_t>(4, (32 << 10) / (I * kBlock * int64_t(sizeof(float))));
  const bool avx512 = __builtin_cpu_supports("avx512f");
  at::parallel_for(0, blocks, grain, [&](int64_t b0, int64_t b1) {
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

// ---- bfloat16 -----------------------------------------------------------------------------------
using bf16 = uint16_t;

template <int R, int NB>
__attribute__((target("avx512f,avx512bw,avx512vl,avx512bf16"))) void tile_bf16(const bf16* x, int64_t I, const bf16* packed,
                                                                const float* bias, int64_t blk0, int64_t m0, bf16* y,
                                                                int64_t O) {
  const int64_t pairs = I / 2;
  __m512 acc[R][NB];  // start from the bias (float32, padded to whole blocks): rounded once, with the sum
  for (int r = 0; r < R; ++r)
    for (int b = 0; b < NB; ++b) acc[r][b] = bias ? _mm512_loadu_ps(bias + (blk0 + b) * kBlock) : _mm512_setzero_ps();
  const bf16* base = packed + blk0 * I * kBlock;
  for (int64_t i = 0; i < pairs; ++i) {
    __m512i wv[NB];
    for (int b = 0; b < NB; ++b) wv[b] = _mm512_loadu_si512(base + (b * pairs + i) * 2 * kBlock);
    for (int r = 0; r < R; ++r) {
      int32_t pair;
      std::memcpy(&pair, x + (m0 + r) * I + 2 * i, sizeof(pair));
      const __m512i xv = _mm512_set1_epi32(pair);
      for (int b = 0; b < NB; ++b) acc[r][b] = _mm512_dpbf16_ps(acc[r][b], (__m512bh)xv, (__m512bh)wv[b]);
    }
  }
  for (int r = 0; r < R; ++r)
    for (int b = 0; b < NB; ++b) {
      const int64_t o = (blk0 + b) * kBlock, n = std::min<int64_t>(kBlock, O - o);
      const __m256i out = (__m256i)_mm512_cvtneps_pbh(acc[r][b]);
      _mm256_mask_storeu_epi16(y + (m0 + r) * O + o, __mmask16((1u << n) - 1), out);
    }
}

template <int R, int NB>
void tiles_bf16(const bf16* x, int64_t I, const bf16* packed, const float* bias, int64_t blk0, int64_t blk1,
                int64_t m0, bf16* y, int64_t O) {
  int64_t blk = blk0;
  for (; blk + NB <= blk1; blk += NB) tile_bf16<R, NB>(x, I, packed, bias, blk, m0, y, O);
  for (; blk < blk1; ++blk) tile_bf16<R, 1>(x, I, packed, bias, blk, m0, y, O);
}

void rows_bf16(const bf16* x, int64_t M, int64_t I, const bf16* packed, const float* bias, int64_t blk0,
               int64_t blk1, bf16* y, int64_t O) {
  int64_t m = 0;
  for (; m + 8 <= M; m += 8) tiles_bf16<8, 2>(x, I, packed, bias, blk0, blk1, m, y, O);
  for (; m + 4 <= M; m += 4) tiles_bf16<4, 4>(x, I, packed, bias, blk0, blk1, m, y, O);
  for (; m + 2 <= M; m += 2) tiles_bf16<2, 2>(x, I, packed, bias, blk0, blk1, m, y, O);
  for (; m < M; ++m) tiles_bf16<1, 4>(x, I, packed, bias, blk0, blk1, m, y, O);
}

// AVX2 + FMA, same packed layout: a 32-byte load holds 8 outputs' weight pairs; shifted and masked,
// they are the float32 weights of inputs 2i and 2i+1 (bfloat16 is float32's upper half).
AVX2 inline __m256 even_bf16(__m256i pairs) { return _mm256_castsi256_ps(_mm256_slli_epi32(pairs, 16)); }
AVX2 inline __m256 odd_bf16(__m256i pairs) {
  return _mm256_castsi256_ps(_mm256_and_si256(pairs, _mm256_set1_epi32(int(0xffff0000u))));
}

// One row, float32 x: the weights widened as they stream in (a read of the weights, nothing more).
template <int NB>
AVX2 void tile_bf16_avx2(const float* x, int64_t I, const bf16* w, int64_t blk0, float* y, int64_t O) {
  const int64_t pairs = I / 2;
  __m256 acc[2 * NB];
  UNROLL for (int v = 0; v < 2 * NB; ++v) acc[v] = _mm256_setzero_ps();
  for (int64_t i = 0; i < pairs; ++i) {
    const __m256 x0 = _mm256_broadcast_ss(x + 2 * i), x1 = _mm256_broadcast_ss(x + 2 * i + 1);
    UNROLL for (int v = 0; v < 2 * NB; ++v) {
      const __m256i wv = _mm256_loadu_si256((const __m256i*)(w + ((v / 2) * pairs + i) * 2 * kBlock + (v % 2) * 16));
      acc[v] = _mm256_fmadd_ps(x1, odd_bf16(wv), _mm256_fmadd_ps(x0, even_bf16(wv), acc[v]));
    }
  }
  UNROLL for (int v = 0; v < 2 * NB; ++v) {
    const int64_t o = (blk0 + v / 2) * kBlock + (v % 2) * 8;
    store_avx2(y + o, acc[v], O - o);
  }
}

// Blocks [0, n) of w widened to float32 in the float32 kernel's layout [n, I, 16].
AVX2 void widen_bf16(const bf16* w, int64_t I, int64_t n, float* out) {
  for (int64_t p = 0; p < n * I / 2; ++p)  // p: (block, input pair) in order
    for (int h = 0; h < 2; ++h) {
      const __m256i wv = _mm256_loadu_si256((const __m256i*)(w + p * 2 * kBlock + h * 8 * 2));
      _mm256_storeu_ps(out + 2 * p * kBlock + h * 8, even_bf16(wv));
      _mm256_storeu_ps(out + (2 * p + 1) * kBlock + h * 8, odd_bf16(wv));
    }
}

// One row streams the weights; more rows widen each L2 group once and run the float32 tiles on it.
AVX2 void rows_bf16_avx2(const float* x, int64_t M, int64_t I, const bf16* packed, int64_t blk0, int64_t blk1,
                         float* y, int64_t O) {
  const int64_t group = l2_group(I, sizeof(float));
  std::vector<float> wide(M > 1 ? group * I * kBlock : 0);
  for (int64_t g0 = blk0; g0 < blk1; g0 += group) {
    const int64_t g1 = std::min(blk1, g0 + group);
    const bf16* w = packed + g0 * I * kBlock;
    if (M == 1) {
      int64_t blk = g0;
      for (; blk + 4 <= g1; blk += 4) tile_bf16_avx2<4>(x, I, w + (blk - g0) * I * kBlock, blk, y, O);
      for (; blk < g1; ++blk) tile_bf16_avx2<1>(x, I, w + (blk - g0) * I * kBlock, blk, y, O);
      continue;
    }
    widen_bf16(w, I, g1 - g0, wide.data());
    group_avx2(x, M, I, wide.data(), g0, g1, y, O);
  }
}

at::Tensor pack_linear_weight_bf16(const at::Tensor& w) {
  TORCH_CHECK(w.dim() == 2 && w.scalar_type() == at::kBFloat16 && w.device().is_cpu() && w.size(1) % 2 == 0,
              "pack_linear_weight_bf16: a bfloat16 CPU weight [out, in] with an even `in`");
  const int64_t O = w.size(0), I = w.size(1), blocks = (O + kBlock - 1) / kBlock;
  at::Tensor padded = at::zeros({blocks * kBlock, I}, w.options());
  padded.narrow(0, 0, O).copy_(w);
  // [blocks, 16, I/2, 2] -> [blocks, I/2, 16, 2]
  return padded.view({blocks, kBlock, I / 2, 2}).transpose(1, 2).contiguous();
}

at::Tensor packed_linear_bf16(const at::Tensor& x, const at::Tensor& packed, const c10::optional<at::Tensor>& bias,
                              int64_t out_features) {
  TORCH_CHECK(x.scalar_type() == at::kBFloat16 && x.device().is_cpu(), "packed_linear_bf16: bfloat16 CPU input");
  TORCH_CHECK(packed.dim() == 4 && packed.size(1) * 2 == x.size(-1) && packed.size(2) == kBlock &&
                  packed.size(3) == 2 && packed.size(0) * kBlock >= out_features && packed.is_contiguous(),
              "packed_linear_bf16: packed weight from pack_linear_weight_bf16 for this input width");
  const int64_t I = x.size(-1), O = out_features;
  const at::Tensor x2 = x.reshape({-1, I}).contiguous();
  const int64_t M = x2.size(0), blocks = (O + kBlock - 1) / kBlock;
  const bf16* wp = reinterpret_cast<const bf16*>(packed.data_ptr<at::BFloat16>());
  const int64_t grain = std::max<int64_t>(4, (32 << 10) / (I * kBlock * int64_t(sizeof(bf16))));
  at::Tensor y;
  if (__builtin_cpu_supports("avx512bf16")) {
    at::Tensor b32;  // the bias in float32, zero-padded to whole blocks: the accumulators start from it
    if (bias.has_value()) {
      b32 = at::zeros({blocks * kBlock}, x.options().dtype(at::kFloat));
      b32.narrow(0, 0, O).copy_(*bias);
    }
    const float* bp = bias.has_value() ? b32.data_ptr<float>() : nullptr;
    y = at::empty({M, O}, x.options());
    const bf16* xp = reinterpret_cast<const bf16*>(x2.data_ptr<at::BFloat16>());
    bf16* yp = reinterpret_cast<bf16*>(y.data_ptr<at::BFloat16>());
    at::parallel_for(0, blocks, grain, [&](int64_t b0, int64_t b1) { rows_bf16(xp, M, I, wp, bp, b0, b1, yp, O); });
  } else {  // AVX2: float32 sums and bias, rounded to bfloat16 once by torch's conversion (to nearest even)
    const at::Tensor xf = x2.to(at::kFloat);
    at::Tensor yf = at::empty({M, O}, xf.options());
    const float* xp = xf.data_ptr<float>();
    float* yp = yf.data_ptr<float>();
    at::parallel_for(0, blocks, grain, [&](int64_t b0, int64_t b1) { rows_bf16_avx2(xp, M, I, wp, b0, b1, yp, O); });
    if (bias.has_value()) yf.add_(*bias);  // in float32: each bfloat16 bias value is exact there
    y = yf.to(at::kBFloat16);
  }
  auto shape = x.sizes().vec();
  shape.back() = O;
  return y.view(shape);
}

}  // namespace

TORCH_LIBRARY(thunder_batch, m) {
  m.def("pack_linear_weight(Tensor w) -> Tensor");
  m.def("packed_linear(Tensor x, Tensor packed, Tensor? bias, int out_features) -> Tensor");
  m.def("pack_linear_weight_bf16(Tensor w) -> Tensor");
  m.def("packed_linear_bf16(Tensor x, Tensor packed, Tensor? bias, int out_features) -> Tensor");
}

TORCH_LIBRARY_IMPL(thunder_batch, CPU, m) {
  m.impl("pack_linear_weight", pack_linear_weight);
  m.impl("packed_linear", packed_linear);
  m.impl("pack_linear_weight_bf16", pack_linear_weight_bf16);
  m.impl("packed_linear_bf16", packed_linear_bf16);
}
