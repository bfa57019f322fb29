// bfloat16 (`packed_linear_bf16`): the weight is packed as [ceil(O/16), I/2, 16, 2], one 64-byte load
// holding 16 outputs' weights for two consecutive inputs, the layout AVX512-BF16's `vdpbf16ps` multiplies
// against a broadcast pair (x[r, 2i], x[r, 2i+1]): 32 multiply-adds per load into float32 accumulators
// that start from the bias, rounded to bfloat16 once at the end (as llama.cpp's bf16 dot product). Each
// output is one float32 chain over the input pairs in order. Without AVX512-BF16, AVX2 + FMA widen the
// same loads to float32 in registers (bfloat16 is float32's upper half) and chain over the inputs in order.


#include <ATen/ATen.h>
#include <ATen/Parallel.h>
#include <torch/library.h>

#include <cstring>

#include "ops.h"
#include "packed_tiles.h"

namespace {

using namespace packed;

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

// One pass of the R <= 7 rows left after the 8-row passes (a pass per 4, 2, 1 rows read the weights again).
void pass_bf16(int64_t R, const bf16* x, int64_t I, const bf16* packed, const float* bias, int64_t g0, int64_t g1,
               int64_t m0, bf16* y, int64_t O) {
  switch (R) {
    case 7: return tiles_bf16<7, 3>(x, I, packed, bias, g0, g1, m0, y, O);
    case 6: return tiles_bf16<6, 3>(x, I, packed, bias, g0, g1, m0, y, O);
    case 5: return tiles_bf16<5, 3>(x, I, packed, bias, g0, g1, m0, y, O);
    case 4: return tiles_bf16<4, 4>(x, I, packed, bias, g0, g1, m0, y, O);
    case 3: return tiles_bf16<3, 4>(x, I, packed, bias, g0, g1, m0, y, O);
    case 2: return tiles_bf16<2, 2>(x, I, packed, bias, g0, g1, m0, y, O);
    default: return tiles_bf16<1, 4>(x, I, packed, bias, g0, g1, m0, y, O);
  }
}

// Per group of blocks whose weights stay in L2 (256 KiB, read from memory once), 8 rows x 3 blocks at a
// time, then the rest in one pass. Measured on a Xeon with AMX switched off, against 8 x 2 passes over all
// the thread's blocks, then 4 x 4, 2 x 2, 1 x 4: 3 rows 1.34x, 5-8 rows 1.1-1.2x, 12-16 rows 1.3x faster.
void rows_bf16(const bf16* x, int64_t M, int64_t I, const bf16* packed, const float* bias, int64_t blk0,
               int64_t blk1, bf16* y, int64_t O) {
  const int64_t group = group_512(I, sizeof(bf16));
  for (int64_t g0 = blk0; g0 < blk1; g0 += group) {
    const int64_t g1 = std::min(blk1, g0 + group);
    int64_t m = 0;
    for (; m + 8 <= M; m += 8) tiles_bf16<8, 3>(x, I, packed, bias, g0, g1, m, y, O);
    if (m < M) pass_bf16(M - m, x, I, packed, bias, g0, g1, m, y, O);
  }
}

// AVX2 + FMA, same packed layout: a 32-byte load holds 8 outputs' weight pairs; shifted and masked,
// they are the float32 weights of inputs 2i and 2i+1 (bfloat16 is float32's upper half).
AVX2 inline __m256 even_bf16(__m256i pairs) { return _mm256_castsi256_ps(_mm256_slli_epi32(pairs, 16)); }
AVX2 inline __m256 odd_bf16(__m256i pairs) {
  return _mm256_castsi256_ps(_mm256_and_si256(pairs, _mm256_set1_epi32(int(0xffff0000u))));
}

// R rows x NB blocks, float32 x: each 32-byte load (8 outputs' weight pairs) widened in registers to the
// weights of inputs 2i and 2i+1, chained in input order as the float32 kernel does. w: block blk0's weights.
template <int R, int NB>
AVX2 void tile_bf16_avx2(const float* x, int64_t I, const bf16* w, int64_t blk0, int64_t m0, float* y, int64_t O) {
  const int64_t pairs = I / 2;
  __m256 acc[R][2 * NB];
  UNROLL for (int r = 0; r < R; ++r)
    UNROLL for (int v = 0; v < 2 * NB; ++v) acc[r][v] = _mm256_setzero_ps();
  for (int64_t i = 0; i < pairs; ++i) {
    UNROLL for (int b = 0; b < NB; ++b) {
      __m256 even[2], odd[2];
      UNROLL for (int h = 0; h < 2; ++h) {
        const __m256i wv = _mm256_loadu_si256((const __m256i*)(w + (b * pairs + i) * 2 * kBlock + h * 16));
        even[h] = even_bf16(wv), odd[h] = odd_bf16(wv);
      }
      UNROLL for (int r = 0; r < R; ++r) {
        const float* xr = x + (m0 + r) * I + 2 * i;
        const __m256 x0 = _mm256_broadcast_ss(xr), x1 = _mm256_broadcast_ss(xr + 1);
        UNROLL for (int h = 0; h < 2; ++h)
          acc[r][2 * b + h] = _mm256_fmadd_ps(x1, odd[h], _mm256_fmadd_ps(x0, even[h], acc[r][2 * b + h]));
      }
    }
  }
  UNROLL for (int r = 0; r < R; ++r)
    UNROLL for (int v = 0; v < 2 * NB; ++v) {
      const int64_t o = (blk0 + v / 2) * kBlock + (v % 2) * 8;
      store_avx2(y + (m0 + r) * O + o, acc[r][v], O - o);
    }
}

template <int R, int NB>  // blocks [g0, g1) for rows m0..m0+R-1; w: block g0's weights
AVX2 void tiles_bf16_avx2(const float* x, int64_t I, const bf16* w, int64_t g0, int64_t g1, int64_t m0, float* y,
                          int64_t O) {
  int64_t blk = g0;
  for (; blk + NB <= g1; blk += NB) tile_bf16_avx2<R, NB>(x, I, w + (blk - g0) * I * kBlock, blk, m0, y, O);
  for (; blk < g1; ++blk) tile_bf16_avx2<R, 1>(x, I, w + (blk - g0) * I * kBlock, blk, m0, y, O);
}

// Each L2 group of blocks against every row, read from memory once: passes of at most 4 rows (8
// accumulators, 4 widened weights, 2 broadcasts; 1 row: 4 blocks at once).
AVX2 void rows_bf16_avx2(const float* x, int64_t M, int64_t I, const bf16* packed, int64_t blk0, int64_t blk1,
                         float* y, int64_t O) {
  const int64_t group = l2_group(I, sizeof(bf16));
  for (int64_t g0 = blk0; g0 < blk1; g0 += group) {
    const int64_t g1 = std::min(blk1, g0 + group);
    const bf16* w = packed + g0 * I * kBlock;
    even_passes(M, 4, [&](int64_t m, int64_t rows) {
      switch (rows) {
        case 4: return tiles_bf16_avx2<4, 1>(x, I, w, g0, g1, m, y, O);
        case 3: return tiles_bf16_avx2<3, 1>(x, I, w, g0, g1, m, y, O);
        case 2: return tiles_bf16_avx2<2, 2>(x, I, w, g0, g1, m, y, O);
        default: return tiles_bf16_avx2<1, 4>(x, I, w, g0, g1, m, y, O);
      }
    });
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

}  // namespace

at::Tensor packed::packed_linear_bf16(const at::Tensor& x, const at::Tensor& packed,
                                      const c10::optional<at::Tensor>& bias, int64_t out_features) {
  TORCH_CHECK(x.scalar_type() == at::kBFloat16 && x.device().is_cpu(), "packed_linear_bf16: bfloat16 CPU input");
  TORCH_CHECK(packed.dim() == 4 && packed.size(1) * 2 == x.size(-1) && packed.size(2) == kBlock &&
                  packed.size(3) == 2 && packed.size(0) * kBlock >= out_features && packed.is_contiguous(),
              "packed_linear_bf16: packed weight from pack_linear_weight_bf16 for this input width");
  const int64_t I = x.size(-1), O = out_features;
  const at::Tensor x2 = x.reshape({-1, I}).contiguous();
  const int64_t M = x2.size(0), blocks = (O + kBlock - 1) / kBlock;
  const bf16* wp = reinterpret_cast<const bf16*>(packed.data_ptr<at::BFloat16>());
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
    const bool amx = amx_runs(I);  // AMX where present: the same packed weight, read as tiles
    const int64_t chunk = amx ? amx_group(I) : group_512(I, sizeof(bf16));  // as rows_amx and rows_bf16 group them
    share_blocks(blocks, chunk, [&](int64_t b0, int64_t b1) {
      amx ? rows_amx(xp, M, I, wp, bp, b0, b1, yp, O) : rows_bf16(xp, M, I, wp, bp, b0, b1, yp, O);
    });
  } else {  // AVX2: float32 sums and bias, rounded to bfloat16 once by torch's conversion (to nearest even)
    const at::Tensor xf = x2.to(at::kFloat);
    at::Tensor yf = at::empty({M, O}, xf.options());
    const float* xp = xf.data_ptr<float>();
    float* yp = yf.data_ptr<float>();
    share_blocks(blocks, l2_group(I, sizeof(bf16)),
                 [&](int64_t b0, int64_t b1) { rows_bf16_avx2(xp, M, I, wp, b0, b1, yp, O); });
    if (bias.has_value()) yf.add_(*bias);  // in float32: each bfloat16 bias value is exact there
    y = yf.to(at::kBFloat16);
  }
  auto shape = x.sizes().vec();
  shape.back() = O;
  return y.view(shape);
}

TORCH_LIBRARY_FRAGMENT(thunder_batch, m) {
  m.def("pack_linear_weight_bf16(Tensor w) -> Tensor");
  m.def("packed_linear_bf16(Tensor x, Tensor packed, Tensor? bias, int out_features) -> Tensor");
}

TORCH_LIBRARY_IMPL(thunder_batch, CPU, m) {
  m.impl("pack_linear_weight_bf16", pack_linear_weight_bf16);
  m.impl("packed_linear_bf16", packed::packed_linear_bf16);
}
