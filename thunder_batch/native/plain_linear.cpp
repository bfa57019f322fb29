// float32 and bfloat16 y = x @ w.T (+ b) read from the weight's own layout [out, in]: no packed copy sits
// beside the weight, so a compiled model holds its weights once (AVX2 + FMA; bfloat16 widened exactly).
//
// Up to kDirectRows rows (decode steps): each thread takes blocks of 16 outputs; NO output rows of w are
// read side by side, 8 inputs at a time, and each load multiplies every row of x in passes of at most R
// rows (R x NO float32 accumulators, 8 lanes each, one horizontal sum per output at the end), so a
// group's rows come from L1 after the first pass. More rows (prompt steps): 16 outputs at a time are
// copied into the packed float32 layout [in, 16] in a buffer that stays in L2, and the packed kernel
// (packed_linear.cpp) runs every row against it: the copy is paid once per 16 outputs per step.
// Each output is float32 products summed in float32; only the order of the sums differs from torch's.
//
#include <ATen/ATen.h>
#include <torch/library.h>

#include <vector>

#include "ops.h"
#include "packed_tiles.h"
#include "vector_avx2.h"

namespace {

using namespace packed;

constexpr int64_t kDirectRows = 16;

// Rows m0..m0+R-1 of x [M, I] against output rows o0..o0+NO-1 of w [O, I] into y [M, O]. The inputs past the
// last multiple of 8 are added one by one, after the vector sums.
template <class T, int R, int NO>
AVX2 void tile(const float* x, int64_t I, const T* w, int64_t o0, int64_t m0, float* y, int64_t O) {
  __m256 acc[R][NO];
  UNROLL for (int r = 0; r < R; ++r)
    UNROLL for (int o = 0; o < NO; ++o) acc[r][o] = _mm256_setzero_ps();
  const int64_t I8 = I & ~int64_t(7);
  const T* wr = w + o0 * I;
  for (int64_t i = 0; i < I8; i += 8) {
    __m256 wv[NO];
    UNROLL for (int o = 0; o < NO; ++o) wv[o] = load8(wr + o * I + i);
    UNROLL for (int r = 0; r < R; ++r) {
      const __m256 xv = _mm256_loadu_ps(x + (m0 + r) * I + i);
      UNROLL for (int o = 0; o < NO; ++o) acc[r][o] = _mm256_fmadd_ps(wv[o], xv, acc[r][o]);
    }
  }
  UNROLL for (int r = 0; r < R; ++r)
    UNROLL for (int o = 0; o < NO; ++o) {
      float sum = hsum(acc[r][o]);
      for (int64_t i = I8; i < I; ++i) sum += widen(wr[o * I + i]) * x[(m0 + r) * I + i];
      y[(m0 + r) * O + o0 + o] = sum;
    }
}

// Every row of x against outputs [o0, o0 + NO): passes of at most RM <= 4 rows, as even as they go.
template <class T, int NO, int RM>
AVX2 void outputs(const float* x, int64_t M, int64_t I, const T* w, int64_t o0, float* y, int64_t O) {
  even_passes(M, RM, [&](int64_t m, int64_t rows) {
    switch (rows) {
      case 4: return tile<T, 4, NO>(x, I, w, o0, m, y, O);
      case 3: return tile<T, 3, NO>(x, I, w, o0, m, y, O);
      case 2: return tile<T, 2, NO>(x, I, w, o0, m, y, O);
      default: return tile<T, 1, NO>(x, I, w, o0, m, y, O);
    }
  });
}

// Output rows [o0, o1) for every row of x [M <= kDirectRows, I], NO at a time in passes of at most RM rows.
template <class T, int NO, int RM>
AVX2 void direct_as(const float* x, int64_t M, int64_t I, const T* w, int64_t o0, int64_t o1, float* y,
                    int64_t O) {
  int64_t o = o0;
  for (; o + NO <= o1; o += NO) outputs<T, NO, RM>(x, M, I, w, o, y, O);
  for (; o < o1; ++o) outputs<T, 1, RM>(x, M, I, w, o, y, O);
}

// One row: 4 outputs at a time (4 accumulator chains); more rows: 3 outputs x 4 rows (12 accumulators, 3 weights
// and an x fill the 16 registers), the fastest of 4 x 3, 3 x 4, 2 x 6 at 2-16 rows here (bfloat16 most of all).
template <class T>
AVX2 void direct_rows(const float* x, int64_t M, int64_t I, const T* w, int64_t o0, int64_t o1, float* y,
                      int64_t O) {
  if (M == 1) return direct_as<T, 4, 1>(x, M, I, w, o0, o1, y, O);
  direct_as<T, 3, 4>(x, M, I, w, o0, o1, y, O);
}

// Columns of 8 rows x 8 inputs: r[k] in, input k of each row out (the 8 x 8 transpose of AVX's unpack, shuffle, permute).
AVX2 inline void transpose8(__m256 r[8]) {
  __m256 t[8], s[8];
  for (int k = 0; k < 8; k += 2) t[k] = _mm256_unpacklo_ps(r[k], r[k + 1]), t[k + 1] = _mm256_unpackhi_ps(r[k], r[k + 1]);
  for (int k = 0; k < 8; k += 4) {
    s[k] = _mm256_shuffle_ps(t[k], t[k + 2], _MM_SHUFFLE(1, 0, 1, 0));
    s[k + 1] = _mm256_shuffle_ps(t[k], t[k + 2], _MM_SHUFFLE(3, 2, 3, 2));
    s[k + 2] = _mm256_shuffle_ps(t[k + 1], t[k + 3], _MM_SHUFFLE(1, 0, 1, 0));
    s[k + 3] = _mm256_shuffle_ps(t[k + 1], t[k + 3], _MM_SHUFFLE(3, 2, 3, 2));
  }
  for (int k = 0; k < 4; ++k)
    r[k] = _mm256_permute2f128_ps(s[k], s[k + 4], 0x20), r[k + 4] = _mm256_permute2f128_ps(s[k], s[k + 4], 0x31);
}

// Rows [o0, o0 + 16) of w (those below O; the rest zero) as the packed float32 block [I, 16]: whole blocks by
// 8 x 8 transposes, a last partial block or input width element by element.
template <class T>
AVX2 void widen_block(const T* w, int64_t I, int64_t o0, int64_t O, float* block) {
  const int64_t n = std::min<int64_t>(kBlock, O - o0);
  if (n == kBlock && I % 8 == 0) {
    for (int64_t i = 0; i < I; i += 8)
      for (int64_t half = 0; half < 2; ++half) {
        __m256 r[8];
        UNROLL for (int k = 0; k < 8; ++k) r[k] = load8(w + (o0 + 8 * half + k) * I + i);
        transpose8(r);
        UNROLL for (int k = 0; k < 8; ++k) _mm256_storeu_ps(block + (i + k) * kBlock + 8 * half, r[k]);
      }
    return;
  }
  for (int64_t i = 0; i < I; ++i) {
    float* out = block + i * kBlock;
    for (int64_t r = 0; r < n; ++r) out[r] = widen(w[(o0 + r) * I + i]);
    for (int64_t r = n; r < kBlock; ++r) out[r] = 0.f;
  }
}

template <class T>
void linear_rows(const float* x, int64_t M, int64_t I, const T* w, float* y, int64_t O) {
  const int64_t blocks = (O + kBlock - 1) / kBlock;
  if (M <= kDirectRows) {
    share_blocks(blocks, 4, [&](int64_t b0, int64_t b1) {
      direct_rows<T>(x, M, I, w, b0 * kBlock, std::min(O, b1 * kBlock), y, O);
    });
    return;
  }
  share_blocks(blocks, 1, [&](int64_t b0, int64_t b1) {
    float* block = thread_buffer(I * kBlock);
    for (int64_t b = b0; b < b1; ++b) {
      widen_block<T>(w, I, b * kBlock, O, block);
      packed_block_rows(x, M, I, block, b, y, O);
    }
  });
}

}  // namespace

