// The ops that other native ops call directly (decode_block.cpp, decode_stack.cpp), defined in their own
// files; each is also registered with torch as `thunder_batch::<name>`.
#pragma once

#include <ATen/ATen.h>

namespace packed {

// float32 x [..., in] @ w.T (+ bias) from pack_linear_weight(w) (packed_linear.cpp).
at::Tensor packed_linear(const at::Tensor& x, const at::Tensor& packed, const c10::optional<at::Tensor>& bias,
                         int64_t out_features);
// Every row of x [M, in] against one block of 16 outputs, `block` [in, 16] (block `blk` of pack_linear_weight's
// layout): y [M, O]'s columns 16 blk .. 16 blk + 15 (those below O). AVX2 + FMA (packed_linear.cpp).
void packed_block_rows(const float* x, int64_t M, int64_t I, const float* block, int64_t blk, float* y, int64_t O);
// bfloat16 x [..., in] @ w.T (+ bias) from pack_linear_weight_bf16(w) (packed_linear_bf16.cpp).
at::Tensor packed_linear_bf16(const at::Tensor& x, const at::Tensor& packed, const c10::optional<at::Tensor>& bias,
                              int64_t out_features);
// float32 or bfloat16 x [..., in] @ w.T (+ bias) read from w's own layout [out, in] (plain_linear.cpp).
at::Tensor plain_linear(const at::Tensor& x, const at::Tensor& w, const c10::optional<at::Tensor>& bias,
                        int64_t out_features);
// A decode-only step's attention with its K and V writes (decode_attention.cpp).
at::Tensor decode_rows_attention(const at::Tensor& q, const at::Tensor& k, const at::Tensor& v, at::Tensor cache_k,
                                 at::Tensor cache_v, const at::Tensor& rows, const at::Tensor& mask, double scale);

// A decode-only step's llama-shaped block, one call (decode_block.cpp).
at::Tensor decode_block(const at::Tensor& x, const at::Tensor& norm_1, const at::Tensor& norm_2, const at::Tensor& qkv,
                        const c10::optional<at::Tensor>& qkv_bias, const at::Tensor& proj, const at::Tensor& fc_1,
                        const at::Tensor& fc_2, const at::Tensor& mlp_proj, at::IntArrayRef out_features,
                        const at::Tensor& cos, const at::Tensor& sin, at::Tensor cache_k, at::Tensor cache_v,
                        const at::Tensor& rows, const at::Tensor& masks, int64_t kind, double eps_1, double eps_2,
                        double scale);

}  // namespace packed
