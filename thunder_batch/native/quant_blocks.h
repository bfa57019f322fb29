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

#define QAVX2 __attribute__((target("avx2,fma,f16c")))

namespace quant {

QAVX2 inline float half_at(const uint8_t* p) {
  uint16_t h;
  std::memcpy(&h, p, sizeof(h));
  return _cvtsh_ss(h);
}

// Bytes p[0..8) as eight int32: (byte >> shift) & mask.
QAVX2 inline __m256i bits8(const uint8_t* p, int shift, int mask) {
  const __m256i wide = _mm256_cvtepu8_epi32(_mm_loadl_epi64(reinterpret_cast<const __m128i*>(p)));
  return _mm256_and_si256(_mm256_srli_epi32(wide, shift), _mm256_set1_epi32(mask));
}

// Q4_0/Q4_1/Q5_0/Q5_1's 4-bit parts of granule elements 8j..8j+7 (low nibbles first, then high ones).
QAVX2 inline __m256i nibbles32(const uint8_t* qs, int j) { return bits8(qs + 8 * (j % 2), 4 * (j / 2), 0xF); }

// The fifth bits of elements 8j..8j+7 (bit i of qh is element i's), moved to bit 4.
QAVX2 inline __m256i fifth_bits(const uint8_t* qh, int j) {
  uint32_t bits;
  std::memcpy(&bits, qh, sizeof(bits));
  const __m256i shifts = _mm256_add_epi32(_mm256_setr_epi32(0, 1, 2, 3, 4, 5, 6, 7), _mm256_set1_epi32(8 * j));
  const __m256i bit = _mm256_and_si256(_mm256_srlv_epi32(_mm256_set1_epi32(int(bits)), shifts), _mm256_set1_epi32(1));
  return _mm256_slli_epi32(bit, 4);
}

QAVX2 inline __m256 to_float(__m256i v) { return _mm256_cvtepi32_ps(v); }

struct Q8_0 {
  static constexpr int kElems = 32, kBytes = 34;
  QAVX2 static void granule(const uint8_t* b, int, __m256 w[4]) {
    const __m256 d = _mm256_set1_ps(half_at(b));
    for (int j = 0; j < 4; ++j) {
      const __m128i q = _mm_loadl_epi64(reinterpret_cast<const __m128i*>(b + 2 + 8 * j));
      w[j] = _mm256_mul_ps(to_float(_mm256_cvtepi8_epi32(q)), d);
    }
  }
};

struct Q4_0 {
  static constexpr int kElems = 32, kBytes = 18;
  QAVX2 static void granule(const uint8_t* b, int, __m256 w[4]) {
    const __m256 d = _mm256_set1_ps(half_at(b));
    for (int j = 0; j < 4; ++j)
      w[j] = _mm256_mul_ps(d, to_float(_mm256_sub_epi32(nibbles32(b + 2, j), _mm256_set1_epi32(8))));
  }
};

struct Q4_1 {
  static constexpr int kElems = 32, kBytes = 20;
  QAVX2 static void granule(const uint8_t* b, int, __m256 w[4]) {
    const __m256 d = _mm256_set1_ps(half_at(b)), m = _mm256_set1_ps(half_at(b + 2));
    for (int j = 0; j < 4; ++j) w[j] = _mm256_add_ps(_mm256_mul_ps(d, to_float(nibbles32(b + 4, j))), m);
  }
};

struct Q5_0 {
  static constexpr int kElems = 32, kBytes = 22;
  QAVX2 static void granule(const uint8_t* b, int, __m256 w[4]) {
    const __m256 d = _mm256_set1_ps(half_at(b));
    for (int j = 0; j < 4; ++j) {
      const __m256i q = _mm256_or_si256(nibbles32(b + 6, j), fifth_bits(b + 2, j));
      w[j] = _mm256_mul_ps(d, to_float(_mm256_sub_epi32(q, _mm256_set1_epi32(16))));
    }
  }
};

struct Q5_1 {
  static constexpr int kElems = 32, kBytes = 24;
  QAVX2 static void granule(const uint8_t* b, int, __m256 w[4]) {
    const __m256 d = _mm256_set1_ps(half_at(b)), m = _mm256_set1_ps(half_at(b + 2));
    for (int j = 0; j < 4; ++j) {
      const __m256i q = _mm256_or_si256(nibbles32(b + 8, j), fifth_bits(b + 4, j));
      w[j] = _mm256_add_ps(_mm256_mul_ps(d, to_float(q)), m);
    }
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

struct Q4_K {
  static constexpr int kElems = 256, kBytes = 144;
  QAVX2 static void granule(const uint8_t* b, int s, __m256 w[4]) {
    int scale, min;
    scale_min_k4(b + 4, s, scale, min);
    const __m256 ds = _mm256_set1_ps(half_at(b) * float(scale)), dm = _mm256_set1_ps(half_at(b + 2) * float(min));
    const uint8_t* qs = b + 16 + 32 * (s / 2);
    for (int j = 0; j < 4; ++j) w[j] = _mm256_sub_ps(_mm256_mul_ps(ds, to_float(bits8(qs + 8 * j, 4 * (s % 2), 0xF))), dm);
  }
};

struct Q5_K {
  static constexpr int kElems = 256, kBytes = 176;
  QAVX2 static void granule(const uint8_t* b, int s, __m256 w[4]) {
    int scale, min;
    scale_min_k4(b + 4, s, scale, min);
    const __m256 ds = _mm256_set1_ps(half_at(b) * float(scale)), dm = _mm256_set1_ps(half_at(b + 2) * float(min));
    const uint8_t *qh = b + 16, *qs = b + 48 + 32 * (s / 2);
    for (int j = 0; j < 4; ++j) {
      const __m256i q = _mm256_or_si256(bits8(qs + 8 * j, 4 * (s % 2), 0xF), _mm256_slli_epi32(bits8(qh + 8 * j, s, 1), 4));
      w[j] = _mm256_sub_ps(_mm256_mul_ps(ds, to_float(q)), dm);
    }
  }
};

struct Q6_K {
  static constexpr int kElems = 256, kBytes = 210;
  QAVX2 static void granule(const uint8_t* b, int s, __m256 w[4]) {
    const int half = s / 4, quarter = s % 4;
    const uint8_t* ql = b + 64 * half + 32 * (quarter % 2);
    const uint8_t* qh = b + 128 + 32 * half;
    const int8_t* scales = reinterpret_cast<const int8_t*>(b + 192);
    const float d = half_at(b + 208);
    for (int j = 0; j < 4; ++j) {
      const __m256i low = bits8(ql + 8 * j, 4 * (quarter / 2), 0xF);
      const __m256i q = _mm256_or_si256(low, _mm256_slli_epi32(bits8(qh + 8 * j, 2 * quarter, 3), 4));
      const __m256 ds = _mm256_set1_ps(d * float(scales[2 * s + j / 2]));
      w[j] = _mm256_mul_ps(ds, to_float(_mm256_sub_epi32(q, _mm256_set1_epi32(32))));
    }
  }
};

// Granule g (weights 32g..32g+31) of a quantized row.
template <class F>
QAVX2 inline void granule_at(const uint8_t* row, int64_t g, __m256 w[4]) {
  constexpr int per_block = F::kElems / 32;
  F::granule(row + (g / per_block) * F::kBytes, int(g % per_block), w);
}

// f(F{}) for the format of ggml type id `type`; false for a type without a kernel.
template <class Fn>
inline bool with_format(int64_t type, Fn f) {
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

}  // namespace quant
