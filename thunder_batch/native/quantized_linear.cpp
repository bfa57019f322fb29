// float32 y = x @ w.T (+ b) with w kept as GGUF's quantized blocks (quant_blocks.h), read in their own layout:
// the weights stay in memory at the file's size and no packed copy sits beside them.
//
// Up to kDirectRows rows (decode steps): each thread takes whole output rows; a row's blocks are widened in
// registers, 32 weights at a time, and each granule multiplies every row of x (float32 FMA accumulators, one
// horizontal sum per output at the end). More rows (prompt steps): 16 output rows at a time are widened into
// the float32 packed layout [in, 16] in a buffer that stays in L2, and the packed float32 kernel
// (packed_linear.cpp) runs every row against it, so the widening is paid once per 16 outputs per step.
// Either way each output is float32 products of the dequantized weights summed in float32: the
// `gguf` package's dequantization followed by a float32 matmul, up to the order of the sums.
// With int8_activations (opt-in) x is first rounded to int8 blocks: up to kDirectRows rows then take
// integer dot products (quantized_int8.cpp), more rows the path above on the rounded x.
//
#include <ATen/ATen.h>
#include <ATen/Parallel.h>
#include <torch/library.h>

#include <vector>

#include "ops.h"
#include "packed_tiles.h"

// The dequantized weights must round as the `gguf` package's do: never fuse a product and a sum.
#pragma GCC optimize("fp-contract=off")
#include "quant_blocks.h"
#include "quant_int8.h"

