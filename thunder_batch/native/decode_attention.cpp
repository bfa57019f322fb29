// Attention of a decode step's few query rows per K/V head over that head's cache: softmax(q k^T * scale
// + mask) v, in float32, for float32 or bfloat16 tensors.
//
// q: [B, G, Q, D] (the Q = H/G query heads of a group, one position each, folded into rows), k, v:
// [B, G, L, D] with any stride over L (views of the slot cache's first L entries), mask: additive,
// [B, 1, 1, L]. Every (slot, group) pair reads its visible keys and values once, for all Q rows: the
// read of the slot's live cache entries is the whole cost (torch's kernel reads all L entries).
// Pairs are shared among torch's threads (work_sharing.h). AVX2 + FMA; with D % 8 == 0 keys are scored four
// at a time and values summed 8 columns x up to 4 rows in registers (1.4-1.8x the one-dot-at-a-time loop,
// benchmarks/RESULTS.md), other head sizes one key at a time. `decode_rows_attention` is a decode-only
// step's whole attention in one call: the step's K and V rows written into the caches, then this kernel;
// `slot_rows_attention` a verify step's, each row over its own slot's cache with its own mask row.

#include <ATen/ATen.h>
#include <ATen/Parallel.h>
#include <immintrin.h>
#include <torch/library.h>

#include <cmath>
#include <cstring>
#include <vector>

#include "ops.h"
#include "vector_avx2.h"
#include "work_sharing.h"

#define AVX2 __attribute__((target("avx2,fma")))

