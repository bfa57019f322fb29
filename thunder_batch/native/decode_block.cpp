// A decode-only step's whole transformer block in one call, for a llama-shaped block: RMSNorm, attention with
// RoPE over grouped K/V heads, a SiLU-gated MLP, no biases but qkv's (Qwen2), residual adds in sequence. The
// linears and the attention (with its K and V writes) are the kernels the step runs op by op; the norms, RoPE, the SiLU
// product and the residual adds between them are AVX2 loops here, rounded where litgpt's modules round
// (float32 math, one rounding to the model's dtype per module): RoPE and the adds give torch's bits, the
// norm's sum and SiLU's exp agree within float32 rounding. One host call a layer instead of eleven (five
// linears, the attention, five fused regions), each of which found the host's caches cold after the weights
// streamed through them.

#include <ATen/ATen.h>
#include <torch/library.h>

#include <algorithm>
#include <cmath>
#include <cstring>
#include <immintrin.h>

#include "ops.h"
#include "packed_tiles.h"
#include "vector_avx2.h"

// Vector code without FMA: GCC vectorizes these loops, and no product is fused into a sum (torch's bits).
#define VECTOR __attribute__((target("avx2")))

namespace {

using packed::bf16;

using packed::load8;
using packed::put;
using packed::store8;
using packed::widen;

// litgpt's RMSNorm over the last dim (no unit offset): (x * rsqrt(mean(x^2) + eps)) * w in float32, rounded
// once. x, out [B, C]; w [C].
template <class T>
VECTOR void rms_norm_rows(const T* x, const T* w, T* out, int64_t B, int64_t C, float eps) {
  for (int64_t b = 0; b < B; ++b) {
    const T* row = x + b * C;
    __m256 sums = _mm256_setzero_ps();
    int64_t c = 0;
    for (; c + 8 <= C; c += 8) sums = _mm256_add_ps(sums, _mm256_mul_ps(load8(row + c), load8(row + c)));
    alignas(32) float part[8];
    _mm256_store_ps(part, sums);
    float squares = ((part[0] + part[1]) + (part[2] + part[3])) + ((part[4] + part[5]) + (part[6] + part[7]));
    for (; c < C; ++c) squares += widen(row[c]) * widen(row[c]);
    const float inv = 1.f / std::sqrt(squares / float(C) + eps);
    const __m256 scale = _mm256_set1_ps(inv);
    for (c = 0; c + 8 <= C; c += 8)
      store8(out + b * C + c, _mm256_mul_ps(_mm256_mul_ps(load8(row + c), scale), load8(w + c)));
    for (; c < C; ++c) put(out[b * C + c], (widen(row[c]) * inv) * widen(w[c]));
  }
}

// litgpt's apply_rope (halves rotated, not interleaved) on the first n (cos's width) values of each head, the
// rest passed through: x * cos + rotated * sin as float32 products and a sum (no FMA here: torch's bits),
// rounded once. src: one row's heads [heads, D]; cos, sin [n] float32; out: the roped heads [heads, D].
template <class T>
VECTOR void rope_heads(const T* src, const float* cos, const float* sin, int64_t heads, int64_t D, int64_t n, T* out) {
  const int64_t half = n / 2;
  for (int64_t h = 0; h < heads; ++h) {
    const T* x = src + h * D;
    T* y = out + h * D;
    int64_t i = 0;
    for (; i + 8 <= half; i += 8) {
      const __m256 lo = load8(x + i), hi = load8(x + half + i);
      const __m256 c_lo = _mm256_loadu_ps(cos + i), s_lo = _mm256_loadu_ps(sin + i);
      const __m256 c_hi = _mm256_loadu_ps(cos + half + i), s_hi = _mm256_loadu_ps(sin + half + i);
      store8(y + i, _mm256_sub_ps(_mm256_mul_ps(lo, c_lo), _mm256_mul_ps(hi, s_lo)));
      store8(y + half + i, _mm256_add_ps(_mm256_mul_ps(hi, c_hi), _mm256_mul_ps(lo, s_hi)));
    }
    for (; i < half; ++i) {
      put(y[i], widen(x[i]) * cos[i] - widen(x[i + half]) * sin[i]);
      put(y[half + i], widen(x[half + i]) * cos[half + i] + widen(x[i]) * sin[half + i]);
    }
    for (i = n; i < D; ++i) y[i] = x[i];
  }
}

// gate = silu(gate) * up with torch's roundings (silu's value, then the product); e^-|x| by the decode
// attention's exp, so silu may differ from torch's in the last bit of a float32. gate, up: [n] values.
template <class T>
__attribute__((target("avx2,fma"))) void silu_mul(T* gate, const T* up, int64_t n) {
  const __m256 one = _mm256_set1_ps(1.f), zero = _mm256_setzero_ps();
  int64_t i = 0;
  for (; i + 8 <= n; i += 8) {
    const __m256 x = load8(gate + i);
    const __m256 e = packed::exp_nonpositive(_mm256_sub_ps(zero, _mm256_andnot_ps(_mm256_set1_ps(-0.f), x)));
    const __m256 sigmoid = _mm256_div_ps(_mm256_blendv_ps(e, one, _mm256_cmp_ps(x, zero, _CMP_GE_OQ)),
                                         _mm256_add_ps(one, e));  // 1 / (1 + e^-x), e^x / (1 + e^x) below 0
    store8(gate + i, _mm256_mul_ps(x, sigmoid));
    store8(gate + i, _mm256_mul_ps(load8(gate + i), load8(up + i)));
  }
  for (; i < n; ++i) {
    put(gate[i], widen(gate[i]) / (1.f + std::exp(-widen(gate[i]))));
    put(gate[i], widen(gate[i]) * widen(up[i]));
  }
}

// y += x elementwise as torch adds (float32 math, one rounding). y, x: [n] values.
template <class T>
VECTOR void add_into(T* y, const T* x, int64_t n) {
  int64_t i = 0;
  for (; i + 8 <= n; i += 8) store8(y + i, _mm256_add_ps(load8(y + i), load8(x + i)));
  for (; i < n; ++i) put(y[i], widen(y[i]) + widen(x[i]));
}

template <class T>
T* values(const at::Tensor& t) {
  return reinterpret_cast<T*>(t.data_ptr());
}

// f(T{}) for the tensor's dtype: float (float32) or bf16 (bfloat16).
template <class F>
void by_dtype(const at::Tensor& t, F f) {
  if (t.scalar_type() == at::kFloat)
    f(float{});
  else
    f(bf16{});
}

at::Tensor rms_norm(const at::Tensor& x, const at::Tensor& w, double eps) {  // x [B, C] -> [B, C]
  at::Tensor out = at::empty_like(x);
  by_dtype(x, [&](auto tag) {
    using T = decltype(tag);
    rms_norm_rows(values<T>(x), values<T>(w), values<T>(out), x.size(0), x.size(1), float(eps));
  });
  return out;
}

// heads [B, W] (each row q's H heads, then k's G, then v's) -> q [B, H, D], k [B, G, D] roped.
void rope(const at::Tensor& heads, const at::Tensor& cos, const at::Tensor& sin, at::Tensor& q, at::Tensor& k) {
  const int64_t B = heads.size(0), W = heads.size(1), H = q.size(1), G = k.size(1), D = q.size(2), n = cos.size(-1);
  by_dtype(heads, [&](auto tag) {
    using T = decltype(tag);
    for (int64_t r = 0; r < B; ++r) {
      const float *c = values<float>(cos) + r * n, *s = values<float>(sin) + r * n;
      rope_heads(values<T>(heads) + r * W, c, s, H, D, n, values<T>(q) + r * H * D);
      rope_heads(values<T>(heads) + r * W + H * D, c, s, G, D, n, values<T>(k) + r * G * D);
    }
  });
}

void silu_mul(at::Tensor& gate, const at::Tensor& up) {  // contiguous, alike
  by_dtype(gate, [&](auto tag) {
    using T = decltype(tag);
    silu_mul(values<T>(gate), values<T>(up), gate.numel());
  });
}

at::Tensor& add_into(at::Tensor& y, const at::Tensor& x) {  // contiguous, alike
  by_dtype(y, [&](auto tag) {
    using T = decltype(tag);
    add_into(values<T>(y), values<T>(x), y.numel());
  });
  return y;
}

at::Tensor linear(const at::Tensor& x, const at::Tensor& packed, int64_t out_features,
                  const c10::optional<at::Tensor>& bias = c10::nullopt) {
  if (packed.dim() == 2) return packed::plain_linear(x, packed, bias, out_features);  // the weight itself
  if (x.scalar_type() == at::kFloat) return packed::packed_linear(x, packed, bias, out_features);
  return packed::packed_linear_bf16(x, packed, bias, out_features);
}

}  // namespace