at::Tensor packed::plain_linear(const at::Tensor& x, const at::Tensor& w, const c10::optional<at::Tensor>& bias,
                                int64_t out_features) {
  TORCH_CHECK(w.dim() == 2 && w.size(0) == out_features && w.is_contiguous() && w.device().is_cpu() &&
                  (w.scalar_type() == at::kFloat || w.scalar_type() == at::kBFloat16),
              "plain_linear: a contiguous float32 or bfloat16 CPU weight [out, in]");
  TORCH_CHECK(x.scalar_type() == w.scalar_type() && x.device().is_cpu() && x.size(-1) == w.size(1),
              "plain_linear: a CPU input [..., ", w.size(1), "] of the weight's dtype");
  const int64_t I = w.size(1), O = w.size(0);
  const at::Tensor xf = x.reshape({-1, I}).to(at::kFloat).contiguous();
  const int64_t M = xf.size(0);
  at::Tensor y = at::empty({M, O}, xf.options());
  if (w.scalar_type() == at::kFloat)
    linear_rows<float>(xf.data_ptr<float>(), M, I, w.data_ptr<float>(), y.data_ptr<float>(), O);
  else
    linear_rows<bf16>(xf.data_ptr<float>(), M, I, reinterpret_cast<const bf16*>(w.data_ptr<at::BFloat16>()),
                      y.data_ptr<float>(), O);
  if (bias.has_value()) y.add_(*bias);  // in float32: a bfloat16 bias value is exact there
  auto shape = x.sizes().vec();
  shape.back() = O;
  return y.to(x.scalar_type()).view(shape);  // bfloat16: rounded once, to nearest even
}

TORCH_LIBRARY_FRAGMENT(thunder_batch, m) {
  m.def("plain_linear(Tensor x, Tensor w, Tensor? bias, int out_features) -> Tensor");
}

TORCH_LIBRARY_IMPL(thunder_batch, CPU, m) { m.impl("plain_linear", packed::plain_linear); }