namespace {

constexpr int64_t kMaxQ = 16, kMaxD = 256;
constexpr float kHidden = -1e30f;  // a mask value at or below this hides its entry

using packed::load8;
using packed::widen;

AVX2 inline float dot(const float* a, const float* b, int64_t D) {
  __m256 s = _mm256_setzero_ps();
  int64_t d = 0;
  for (; d + 8 <= D; d += 8) s = _mm256_fmadd_ps(_mm256_loadu_ps(a + d), _mm256_loadu_ps(b + d), s);
  __m128 h = _mm_add_ps(_mm256_castps256_ps128(s), _mm256_extractf128_ps(s, 1));
  h = _mm_hadd_ps(h, h);
  float sum = _mm_cvtss_f32(_mm_hadd_ps(h, h));
  for (; d < D; ++d) sum += a[d] * b[d];
  return sum;
}

AVX2 void softmax(float* row, int64_t L) {  // in place
  float top = row[0];
  for (int64_t l = 1; l < L; ++l) top = std::max(top, row[l]);
  __m256 sums = _mm256_setzero_ps();
  int64_t l = 0;
  for (; l + 8 <= L; l += 8) {
    const __m256 e = packed::exp_nonpositive(_mm256_sub_ps(_mm256_loadu_ps(row + l), _mm256_set1_ps(top)));
    _mm256_storeu_ps(row + l, e);
    sums = _mm256_add_ps(sums, e);
  }
  alignas(32) float part[8];
  _mm256_store_ps(part, sums);
  float sum = part[0] + part[1] + part[2] + part[3] + part[4] + part[5] + part[6] + part[7];
  for (; l < L; ++l) sum += (row[l] = std::exp(row[l] - top));
  const float inv = 1.f / sum;
  for (l = 0; l < L; ++l) row[l] *= inv;
}

// One (slot, group): q [Q, D] rows, keys/values [L, D] rows `kv_stride` apart, mask [L] -> out [Q, D].
// Entries the mask hides (<= kHidden: litgpt's and our masks use -inf or the dtype's lowest value)
// weigh exactly 0 in the softmax whenever one entry is visible, so they are never read: a slot reads
// its live entries only. With none visible (an idle or padding row, never read) the output is 0.
// [sum(a), sum(b), sum(c), sum(d)]: four dot products' partial sums reduced together.
AVX2 inline __m128 sum4(__m256 a, __m256 b, __m256 c, __m256 d) {
  const __m256 abcd = _mm256_hadd_ps(_mm256_hadd_ps(a, b), _mm256_hadd_ps(c, d));
  return _mm_add_ps(_mm256_castps256_ps128(abcd), _mm256_extractf128_ps(abcd, 1));
}

// scores[r * n + j .. + 4] = q_r . keys j..j+3 + their mask values, for every query row r (D % 8 == 0):
// four independent sums per row, so the FMA chains overlap instead of waiting on each other.
AVX2 void scores4(const float* qf, const float (*kf)[kMaxD], const float* m, int64_t Q, int64_t D, int64_t n,
                  float* scores) {
  for (int64_t r = 0; r < Q; ++r) {
    __m256 s0 = _mm256_setzero_ps(), s1 = s0, s2 = s0, s3 = s0;
    for (int64_t d = 0; d < D; d += 8) {
      const __m256 x = _mm256_loadu_ps(qf + r * kMaxD + d);
      s0 = _mm256_fmadd_ps(x, _mm256_loadu_ps(kf[0] + d), s0);
      s1 = _mm256_fmadd_ps(x, _mm256_loadu_ps(kf[1] + d), s1);
      s2 = _mm256_fmadd_ps(x, _mm256_loadu_ps(kf[2] + d), s2);
      s3 = _mm256_fmadd_ps(x, _mm256_loadu_ps(kf[3] + d), s3);
    }
    _mm_storeu_ps(scores + r * n, _mm_add_ps(sum4(s0, s1, s2, s3), _mm_loadu_ps(m)));
  }
}

// out rows [Q, D] += p[r, j] * value j over the visible entries, 8 columns at a time held in registers
// for up to 4 query rows (D % 8 == 0).
template <typename T, int R>
AVX2 void weigh_values(const T* v, const int64_t* live, int64_t n, int64_t kv_stride, const float* p, int64_t pn,
                       int64_t D, float* acc) {
  for (int64_t d = 0; d < D; d += 8) {
    __m256 a[R];
    for (int i = 0; i < R; ++i) a[i] = _mm256_setzero_ps();
    for (int64_t j = 0; j < n; ++j) {
      const __m256 x = load8(v + live[j] * kv_stride + d);
      for (int i = 0; i < R; ++i) a[i] = _mm256_fmadd_ps(_mm256_set1_ps(p[i * pn + j]), x, a[i]);
    }
    for (int i = 0; i < R; ++i) _mm256_storeu_ps(acc + i * kMaxD + d, a[i]);
  }
}

// One (slot, group): q [Q, D] rows, keys/values [L, D] rows `kv_stride` apart, mask [L] -> out [Q, D].
// Entries the mask hides (<= kHidden: litgpt's and our masks use -inf or the dtype's lowest value)
// weigh exactly 0 in the softmax whenever one entry is visible, so they are never read: a slot reads
// its live entries only. With none visible (an idle or padding row, never read) the output is 0.
template <typename T>
AVX2 void attend(const T* q, const T* k, const T* v, const T* mask, int64_t Q, int64_t L, int64_t D,
                 int64_t kv_stride, float scale, float* scores, int64_t* live, T* out) {
  alignas(32) float qf[kMaxQ][kMaxD], acc[kMaxQ][kMaxD], kf[4][kMaxD], mf[4];
  for (int64_t r = 0; r < Q; ++r)
    for (int64_t d = 0; d < D; ++d) qf[r][d] = widen(q[r * D + d]) * scale, acc[r][d] = 0.f;
  int64_t n = 0;  // visible entries: live[0..n)
  for (int64_t l = 0; l < L; ++l)
    if (widen(mask[l]) > kHidden) live[n++] = l;
  const bool vector = D % 8 == 0;
  int64_t j = 0;
  for (; vector && j + 4 <= n; j += 4) {  // scores [Q, n], four keys at a time, each read once
    for (int i = 0; i < 4; ++i) {
      for (int64_t d = 0; d < D; d += 8) _mm256_store_ps(kf[i] + d, load8(k + live[j + i] * kv_stride + d));
      mf[i] = widen(mask[live[j + i]]);
      // The value pass reads each row 8 columns at a time: fetched now, in row order, it finds them cached.
      const char* row = reinterpret_cast<const char*>(v + live[j + i] * kv_stride);
      for (int64_t b = 0; b < D * int64_t(sizeof(T)); b += 64) _mm_prefetch(row + b, _MM_HINT_T1);
    }
    scores4(qf[0], kf, mf, Q, D, n, scores + j);
  }
  for (; j < n; ++j) {  // the rest one key at a time
    for (int64_t d = 0; d < D; ++d) kf[0][d] = widen(k[live[j] * kv_stride + d]);
    const float m = widen(mask[live[j]]);
    for (int64_t r = 0; r < Q; ++r) scores[r * n + j] = dot(qf[r], kf[0], D) + m;
  }
  for (int64_t r = 0; r < Q && n > 0; ++r) softmax(scores + r * n, n);
  if (vector) {
    int64_t r = 0;
    for (; r + 4 <= Q; r += 4) weigh_values<T, 4>(v, live, n, kv_stride, scores + r * n, n, D, acc[r]);
    if (Q - r == 3) weigh_values<T, 3>(v, live, n, kv_stride, scores + r * n, n, D, acc[r]);
    if (Q - r == 2) weigh_values<T, 2>(v, live, n, kv_stride, scores + r * n, n, D, acc[r]);
    if (Q - r == 1) weigh_values<T, 1>(v, live, n, kv_stride, scores + r * n, n, D, acc[r]);
  } else {
    for (int64_t jj = 0; jj < n; ++jj) {  // out [Q, D]: each value row read once
      for (int64_t d = 0; d < D; ++d) kf[0][d] = widen(v[live[jj] * kv_stride + d]);
      for (int64_t r = 0; r < Q; ++r) {
        const float p = scores[r * n + jj];
        for (int64_t d = 0; d < D; ++d) acc[r][d] += p * kf[0][d];
      }
    }
  }
  for (int64_t r = 0; r < Q; ++r)
    for (int64_t d = 0; d < D; ++d) out[r * D + d] = T(acc[r][d]);
}

// Where a call's tensors are: q, out [B, G, Q, D] contiguous; k, v alike with strides (slot, group, entry);
// the mask's rows `mask_stride` apart; the first L entries read.
struct Shape {
  int64_t B, G, Q, D, L, kv_slot, kv_group, kv_entry, mask_stride;
};

// slot_of: the cache slot query row-set b reads (null: slot b).
template <typename T>
void run(const T* qp, const T* kp, const T* vp, const T* mp, const Shape& s, double scale, T* op,
         const int64_t* slot_of) {
  packed::share_blocks(s.B * s.G, 1, [&](int64_t p0, int64_t p1) {
    thread_local std::vector<float> scores;  // a thread's scratch, kept across its chunks (one pair each)
    thread_local std::vector<int64_t> live;
    scores.resize(s.Q * s.L);
    live.resize(s.L);
    for (int64_t p = p0; p < p1; ++p) {
      const int64_t b = p / s.G, g = p % s.G, at = (slot_of ? slot_of[b] : b) * s.kv_slot + g * s.kv_group;
      attend<T>(qp + p * s.Q * s.D, kp + at, vp + at, mp + b * s.mask_stride, s.Q, s.L, s.D, s.kv_entry, float(scale),
                scores.data(), live.data(), op + p * s.Q * s.D);
    }
  });
}

// The kernel for q's dtype (float32 or bfloat16; the callers checked that every tensor has it).
void run_typed(const at::Tensor& q, const at::Tensor& k, const at::Tensor& v, const at::Tensor& mask, const Shape& s,
               double scale, at::Tensor& out, const int64_t* slot_of = nullptr) {
  if (q.scalar_type() == at::kFloat)
    run<float>(q.data_ptr<float>(), k.data_ptr<float>(), v.data_ptr<float>(), mask.data_ptr<float>(), s, scale,
               out.data_ptr<float>(), slot_of);
  else if (q.scalar_type() == at::kBFloat16)
    run<at::BFloat16>(q.data_ptr<at::BFloat16>(), k.data_ptr<at::BFloat16>(), v.data_ptr<at::BFloat16>(),
                      mask.data_ptr<at::BFloat16>(), s, scale, out.data_ptr<at::BFloat16>(), slot_of);
  else
    TORCH_CHECK(false, "decode_attention: float32 or bfloat16");
}

at::Tensor decode_attention(const at::Tensor& q, const at::Tensor& k, const at::Tensor& v, const at::Tensor& mask,
                            double scale) {
  TORCH_CHECK(q.dim() == 4 && k.dim() == 4 && v.dim() == 4 && mask.dim() == 4, "decode_attention: 4-D tensors");
  const int64_t B = q.size(0), G = q.size(1), Q = q.size(2), D = q.size(3), L = k.size(2);
  TORCH_CHECK(q.is_contiguous() && Q <= kMaxQ && D <= kMaxD, "decode_attention: contiguous q, Q <= 16, D <= 256");
  TORCH_CHECK(k.sizes() == v.sizes() && k.strides() == v.strides() && k.size(0) == B && k.size(1) == G &&
                  k.size(3) == D && k.stride(3) == 1,
              "decode_attention: k and v [B, G, L, D] alike, rows contiguous");
  TORCH_CHECK(mask.size(0) == B && mask.size(1) == 1 && mask.size(2) == 1 && mask.size(3) == L && mask.stride(3) == 1,
              "decode_attention: mask [B, 1, 1, L]");
  TORCH_CHECK(q.scalar_type() == k.scalar_type() && k.scalar_type() == mask.scalar_type(), "decode_attention: one dtype");
  at::Tensor out = at::empty_like(q);
  run_typed(q, k, v, mask, {B, G, Q, D, L, k.stride(0), k.stride(1), k.stride(2), mask.stride(0)}, scale, out);
  return out;
}

// cache viewed as [B * G * S', D] takes row n of `val` [N, G, D] (any strides, rows of D contiguous) at `rows[n]`.
void write_rows(at::Tensor& cache, const at::Tensor& rows, const at::Tensor& val) {
  const int64_t N = val.size(0), G = val.size(1), D = val.size(2), entries = cache.numel() / D;
  const auto bytes = D * cache.element_size();
  const int64_t* rp = rows.data_ptr<int64_t>();
  auto* dst = static_cast<char*>(cache.data_ptr());
  const auto* src = static_cast<const char*>(val.data_ptr());
  for (int64_t n = 0; n < N; ++n)
    for (int64_t g = 0; g < G; ++g) {
      const int64_t row = rp[n * G + g];
      TORCH_CHECK(row >= 0 && row < entries, "rows attention: cache row ", row, " out of range");
      std::memcpy(dst + row * bytes, src + (n * val.stride(0) + g * val.stride(1)) * cache.element_size(), bytes);
    }
}

// Each of N rows writes its k, v into the caches at `rows` (flat_rows of [B, G, S', D]), then attends over
// the first L entries of slot slot_of[n] (null: slot n) with its own mask row. q: [N, H, D]; k, v: [N, G, D];
// cache_k, cache_v: [B, G, S', D] contiguous; rows: [N * G]; mask [N, 1, 1, L] -> [N, H * D].
at::Tensor attend_rows(const at::Tensor& q, const at::Tensor& k, const at::Tensor& v, at::Tensor& cache_k,
                       at::Tensor& cache_v, const at::Tensor& rows, const int64_t* slot_of, const at::Tensor& mask,
                       double scale) {
  TORCH_CHECK(q.dim() == 3 && k.dim() == 3 && cache_k.dim() == 4, "rows attention: q, k, v 3-D, caches 4-D");
  const int64_t N = q.size(0), H = q.size(1), D = q.size(2), G = cache_k.size(1), L = mask.size(-1);
  TORCH_CHECK(cache_k.sizes() == cache_v.sizes() && cache_k.is_contiguous() && cache_v.is_contiguous() &&
                  cache_k.size(3) == D && L <= cache_k.size(2),
              "rows attention: contiguous caches [B, G, S', D] alike, L <= S'");
  TORCH_CHECK(k.sizes() == v.sizes() && k.size(0) == N && k.size(1) == G && k.size(2) == D && k.stride(2) == 1 &&
                  v.stride(2) == 1 && H % G == 0,
              "rows attention: k, v [N, G, D] with contiguous rows");
  TORCH_CHECK(rows.scalar_type() == at::kLong && rows.is_contiguous() && rows.numel() == N * G,
              "rows attention: rows int64 [N * G]");
  TORCH_CHECK(q.is_contiguous() && mask.size(0) == N && mask.numel() == N * L && mask.stride(3) == 1 && D <= kMaxD &&
                  H / G <= kMaxQ,
              "rows attention: contiguous q, mask [N, 1, 1, L], H / G <= 16, D <= 256");
  TORCH_CHECK(k.scalar_type() == q.scalar_type() && v.scalar_type() == q.scalar_type() &&
                  cache_k.scalar_type() == q.scalar_type() && cache_v.scalar_type() == q.scalar_type() &&
                  mask.scalar_type() == q.scalar_type(),
              "rows attention: one dtype");
  write_rows(cache_k, rows, k);
  write_rows(cache_v, rows, v);
  at::Tensor out = at::empty({N, H * D}, q.options());  // [N, G, H/G, D] as the kernel writes it
  const int64_t S = cache_k.size(2);
  run_typed(q, cache_k, cache_v, mask, {N, G, H / G, D, L, G * S * D, S * D, D, mask.stride(0)}, scale, out, slot_of);
  return out;
}

}  // namespace

