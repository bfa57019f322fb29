// The int8 path of the quantized linears (quantized_int8.cpp), called by quantized_linear.cpp.
#pragma once

#include <cstdint>

namespace quant {

// y [M, O] = dequantize(x's int8 blocks) @ dequantize(w).T, x float32 [M, I] (each 32 values one int8 block),
// w [O, row bytes] of ggml type `type` (a quantized one: quant_blocks.h's with_int_format), by integer dot products.
void int8_linear_rows(int64_t type, const float* x, int64_t M, int64_t I, const uint8_t* w, float* y, int64_t O);
// out[:n] = dequantize(x[:n]'s int8 blocks), n a multiple of 32.
void int8_round_trip(const float* x, int64_t n, float* out);

}  // namespace quant
