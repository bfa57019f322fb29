// GGUF's quantized blocks (ggml's layouts), each read as granules of 32 consecutive weights widened to four
// ymm of float32. A granule's floats are those of the `gguf` package's dequantizer bit for bit: the same
// float32 products and sums, in its order, never fused (the including file turns contraction off).
//
// Block layouts (bytes): Q8_0 d, qs[32] (int8); Q4_0 d, qs[16] (element i: low nibble of qs[i], i + 16: high);
// Q4_1 d, m, qs[16]; Q5_0 d, qh[4] (bit i: element i's fifth bit), qs[16]; Q5_1 d, m, qh[4], qs[16];
// Q4_K (256 weights) d, dmin, scales[12] (8 six-bit scales and mins), qs[128]; Q5_K as Q4_K plus qh[32] before
// qs; Q6_K ql[128], qh[64], scales[16] (int8, one per 16 weights), d. d, m, dmin: float16.
#pragma once

#include <immintrin.h>

#include <cstdint>
#include <cstring>

#include "vector_avx2.h"

#define QAVX2 __attribute__((target("avx2,fma,f16c")))
// Inlined into the kernels' loops: a call per granule spills the accumulators (measured: 2x slower at one row).
#define QINLINE __attribute__((always_inline)) inline

namespace quant {

QAVX2 QINLINE float half_at(const uint8_t* p) {
  uint16_t h;
  std::memcpy(&h, p, sizeof(h));
  return _cvtsh_ss(h);
}

using packed::hsum;

// A granule as integers for the int8 path (quantized_int8.cpp): weight j is a[j / 16] * q[j] + m, q int8 (the
// unsigned formats' q is 0..31, so it may be the unsigned side of a byte product as it is); a[0] == a[1] but in
// the formats with kTwoScales (Q6_K: a scale per 16 weights).
struct Ints {
  __m256i q;
  float a[2];
  float m;
};

// 32 bytes (signed) widened to four ymm of float32, elements 0-7, 8-15, 16-23, 24-31.
QAVX2 QINLINE void widen32(__m128i low, __m128i high, __m256 w[4]) {
  w[0] = _mm256_cvtepi32_ps(_mm256_cvtepi8_epi32(low));
  w[1] = _mm256_cvtepi32_ps(_mm256_cvtepi8_epi32(_mm_unpackhi_epi64(low, low)));
  w[2] = _mm256_cvtepi32_ps(_mm256_cvtepi8_epi32(high));
  w[3] = _mm256_cvtepi32_ps(_mm256_cvtepi8_epi32(_mm_unpackhi_epi64(high, high)));
}
QAVX2 QINLINE void widen32(__m256i bytes, __m256 w[4]) {
  widen32(_mm256_castsi256_si128(bytes), _mm256_extracti128_si256(bytes, 1), w);
}

// A 32-weight block's 4-bit parts (qs[16]: element i the low nibble of qs[i], i + 16 the high one) as bytes.
QAVX2 QINLINE __m256i nibbles32(const uint8_t* qs) {
  const __m128i v = _mm_loadu_si128(reinterpret_cast<const __m128i*>(qs)), mask = _mm_set1_epi8(0xF);
  return _mm256_set_m128i(_mm_and_si128(_mm_srli_epi16(v, 4), mask), _mm_and_si128(v, mask));
}

// Bytes (p[i] >> shift) & mask for i < 32 (the shift crosses bytes; the mask drops what came from the next).
QAVX2 QINLINE __m256i bits32(const uint8_t* p, int shift, int mask) {
  const __m256i v = _mm256_loadu_si256(reinterpret_cast<const __m256i*>(p));
  return _mm256_and_si256(_mm256_srl_epi16(v, _mm_cvtsi32_si128(shift)), _mm256_set1_epi8(char(mask)));
}

// Q5_0/Q5_1's fifth bits (bit i of qh[4] is element i's) as bytes 0 or 16 (llama.cpp's bytes_from_bits_32).
QAVX2 QINLINE __m256i fifth_bits(const uint8_t* qh) {
  uint32_t bits;
  std::memcpy(&bits, qh, sizeof(bits));
  const __m256i spread = _mm256_shuffle_epi8(_mm256_set1_epi32(int(bits)),
                                             _mm256_set_epi64x(0x0303030303030303, 0x0202020202020202,
                                                               0x0101010101010101, 0x0000000000000000));
  const __m256i set = _mm256_cmpeq_epi8(_mm256_or_si256(spread, _mm256_set1_epi64x(0x7fbfdfeff7fbfdfe)),
                                        _mm256_set1_epi64x(-1));
  return _mm256_and_si256(set, _mm256_set1_epi8(16));
}

struct Q8_0 {
  static constexpr int kElems = 32, kBytes = 34;
  static constexpr bool kUnsigned = false, kTwoScales = false;
  QAVX2 QINLINE static void ints(const uint8_t* b, int, Ints& k) {
    k.q = _mm256_loadu_si256(reinterpret_cast<const __m256i*>(b + 2));
    k.a[0] = k.a[1] = half_at(b), k.m = 0.f;
  }
  QAVX2 QINLINE static void granule(const uint8_t* b, int, __m256 w[4]) {
    const __m256 d = _mm256_set1_ps(half_at(b));
    for (int j = 0; j < 4; ++j) {
      const __m128i q = _mm_loadl_epi64(reinterpret_cast<const __m128i*>(b + 2 + 8 * j));
      w[j] = _mm256_mul_ps(_mm256_cvtepi32_ps(_mm256_cvtepi8_epi32(q)), d);
    }
  }
};

struct Q4_0 {
  static constexpr int kElems = 32, kBytes = 18;
  static constexpr bool kUnsigned = false, kTwoScales = false;
  QAVX2 QINLINE static void ints(const uint8_t* b, int, Ints& k) {
    k.q = _mm256_sub_epi8(nibbles32(b + 2), _mm256_set1_epi8(8));
    k.a[0] = k.a[1] = half_at(b), k.m = 0.f;
  }
  QAVX2 QINLINE static void granule(const uint8_t* b, int, __m256 w[4]) {
    const __m256 d = _mm256_set1_ps(half_at(b));
    widen32(_mm256_sub_epi8(nibbles32(b + 2), _mm256_set1_epi8(8)), w);
    for (int j = 0; j < 4; ++j) w[j] = _mm256_mul_ps(d, w[j]);
  }
};

struct Q4_1 {
  static constexpr int kElems = 32, kBytes = 20;
  static constexpr bool kUnsigned = true, kTwoScales = false;
  QAVX2 QINLINE static void ints(const uint8_t* b, int, Ints& k) {
    k.q = nibbles32(b + 4);
    k.a[0] = k.a[1] = half_at(b), k.m = half_at(b + 2);
  }
  QAVX2 QINLINE static void granule(const uint8_t* b, int, __m256 w[4]) {
    const __m256 d = _mm256_set1_ps(half_at(b)), m = _mm256_set1_ps(half_at(b + 2));
    widen32(nibbles32(b + 4), w);
    for (int j = 0; j < 4; ++j) w[j] = _mm256_add_ps(_mm256_mul_ps(d, w[j]), m);
  }
};

struct Q5_0 {
  static constexpr int kElems = 32, kBytes = 22;
  static constexpr bool kUnsigned = false, kTwoScales = false;
  QAVX2 QINLINE static void ints(const uint8_t* b, int, Ints& k) {
    k.q = _mm256_sub_epi8(_mm256_or_si256(nibbles32(b + 6), fifth_bits(b + 2)), _mm256_set1_epi8(16));
    k.a[0] = k.a[1] = half_at(b), k.m = 0.f;
  }
  QAVX2 QINLINE static void granule(const uint8_t* b, int, __m256 w[4]) {
    const __m256 d = _mm256_set1_ps(half_at(b));
    const __m256i q = _mm256_or_si256(nibbles32(b + 6), fifth_bits(b + 2));
    widen32(_mm256_sub_epi8(q, _mm256_set1_epi8(16)), w);
    for (int j = 0; j < 4; ++j) w[j] = _mm256_mul_ps(d, w[j]);
  }
};

struct Q5_1 {
  static constexpr int kElems = 32, kBytes = 24;
  static constexpr bool kUnsigned = true, kTwoScales = false;
  QAVX2 QINLINE static void ints(const uint8_t* b, int, Ints& k) {
    k.q = _mm256_or_si256(nibbles32(b + 8), fifth_bits(b + 4));
    k.a[0] = k.a[1] = half_at(b), k.m = half_at(b + 2);
  }
  QAVX2 QINLINE static void granule(const uint8_t* b, int, __m256 w[4]) {
    const __m256 d = _mm256_set1_ps(half_at(b)), m = _mm256_set1_ps(half_at(b + 2));
    widen32(_mm256_or_si256(nibbles32(b + 8), fifth_bits(b + 4)), w);
    for (int j = 0; j < 4; ++j) w[j] = _mm256_add_ps(_mm256_mul_ps(d, w[j]), m);
  }
};

// Q4_K/Q5_K: sub-block s's six-bit scale and min (ggml's get_scale_min_k4).
inline void scale_min_k4(const uint8_t* q, int s, int& scale, int& min) {
  if (s < 4) {
    scale = q[s] & 63, min = q[s + 4] & 63;
  } else {
    scale = (q[s + 4] & 0xF) | ((q[s - 4] >> 6) << 4);
    min = (q[s + 4] >> 4) | ((q[s] >> 6) << 4);
  }
}

// Q4_K/Q5_K: w = (d * scale) * q - (dmin * min), q the granule's bytes.
QAVX2 QINLINE void scaled_k4(const uint8_t* b, int s, __m256i q, __m256 w[4]) {
  int scale, min;
  scale_min_k4(b + 4, s, scale, min);
  const __m256 ds = _mm256_set1_ps(half_at(b) * float(scale)), dm = _mm256_set1_ps(half_at(b + 2) * float(min));
  widen32(q, w);
  for (int j = 0; j < 4; ++j) w[j] = _mm256_sub_ps(_mm256_mul_ps(ds, w[j]), dm);
}

// Q4_K/Q5_K as integers: a = d * scale, m = -(dmin * min).
QAVX2 QINLINE void k4_ints(const uint8_t* b, int s, __m256i q, Ints& k) {
  int scale, min;
  scale_min_k4(b + 4, s, scale, min);
  k.q = q, k.a[0] = k.a[1] = half_at(b) * float(scale), k.m = -(half_at(b + 2) * float(min));
}

struct Q4_K {
  static constexpr int kElems = 256, kBytes = 144;
  static constexpr bool kUnsigned = true, kTwoScales = false;
  QAVX2 QINLINE static void ints(const uint8_t* b, int s, Ints& k) {
    k4_ints(b, s, bits32(b + 16 + 32 * (s / 2), 4 * (s % 2), 0xF), k);
  }
  QAVX2 QINLINE static void granule(const uint8_t* b, int s, __m256 w[4]) {
    scaled_k4(b, s, bits32(b + 16 + 32 * (s / 2), 4 * (s % 2), 0xF), w);
  }
};

struct Q5_K {
  static constexpr int kElems = 256, kBytes = 176;
  static constexpr bool kUnsigned = true, kTwoScales = false;
  QAVX2 QINLINE static void ints(const uint8_t* b, int s, Ints& k) {
    const __m256i high = _mm256_slli_epi16(bits32(b + 16, s, 1), 4);
    k4_ints(b, s, _mm256_or_si256(bits32(b + 48 + 32 * (s / 2), 4 * (s % 2), 0xF), high), k);
  }
  QAVX2 QINLINE static void granule(const uint8_t* b, int s, __m256 w[4]) {
    const __m256i high = _mm256_slli_epi16(bits32(b + 16, s, 1), 4);
    scaled_k4(b, s, _mm256_or_si256(bits32(b + 48 + 32 * (s / 2), 4 * (s % 2), 0xF), high), w);
  }
};

struct Q6_K {
  static constexpr int kElems = 256, kBytes = 210;
  static constexpr bool kUnsigned = false, kTwoScales = true;
  QAVX2 QINLINE static void ints(const uint8_t* b, int s, Ints& k) {
    const int half = s / 4, quarter = s % 4;
    const __m256i low = bits32(b + 64 * half + 32 * (quarter % 2), 4 * (quarter / 2), 0xF);
    const __m256i high = _mm256_slli_epi16(bits32(b + 128 + 32 * half, 2 * quarter, 3), 4);
    k.q = _mm256_sub_epi8(_mm256_or_si256(low, high), _mm256_set1_epi8(32));
    const int8_t* scales = reinterpret_cast<const int8_t*>(b + 192);
    const float d = half_at(b + 208);
    k.a[0] = d * float(scales[2 * s]), k.a[1] = d * float(scales[2 * s + 1]), k.m = 0.f;
  }
  QAVX2 QINLINE static void granule(const uint8_t* b, int s, __m256 w[4]) {
    const int half = s / 4, quarter = s % 4;
    const __m256i low = bits32(b + 64 * half + 32 * (quarter % 2), 4 * (quarter / 2), 0xF);
    const __m256i high = _mm256_slli_epi16(bits32(b + 128 + 32 * half, 2 * quarter, 3), 4);
    widen32(_mm256_sub_epi8(_mm256_or_si256(low, high), _mm256_set1_epi8(32)), w);
    const int8_t* scales = reinterpret_cast<const int8_t*>(b + 192);
    const float d = half_at(b + 208);
    const __m256 first = _mm256_set1_ps(d * float(scales[2 * s])), second = _mm256_set1_ps(d * float(scales[2 * s + 1]));
    w[0] = _mm256_mul_ps(first, w[0]), w[1] = _mm256_mul_ps(first, w[1]);
    w[2] = _mm256_mul_ps(second, w[2]), w[3] = _mm256_mul_ps(second, w[3]);
  }
};

// Float formats kept as they are (a GGUF's F16/BF16 linears): 32 weights widened exactly; no integer view.
struct F16 {
  static constexpr int kElems = 32, kBytes = 64;
  QAVX2 QINLINE static void granule(const uint8_t* b, int, __m256 w[4]) {
    for (int j = 0; j < 4; ++j) w[j] = _mm256_cvtph_ps(_mm_loadu_si128(reinterpret_cast<const __m128i*>(b + 16 * j)));
  }
};

struct BF16 {
  static constexpr int kElems = 32, kBytes = 64;
  QAVX2 QINLINE static void granule(const uint8_t* b, int, __m256 w[4]) {
    for (int j = 0; j < 4; ++j) {
      const __m256i h = _mm256_cvtepu16_epi32(_mm_loadu_si128(reinterpret_cast<const __m128i*>(b + 16 * j)));
      w[j] = _mm256_castsi256_ps(_mm256_slli_epi32(h, 16));
    }
  }
};

// Granule g of a quantized row as integers.
template <class F>
QAVX2 QINLINE void ints_at(const uint8_t* row, int64_t g, Ints& k) {
  constexpr int per_block = F::kElems / 32;
  F::ints(row + (g / per_block) * F::kBytes, int(g % per_block), k);
}

// Granule g (weights 32g..32g+31) of a quantized row.
template <class F>
QAVX2 QINLINE void granule_at(const uint8_t* row, int64_t g, __m256 w[4]) {
  constexpr int per_block = F::kElems / 32;
  F::granule(row + (g / per_block) * F::kBytes, int(g % per_block), w);
}

// f(F{}) for the quantized format of ggml type id `type` (those with an integer view); false for any other.
template <class Fn>
inline bool with_int_format(int64_t type, Fn f) {
  switch (type) {
    case 8: return f(Q8_0{}), true;
    case 2: return f(Q4_0{}), true;
    case 3: return f(Q4_1{}), true;
    case 6: return f(Q5_0{}), true;
    case 7: return f(Q5_1{}), true;
    case 12: return f(Q4_K{}), true;
    case 13: return f(Q5_K{}), true;
    case 14: return f(Q6_K{}), true;
    default: return false;
  }
}

// f(F{}) for the format of ggml type id `type`; false for a type without a kernel.
template <class Fn>
inline bool with_format(int64_t type, Fn f) {
  if (type == 1) return f(F16{}), true;
  if (type == 30) return f(BF16{}), true;
  return with_int_format(type, f);
}

}  // namespace quant
