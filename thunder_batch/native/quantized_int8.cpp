// The opt-in integer path of the quantized linears (EngineConfig(int8_activations=True)), llama.cpp's way: each
// row of x is quantized per 32 values to int8 with one float32 scale (d = max|x| / 127, q = round(x / d), ties
// to even), and each granule of 32 weights, read as integers (quant_blocks.h's Ints: w = a * q + m), takes one
// exact integer dot product per row (vpmaddubsw + vpmaddwd), scaled once in float32:
//   y = sum over granules of (a * d) * sum(q_w q_x) + m * d * sum(q_x)
// which is dequantize(x's int8 blocks) @ dequantize(w).T up to float32 rounding (quantized.int8_round_trip is
// the eager side). About half the instructions of widening every weight to float32, so the 4-bit formats at
// one row read their weights near the memory's speed; but x itself is rounded, so the outputs leave the exact
// path's (quantized_linear.cpp), which is why this path is asked for, not the default.
#include <ATen/ATen.h>
#include <torch/library.h>

#include <vector>

#include "packed_tiles.h"

// x's quantization must round as torch's: x * (1 / d) then round, never fused.
#pragma GCC optimize("fp-contract=off")
#include "quant_blocks.h"
#include "quant_int8.h"

namespace {

using quant::hsum;

// x [M, I] quantized per 32 values: q int8 [M, I], d and s = d * sum(q) float32 [M, I / 32].
struct Int8Rows {
  std::vector<int8_t> q;
  std::vector<float> d, s;
};

// 32 values of x -> 32 int8 at q (in order), its scale d and d * sum(q).
QAVX2 void quantize_granule(const float* x, int8_t* q, float& d, float& s) {
  const __m256 sign = _mm256_set1_ps(-0.f);
  __m256 v[4], amax = _mm256_setzero_ps();
  for (int j = 0; j < 4; ++j) v[j] = _mm256_loadu_ps(x + 8 * j), amax = _mm256_max_ps(amax, _mm256_andnot_ps(sign, v[j]));
  __m128 m = _mm_max_ps(_mm256_castps256_ps128(amax), _mm256_extractf128_ps(amax, 1));
  m = _mm_max_ps(m, _mm_movehl_ps(m, m));
  d = _mm_cvtss_f32(_mm_max_ss(m, _mm_shuffle_ps(m, m, 1))) / 127.f;
  const __m256 inv = _mm256_set1_ps(d != 0.f ? 1.f / d : 0.f);
  __m256i i[4];
  __m256 total = _mm256_setzero_ps();
  for (int j = 0; j < 4; ++j) {
    const __m256 r = _mm256_round_ps(_mm256_mul_ps(v[j], inv), _MM_FROUND_TO_NEAREST_INT | _MM_FROUND_NO_EXC);
    total = _mm256_add_ps(total, r);  // small integers: exact
    i[j] = _mm256_cvtps_epi32(r);
  }
  // packs interleave the 128-bit lanes: put the 4-byte groups back in order.
  const __m256i bytes = _mm256_packs_epi16(_mm256_packs_epi32(i[0], i[1]), _mm256_packs_epi32(i[2], i[3]));
  const __m256i order = _mm256_setr_epi32(0, 4, 1, 5, 2, 6, 3, 7);
  _mm256_storeu_si256(reinterpret_cast<__m256i*>(q), _mm256_permutevar8x32_epi32(bytes, order));
  s = d * hsum(total);
}

QAVX2 Int8Rows quantize_rows(const float* x, int64_t M, int64_t I) {
  const int64_t G = I / 32;
  Int8Rows out{std::vector<int8_t>(M * I), std::vector<float>(M * G), std::vector<float>(M * G)};
  for (int64_t g = 0; g < M * G; ++g) quantize_granule(x + 32 * g, out.q.data() + 32 * g, out.d[g], out.s[g]);
  return out;
}

// Rows [m0, m0 + R) of x against one quantized row w: y[r * ldy]. One accumulator a row: a granule's work outlasts
// the FMA's latency even at one row (and a second one, picked by the granule's parity, would sit in memory).
template <class F, int R>
QAVX2 void int8_dots(const Int8Rows& x, int64_t m0, int64_t I, const uint8_t* w, float* y, int64_t ldy) {
  const int64_t G = I / 32;
  const __m256i ones = _mm256_set1_epi16(1);
  __m256 acc[R];
  float mins[R] = {};
  UNROLL for (int r = 0; r < R; ++r) acc[r] = _mm256_setzero_ps();
  for (int64_t g = 0; g < G; ++g) {
    quant::Ints k;
    quant::ints_at<F>(w, g, k);
    const __m256i wq = F::kUnsigned ? k.q : _mm256_sign_epi8(k.q, k.q);  // the unsigned side of the products
    const __m256 a = F::kTwoScales ? _mm256_set_m128(_mm_set1_ps(k.a[1]), _mm_set1_ps(k.a[0]))  // lanes 0-3: 0-15
                                   : _mm256_set1_ps(k.a[0]);
    UNROLL for (int r = 0; r < R; ++r) {
      const int64_t at = (m0 + r) * G + g;
      __m256i xq = _mm256_loadu_si256(reinterpret_cast<const __m256i*>(x.q.data() + 32 * at));
      if (!F::kUnsigned) xq = _mm256_sign_epi8(xq, k.q);
      const __m256i sums = _mm256_madd_epi16(_mm256_maddubs_epi16(wq, xq), ones);  // lane l: weights 4l..4l+3
      const __m256 scale = _mm256_mul_ps(a, _mm256_broadcast_ss(&x.d[at]));
      acc[r] = _mm256_fmadd_ps(_mm256_cvtepi32_ps(sums), scale, acc[r]);
      if (F::kUnsigned) mins[r] += k.m * x.s[at];
    }
  }
  UNROLL for (int r = 0; r < R; ++r) y[r * ldy] = hsum(acc[r]) + mins[r];
}

// Every row of x against output rows [o0, o1), in passes of at most 8 rows (packed::even_passes).
template <class F>
QAVX2 void int8_rows(const Int8Rows& x, int64_t M, int64_t I, const uint8_t* w, int64_t o0, int64_t o1, float* y,
                     int64_t O) {
  const int64_t row_bytes = I / F::kElems * F::kBytes;
  for (int64_t o = o0; o < o1; ++o)
    packed::even_passes(M, 8, [&](int64_t m, int64_t rows) {
      const uint8_t* wo = w + o * row_bytes;
      float* ym = y + m * O + o;
      switch (rows) {
        case 8: return int8_dots<F, 8>(x, m, I, wo, ym, O);
        case 7: return int8_dots<F, 7>(x, m, I, wo, ym, O);
        case 6: return int8_dots<F, 6>(x, m, I, wo, ym, O);
        case 5: return int8_dots<F, 5>(x, m, I, wo, ym, O);
        case 4: return int8_dots<F, 4>(x, m, I, wo, ym, O);
        case 3: return int8_dots<F, 3>(x, m, I, wo, ym, O);
        case 2: return int8_dots<F, 2>(x, m, I, wo, ym, O);
        default: return int8_dots<F, 1>(x, m, I, wo, ym, O);
      }
    });
}

}  // namespace

