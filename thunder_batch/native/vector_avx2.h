// AVX2 helpers of the decode attention, the decode block and the linears' kernels: float32 and bfloat16 values widened to float32
// (one or eight at a time), rounded back as torch rounds (to nearest even, NaN kept), and e^x for x <= 0.
#pragma once

#include <ATen/ATen.h>
#include <immintrin.h>

#include <cmath>
#include <cstdint>
#include <cstring>

namespace packed {

#define PACKED_AVX2 __attribute__((target("avx2")))

PACKED_AVX2 inline float widen(float v) { return v; }
PACKED_AVX2 inline float widen(uint16_t v) {  // a bfloat16 is the high half of a float32
  const uint32_t bits = uint32_t(v) << 16;
  float f;
  std::memcpy(&f, &bits, sizeof(f));
  return f;
}
PACKED_AVX2 inline float widen(at::BFloat16 v) { return widen(v.x); }
PACKED_AVX2 inline void put(float& out, float v) { out = v; }
PACKED_AVX2 inline void put(uint16_t& out, float v) {  // torch's float -> bfloat16
  uint32_t bits;
  std::memcpy(&bits, &v, sizeof(bits));
  out = std::isnan(v) ? uint16_t(0x7fc0) : uint16_t((bits + 0x7fff + ((bits >> 16) & 1)) >> 16);
}
PACKED_AVX2 inline __m256 load8(const float* p) { return _mm256_loadu_ps(p); }
PACKED_AVX2 inline __m256 load8(const uint16_t* p) {
  const __m256i wide = _mm256_cvtepu16_epi32(_mm_loadu_si128(reinterpret_cast<const __m128i*>(p)));
  return _mm256_castsi256_ps(_mm256_slli_epi32(wide, 16));
}
PACKED_AVX2 inline float hsum(__m256 v) {  // the sum of v's eight floats
  const __m128 s = _mm_add_ps(_mm256_castps256_ps128(v), _mm256_extractf128_ps(v, 1));
  const __m128 h = _mm_add_ps(s, _mm_movehl_ps(s, s));
  return _mm_cvtss_f32(_mm_add_ss(h, _mm_shuffle_ps(h, h, 1)));
}
PACKED_AVX2 inline __m256 load8(const at::BFloat16* p) { return load8(reinterpret_cast<const uint16_t*>(p)); }
PACKED_AVX2 inline void store8(float* p, __m256 v) { _mm256_storeu_ps(p, v); }
PACKED_AVX2 inline void store8(uint16_t* p, __m256 v) {  // `put`'s rounding, eight at a time
  const __m256i bits = _mm256_castps_si256(v);
  const __m256i odd = _mm256_and_si256(_mm256_srli_epi32(bits, 16), _mm256_set1_epi32(1));
  __m256i rounded = _mm256_srli_epi32(_mm256_add_epi32(bits, _mm256_add_epi32(odd, _mm256_set1_epi32(0x7fff))), 16);
  const __m256i nan = _mm256_castps_si256(_mm256_cmp_ps(v, v, _CMP_UNORD_Q));
  rounded = _mm256_blendv_epi8(rounded, _mm256_set1_epi32(0x7fc0), nan);
  const __m128i halves = _mm_packus_epi32(_mm256_castsi256_si128(rounded), _mm256_extracti128_si256(rounded, 1));
  _mm_storeu_si128(reinterpret_cast<__m128i*>(p), halves);
}

// e^x for x <= 0 (Cephes' expf: 2^n e^r, |r| <= ln2 / 2, a degree-6 polynomial; ~1 ulp); below -87, ~1e-38.
__attribute__((target("avx2,fma"))) inline __m256 exp_nonpositive(__m256 x) {
  x = _mm256_max_ps(x, _mm256_set1_ps(-87.f));
  const __m256 n = _mm256_round_ps(_mm256_mul_ps(x, _mm256_set1_ps(1.44269504088896341f)),
                                   _MM_FROUND_TO_NEAREST_INT | _MM_FROUND_NO_EXC);
  __m256 r = _mm256_fnmadd_ps(n, _mm256_set1_ps(0.693359375f), x);
  r = _mm256_fnmadd_ps(n, _mm256_set1_ps(-2.12194440e-4f), r);
  __m256 p = _mm256_set1_ps(1.9875691500e-4f);
  for (float c : {1.3981999507e-3f, 8.3334519073e-3f, 4.1665795894e-2f, 1.6666665459e-1f, 5.0000001201e-1f})
    p = _mm256_fmadd_ps(p, r, _mm256_set1_ps(c));
  p = _mm256_fmadd_ps(p, _mm256_mul_ps(r, r), _mm256_add_ps(r, _mm256_set1_ps(1.f)));
  const __m256i two_n = _mm256_slli_epi32(_mm256_add_epi32(_mm256_cvtps_epi32(n), _mm256_set1_epi32(127)), 23);
  return _mm256_mul_ps(p, _mm256_castsi256_ps(two_n));
}

}  // namespace packed
