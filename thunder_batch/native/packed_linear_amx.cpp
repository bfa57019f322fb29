// bfloat16 linears on AMX (Intel's tile unit, `tdpbf16ps`), from the same packed weight as the
// `vdpbf16ps` kernel: a block's [I/2, 16, 2] is, 16 input pairs at a time, exactly the 16 x 64-byte B
// tile AMX multiplies, so the weights are read as one stream, as there. A tiles are 16 rows x 32 inputs
// of x; C tiles hold 16 rows x 16 outputs in float32. Per output: float32 sums of exact products (32
// inputs per tile step, in order), the bias added once at the end, rounded to bfloat16 once. A row's
// result does not depend on how many rows run with it (its tile row is computed alone), so a slot's
// tokens are the same in a decode step, a prompt lane or a verify lane.
//
// Used for every row count where the CPU has AMX-BF16 and `in` is a multiple of 32: on a 2-core Xeon it
// is 2-3.3x the `vdpbf16ps` kernel at 8-16 rows (as fast at 1) and 1.08-1.9x torch's GEMM at 32-520
// (benchmarks/RESULTS.md).

#include <cpuid.h>
#include <sys/syscall.h>
#include <unistd.h>

#include <torch/library.h>

#include "packed_tiles.h"

namespace packed {
namespace {

#define AMX __attribute__((target("amx-tile,amx-bf16,avx512f,avx512bw,avx512vl,avx512bf16")))

constexpr int kTileRows = 16, kTileInputs = 32;  // an A tile: 16 rows x 64 bytes of bfloat16

struct alignas(64) TileConfig {  // the LDTILECFG operand: palette 1, 8 tiles of up to 16 x 64 bytes
  uint8_t palette = 1, start_row = 0, reserved[14] = {};
  uint16_t colsb[16] = {};
  uint8_t rows[16] = {};
};

// Tiles: 0, 1 = C of row tile 0 (blocks b, b + 1); 2, 3 = C of row tile 1; 4, 5 = A of row tiles 0, 1;
// 6, 7 = B (the weights of blocks b, b + 1). An unused row tile is configured with 1 row.
AMX void configure(int rows0, int rows1) {
  TileConfig cfg;
  const int rows[8] = {rows0, rows0, rows1, rows1, rows0, rows1, kTileRows, kTileRows};
  for (int t = 0; t < 8; ++t) cfg.rows[t] = uint8_t(std::max(rows[t], 1)), cfg.colsb[t] = 64;
  _tile_loadconfig(&cfg);
}

// c [rows, 16] float32 (+ bias) -> bfloat16 outputs o.. of `rows` rows of y [., O]
AMX void store_rows(const float* c, int rows, const float* bias, int64_t o, bf16* y, int64_t O) {
  const int64_t n = std::min<int64_t>(kBlock, O - o);
  const __m512 b = bias ? _mm512_loadu_ps(bias + o) : _mm512_setzero_ps();
  for (int r = 0; r < rows; ++r) {
    const __m256i out = (__m256i)_mm512_cvtneps_pbh(_mm512_add_ps(_mm512_loadu_ps(c + r * kBlock), b));
    _mm256_mask_storeu_epi16(y + r * O + o, __mmask16((1u << n) - 1), out);
  }
}

// Rows m0 .. m0 + rows0 + rows1 (TWO: a second row tile) x NB (1 or 2) blocks from blk.
template <int NB, bool TWO>
AMX void tile_amx(const bf16* x, int64_t I, const bf16* packed, const float* bias, int64_t blk, int64_t m0, int rows0,
                  int rows1, bf16* y, int64_t O) {
  const int64_t pairs = I / 2, x_stride = I * int64_t(sizeof(bf16));
  const bf16 *x0 = x + m0 * I, *x1 = x0 + rows0 * I;
  const bf16 *w0 = packed + blk * I * kBlock, *w1 = w0 + I * kBlock;
  _tile_zero(0);
  _tile_zero(1);
  _tile_zero(2);
  _tile_zero(3);
  for (int64_t k = 0; k < pairs; k += kTileRows) {  // 16 input pairs per step
    _tile_loadd(4, x0 + 2 * k, x_stride);
    _tile_loadd(6, w0 + k * 2 * kBlock, 64);
    _tile_dpbf16ps(0, 4, 6);
    if (TWO) {
      _tile_loadd(5, x1 + 2 * k, x_stride);
      _tile_dpbf16ps(2, 5, 6);
    }
    if (NB == 2) {
      _tile_loadd(7, w1 + k * 2 * kBlock, 64);
      _tile_dpbf16ps(1, 4, 7);
      if (TWO) _tile_dpbf16ps(3, 5, 7);
    }
  }
  alignas(64) float c[kTileRows * kBlock];  // tile numbers are immediates: each store written out
  _tile_stored(0, c, 64);
  store_rows(c, rows0, bias, blk * kBlock, y + m0 * O, O);
  if (TWO) {
    _tile_stored(2, c, 64);
    store_rows(c, rows1, bias, blk * kBlock, y + (m0 + rows0) * O, O);
  }
  if (NB == 2) {
    _tile_stored(1, c, 64);
    store_rows(c, rows0, bias, (blk + 1) * kBlock, y + m0 * O, O);
  }
  if (NB == 2 && TWO) {
    _tile_stored(3, c, 64);
    store_rows(c, rows1, bias, (blk + 1) * kBlock, y + (m0 + rows0) * O, O);
  }
}

template <bool TWO>
AMX void blocks_amx(const bf16* x, int64_t I, const bf16* packed, const float* bias, int64_t g0, int64_t g1,
                    int64_t m, int rows0, int rows1, bf16* y, int64_t O) {
  int64_t blk = g0;
  for (; blk + 2 <= g1; blk += 2) tile_amx<2, TWO>(x, I, packed, bias, blk, m, rows0, rows1, y, O);
  if (blk < g1) tile_amx<1, TWO>(x, I, packed, bias, blk, m, rows0, rows1, y, O);
}

}  // namespace

bool amx_runs(int64_t in_features) {
  static const bool permitted = [] {  // AMX-TILE and AMX-BF16 (CPUID 7.0 EDX bits 24, 22), and Linux's leave
    unsigned a, b, c, d;
    if (!__get_cpuid_count(7, 0, &a, &b, &c, &d) || !(d & (1u << 22)) || !(d & (1u << 24))) return false;
    return syscall(SYS_arch_prctl, 0x1023 /* ARCH_REQ_XCOMP_PERM */, 18 /* XFEATURE_XTILEDATA */) == 0;
  }();
  return permitted && in_features % kTileInputs == 0;
}

// Blocks [blk0, blk1) for all M rows: per group of blocks whose weights stay in L2 (256 KiB), 32 rows at
// a time (two row tiles) against pairs of blocks; x [M, I], y [M, O], bias float32 padded or null.
AMX void rows_amx(const bf16* x, int64_t M, int64_t I, const bf16* packed, const float* bias, int64_t blk0,
                  int64_t blk1, bf16* y, int64_t O) {
  const int64_t group = amx_group(I);
  for (int64_t g0 = blk0; g0 < blk1; g0 += group) {
    const int64_t g1 = std::min(blk1, g0 + group);
    for (int64_t m = 0; m < M; m += 2 * kTileRows) {
      const int rows0 = int(std::min<int64_t>(kTileRows, M - m)), rows1 = int(std::min<int64_t>(kTileRows, M - m - rows0));
      configure(rows0, rows1);
      if (rows1)
        blocks_amx<true>(x, I, packed, bias, g0, g1, m, rows0, rows1, y, O);
      else
        blocks_amx<false>(x, I, packed, bias, g0, g1, m, rows0, 0, y, O);
    }
  }
  _tile_release();
}

}  // namespace packed

TORCH_LIBRARY_FRAGMENT(thunder_batch, m) { m.def("amx_runs(int in_features) -> bool", &packed::amx_runs); }