namespace quant {

void int8_linear_rows(int64_t type, const float* x, int64_t M, int64_t I, const uint8_t* w, float* y, int64_t O) {
  const Int8Rows xq = quantize_rows(x, M, I);
  const int64_t blocks = (O + packed::kBlock - 1) / packed::kBlock;
  with_int_format(type, [&](auto f) {
    packed::share_blocks(blocks, 4, [&](int64_t b0, int64_t b1) {
      int8_rows<decltype(f)>(xq, M, I, w, b0 * packed::kBlock, std::min(O, b1 * packed::kBlock), y, O);
    });
  });
}

QAVX2 void int8_round_trip(const float* x, int64_t n, float* out) {
  alignas(32) int8_t q[32];
  for (int64_t g = 0; g < n / 32; ++g) {
    float d, s;
    quantize_granule(x + 32 * g, q, d, s);
    for (int j = 0; j < 32; ++j) out[32 * g + j] = float(q[j]) * d;
  }
}

}  // namespace quant

namespace {

// x [..., in] (in a multiple of 32) -> dequantize(its int8 blocks): what the int8 path multiplies.
at::Tensor int8_round_trip(const at::Tensor& x) {
  TORCH_CHECK(x.scalar_type() == at::kFloat && x.device().is_cpu() && x.size(-1) % 32 == 0,
              "int8_round_trip: float32 CPU input [..., a multiple of 32]");
  const at::Tensor xc = x.contiguous();
  at::Tensor out = at::empty_like(xc);
  quant::int8_round_trip(xc.data_ptr<float>(), xc.numel(), out.data_ptr<float>());
  return out;
}

}  // namespace

TORCH_LIBRARY_FRAGMENT(thunder_batch, m) { m.def("int8_round_trip(Tensor x) -> Tensor"); }

TORCH_LIBRARY_IMPL(thunder_batch, CPU, m) { m.impl("int8_round_trip", int8_round_trip); }