namespace packed {

// x [B, C] -> the block's output [B, C]. norm weights [C]; the linears' weights packed, or as they are [out, in]
// where the own-layout kernel reads them (qkv, proj, fc_1, fc_2,
// mlp_proj; out_features: qkv's, proj's, fc_1's = fc_2's, mlp_proj's); qkv's bias, if any (Qwen2's); cos, sin
// [B, 1, n] float32; caches
// [B, G, S', D] written at rows [B * G]; masks [K, B, 1, 1, L], `kind` the one this layer reads.
at::Tensor decode_block(const at::Tensor& x, const at::Tensor& norm_1, const at::Tensor& norm_2, const at::Tensor& qkv,
                        const c10::optional<at::Tensor>& qkv_bias, const at::Tensor& proj, const at::Tensor& fc_1, const at::Tensor& fc_2,
                        const at::Tensor& mlp_proj, at::IntArrayRef out_features, const at::Tensor& cos,
                        const at::Tensor& sin, at::Tensor cache_k, at::Tensor cache_v, const at::Tensor& rows,
                        const at::Tensor& masks, int64_t kind, double eps_1, double eps_2, double scale) {
  // The block's own tensors need no autograd or view tracking: its inner ops skip those dispatch layers.
  const at::AutoDispatchBelowADInplaceOrView below_autograd;
  const auto dtype = x.scalar_type();
  TORCH_CHECK(dtype == at::kFloat || dtype == at::kBFloat16, "decode_block: float32 or bfloat16");
  TORCH_CHECK(x.dim() == 2 && x.is_contiguous() && out_features.size() == 4 && cache_k.dim() == 4,
              "decode_block: contiguous x [B, C], four out_features, caches [B, G, S', D]");
  TORCH_CHECK(norm_1.scalar_type() == dtype && norm_2.scalar_type() == dtype && norm_1.is_contiguous() &&
                  norm_2.is_contiguous() && norm_1.numel() == x.size(1) && norm_2.numel() == x.size(1),
              "decode_block: norm weights [C] in x's dtype");
  const int64_t B = x.size(0), G = cache_k.size(1), D = cache_k.size(3), H = out_features[0] / D - 2 * G;
  TORCH_CHECK(cos.scalar_type() == at::kFloat && sin.scalar_type() == at::kFloat && cos.is_contiguous() &&
                  sin.is_contiguous() && cos.sizes() == sin.sizes() && cos.numel() % B == 0 &&
                  cos.size(-1) <= D && cos.size(-1) % 2 == 0 && cos.numel() / B == cos.size(-1),
              "decode_block: contiguous float32 cos, sin [B, 1, n], n even and <= D");
  TORCH_CHECK(H > 0 && out_features[0] == (H + 2 * G) * D && kind >= 0 && kind < masks.size(0),
              "decode_block: qkv's out_features (H + 2G) * D, a mask kind in range");
  at::Tensor heads = linear(rms_norm(x, norm_1, eps_1), qkv, out_features[0], qkv_bias);  // [B, (H + 2G) * D]
  at::Tensor q = at::empty({B, H, D}, x.options()), k = at::empty({B, G, D}, x.options());
  rope(heads, cos, sin, q, k);
  const at::Tensor v = heads.narrow(1, (H + G) * D, G * D).view({B, G, D});
  const at::Tensor y = packed::decode_rows_attention(q, k, v, cache_k, cache_v, rows, masks.select(0, kind), scale);
  at::Tensor attended = linear(y, proj, out_features[1]);
  add_into(attended, x);  // attention's output + x
  const at::Tensor normed = rms_norm(attended, norm_2, eps_2);
  at::Tensor gate = linear(normed, fc_1, out_features[2]);
  silu_mul(gate, linear(normed, fc_2, out_features[2]));  // silu(fc_1) * fc_2
  at::Tensor out = linear(gate, mlp_proj, out_features[3]);
  return add_into(out, attended);
}

}  // namespace packed

TORCH_LIBRARY_FRAGMENT(thunder_batch, m) {
  m.def(
      "decode_block(Tensor x, Tensor norm_1, Tensor norm_2, Tensor qkv, Tensor? qkv_bias, Tensor proj, Tensor fc_1, "
      "Tensor fc_2, "
      "Tensor mlp_proj, int[] out_features, Tensor cos, Tensor sin, Tensor(a!) cache_k, Tensor(b!) cache_v, "
      "Tensor rows, Tensor masks, int kind, float eps_1, float eps_2, float scale) -> Tensor");
}

TORCH_LIBRARY_IMPL(thunder_batch, CPU, m) { m.impl("decode_block", packed::decode_block); }