// A decode-only step's attention in one call: row b is slot b's.
at::Tensor packed::decode_rows_attention(const at::Tensor& q, const at::Tensor& k, const at::Tensor& v,
                                         at::Tensor cache_k, at::Tensor cache_v, const at::Tensor& rows,
                                         const at::Tensor& mask, double scale) {
  TORCH_CHECK(cache_k.dim() == 4 && q.size(0) == cache_k.size(0), "decode_rows_attention: one row per slot");
  return attend_rows(q, k, v, cache_k, cache_v, rows, nullptr, mask, scale);
}

namespace {

// A verify step's attention in one call (speculative decoding): row n reads slot row_slot[n]'s cache.
at::Tensor slot_rows_attention(const at::Tensor& q, const at::Tensor& k, const at::Tensor& v, at::Tensor cache_k,
                               at::Tensor cache_v, const at::Tensor& rows, const at::Tensor& row_slot,
                               const at::Tensor& mask, double scale) {
  TORCH_CHECK(row_slot.scalar_type() == at::kLong && row_slot.is_contiguous() && row_slot.numel() == q.size(0),
              "slot_rows_attention: row_slot int64 [N]");
  const int64_t* slot = row_slot.data_ptr<int64_t>();
  for (int64_t n = 0; n < row_slot.numel(); ++n)
    TORCH_CHECK(slot[n] >= 0 && slot[n] < cache_k.size(0), "slot_rows_attention: slot ", slot[n], " out of range");
  return attend_rows(q, k, v, cache_k, cache_v, rows, slot, mask, scale);
}

}  // namespace

TORCH_LIBRARY_FRAGMENT(thunder_batch, m) {
  m.def("decode_attention(Tensor q, Tensor k, Tensor v, Tensor mask, float scale) -> Tensor");
  m.def(
      "decode_rows_attention(Tensor q, Tensor k, Tensor v, Tensor(a!) cache_k, Tensor(b!) cache_v, Tensor rows, "
      "Tensor mask, float scale) -> Tensor");
  m.def(
      "slot_rows_attention(Tensor q, Tensor k, Tensor v, Tensor(a!) cache_k, Tensor(b!) cache_v, Tensor rows, "
      "Tensor row_slot, Tensor mask, float scale) -> Tensor");
}

TORCH_LIBRARY_IMPL(thunder_batch, CPU, m) {
  m.impl("decode_attention", decode_attention);
  m.impl("decode_rows_attention", packed::decode_rows_attention);
  m.impl("slot_rows_attention", slot_rows_attention);
}