namespace {

using quant::granule_at;
using quant::hsum;

// At most this many rows of x run on the register path; more widen each 16 outputs once into L2.
constexpr int64_t kDirectRows = 16;

template <class F>
QAVX2 QINLINE int64_t row_bytes(int64_t I) {
  return I / F::kElems * F::kBytes;
}

// R rows of x [R, I] against one quantized row: y[r * ldy] = x[r] . w. A accumulators a row keep at least four FMA
// chains going at one row.
template <class F, int R>
QAVX2 void row_dots(const float* x, int64_t I, const uint8_t* w, float* y, int64_t ldy) {
  constexpr int A = R >= 4 ? 1 : (R >= 2 ? 2 : 4);
  __m256 acc[R][A];
  UNROLL for (int r = 0; r < R; ++r)
    UNROLL for (int a = 0; a < A; ++a) acc[r][a] = _mm256_setzero_ps();
  for (int64_t g = 0; g < I / 32; ++g) {
    __m256 wv[4];
    granule_at<F>(w, g, wv);
    UNROLL for (int r = 0; r < R; ++r)
      UNROLL for (int j = 0; j < 4; ++j) {
        const __m256 xv = _mm256_loadu_ps(x + r * I + g * 32 + 8 * j);
        acc[r][j % A] = _mm256_fmadd_ps(wv[j], xv, acc[r][j % A]);
      }
  }
  UNROLL for (int r = 0; r < R; ++r) {
    __m256 sum = acc[r][0];
    UNROLL for (int a = 1; a < A; ++a) sum = _mm256_add_ps(sum, acc[r][a]);
    y[r * ldy] = hsum(sum);
  }
}

// Every row of x [M, I] against one quantized row w, into y[m * O], in passes of at most 8 rows, as even as they go
// (packed::even_passes).
template <class F>
QAVX2 void row_passes(const float* x, int64_t M, int64_t I, const uint8_t* w, float* y, int64_t O) {
  const int64_t passes = (M + 7) / 8;
  for (int64_t p = 0, m = 0; p < passes; ++p) {
    const int64_t rows = M / passes + (p < M % passes);
    const float* xm = x + m * I;
    float* ym = y + m * O;
    m += rows;
    switch (rows) {
      case 8: row_dots<F, 8>(xm, I, w, ym, O); break;
      case 7: row_dots<F, 7>(xm, I, w, ym, O); break;
      case 6: row_dots<F, 6>(xm, I, w, ym, O); break;
      case 5: row_dots<F, 5>(xm, I, w, ym, O); break;
      case 4: row_dots<F, 4>(xm, I, w, ym, O); break;
      case 3: row_dots<F, 3>(xm, I, w, ym, O); break;
      case 2: row_dots<F, 2>(xm, I, w, ym, O); break;
      default: row_dots<F, 1>(xm, I, w, ym, O);
    }
  }
}

// Output rows [o0, o1) for every row of x [M <= kDirectRows, I]. Each pass of up to 8 rows widens the row's
// granules again: a row widened once into L1 and read back by every pass measured slower (RESULTS.md).
template <class F>
QAVX2 void direct_rows(const float* x, int64_t M, int64_t I, const uint8_t* w, int64_t o0, int64_t o1, float* y,
                       int64_t O) {
  for (int64_t o = o0; o < o1; ++o) row_passes<F>(x, M, I, w + o * row_bytes<F>(I), y + o, O);
}

// Rows [o0, o0 + 16) of w (those below O) widened into `block` [I, 16], the packed float32 layout.
template <class F>
QAVX2 void widen_block(const uint8_t* w, int64_t I, int64_t o0, int64_t O, float* block) {
  const int64_t stride = row_bytes<F>(I);
  alignas(32) float granule[32];
  for (int64_t r = 0; r < packed::kBlock; ++r) {
    if (o0 + r >= O) {
      for (int64_t i = 0; i < I; ++i) block[i * packed::kBlock + r] = 0.f;
      continue;
    }
    for (int64_t g = 0; g < I / 32; ++g) {
      __m256 wv[4];
      granule_at<F>(w + (o0 + r) * stride, g, wv);
      for (int j = 0; j < 4; ++j) _mm256_store_ps(granule + 8 * j, wv[j]);
      for (int e = 0; e < 32; ++e) block[(g * 32 + e) * packed::kBlock + r] = granule[e];
    }
  }
}

template <class F>
void linear_rows(const float* x, int64_t M, int64_t I, const uint8_t* w, float* y, int64_t O) {
  const int64_t blocks = (O + packed::kBlock - 1) / packed::kBlock;
  if (M <= kDirectRows) {
    packed::share_blocks(blocks, 4, [&](int64_t b0, int64_t b1) {
      direct_rows<F>(x, M, I, w, b0 * packed::kBlock, std::min(O, b1 * packed::kBlock), y, O);
    });
    return;
  }
  packed::share_blocks(blocks, 1, [&](int64_t b0, int64_t b1) {
    float* block = packed::thread_buffer(I * packed::kBlock);
    for (int64_t b = b0; b < b1; ++b) {
      widen_block<F>(w, I, b * packed::kBlock, O, block);
      packed::packed_block_rows(x, M, I, block, b, y, O);
    }
  });
}

void check_weight(const at::Tensor& w, int64_t type, int64_t I, const char* op) {
  int64_t bytes = -1, elems = 1;
  quant::with_format(type, [&](auto f) { bytes = decltype(f)::kBytes, elems = decltype(f)::kElems; });
  TORCH_CHECK(bytes > 0, op, ": no kernel for ggml type ", type);
  TORCH_CHECK(I % elems == 0, op, ": in_features ", I, " is not a multiple of the format's ", elems, "-weight blocks");
  TORCH_CHECK(w.dim() == 2 && w.scalar_type() == at::kByte && w.is_contiguous() && w.device().is_cpu() &&
                  w.size(1) == I / elems * bytes,
              op, ": a contiguous uint8 CPU weight [out, ", I / elems * bytes, "] of ggml type ", type);
}

// int8_activations: up to kDirectRows rows by integer dot products (quantized_int8.cpp); more rows multiply the
// same rounded x on the float32 path, so every row count computes the same thing.
at::Tensor quantized_linear(const at::Tensor& x, const at::Tensor& w, const c10::optional<at::Tensor>& bias,
                            int64_t type, int64_t in_features, bool int8_activations) {
  TORCH_CHECK(x.scalar_type() == at::kFloat && x.device().is_cpu() && x.size(-1) == in_features,
              "quantized_linear: float32 CPU input [..., ", in_features, "]");
  check_weight(w, type, in_features, "quantized_linear");
  const int64_t I = in_features, O = w.size(0);
  TORCH_CHECK(!int8_activations || quant::with_int_format(type, [](auto) {}),
              "quantized_linear: int8_activations needs a quantized format, not ggml type ", type);
  at::Tensor x2 = x.reshape({-1, I}).contiguous();
  const int64_t M = x2.size(0);
  at::Tensor y = at::empty({M, O}, x.options());
  if (int8_activations && M <= kDirectRows) {
    quant::int8_linear_rows(type, x2.data_ptr<float>(), M, I, w.data_ptr<uint8_t>(), y.data_ptr<float>(), O);
  } else {
    if (int8_activations) {
      at::Tensor rounded = at::empty_like(x2);
      quant::int8_round_trip(x2.data_ptr<float>(), x2.numel(), rounded.data_ptr<float>());
      x2 = rounded;
    }
    quant::with_format(type, [&](auto f) {
      linear_rows<decltype(f)>(x2.data_ptr<float>(), M, I, w.data_ptr<uint8_t>(), y.data_ptr<float>(), O);
    });
  }
  if (bias.has_value()) y.add_(*bias);
  auto shape = x.sizes().vec();
  shape.back() = O;
  return y.view(shape);
}

template <class F>
QAVX2 void dequantize_rows(const uint8_t* w, int64_t I, int64_t o0, int64_t o1, float* out) {
  for (int64_t o = o0; o < o1; ++o)
    for (int64_t g = 0; g < I / 32; ++g) {
      __m256 wv[4];
      granule_at<F>(w + o * row_bytes<F>(I), g, wv);
      for (int j = 0; j < 4; ++j) _mm256_storeu_ps(out + o * I + g * 32 + 8 * j, wv[j]);
    }
}

// The float32 weights [out, in] that `w`'s blocks stand for (what `gguf.quants.dequantize` gives).
at::Tensor dequantize(const at::Tensor& w, int64_t type, int64_t in_features) {
  check_weight(w, type, in_features, "dequantize");
  at::Tensor out = at::empty({w.size(0), in_features}, w.options().dtype(at::kFloat));
  quant::with_format(type, [&](auto f) {
    at::parallel_for(0, w.size(0), 16, [&](int64_t o0, int64_t o1) {
      dequantize_rows<decltype(f)>(w.data_ptr<uint8_t>(), in_features, o0, o1, out.data_ptr<float>());
    });
  });
  return out;
}

}  // namespace

TORCH_LIBRARY_FRAGMENT(thunder_batch, m) {
  m.def(
      "quantized_linear(Tensor x, Tensor w, Tensor? bias, int ggml_type, int in_features, bool int8_activations=False)"
      " -> Tensor");
  m.def("dequantize(Tensor w, int ggml_type, int in_features) -> Tensor");
}

TORCH_LIBRARY_IMPL(thunder_batch, CPU, m) {
  m.impl("quantized_linear", quantized_linear);
  m.impl("dequantize", dequantize);
}
