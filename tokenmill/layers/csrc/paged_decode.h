// The pieces of paged decode attention (layouts in paged_decode.cpp's header comment) for one
// (sequence, kv head) item: its scores, their softmax, its values. The ops in paged_decode.cpp and
// the fused decode step (decode_step.cpp) both run these.
#pragma once
#include <ATen/core/Tensor.h>
#include <c10/util/BFloat16.h>
#include <c10/util/Half.h>
#include <immintrin.h>

#include <algorithm>
#include <cstdint>
#include <limits>
#include <type_traits>

#include "vec_math.h"

namespace tokenmill_attention {

constexpr int64_t kMaxGroups = 8;    // query heads per kv head
constexpr int64_t kMaxHeadDim = 256;
constexpr int64_t kAhead = 2;        // blocks prefetched ahead (into L2): the cache is read from DRAM

using tokenmill_vec::load;  // n <= 16 elements as float32, zero past n

inline void prefetch_rows(const void* rows, int64_t bytes) {
  const char* p = static_cast<const char*>(rows);
  for (int64_t offset = 0; offset < bytes; offset += 64) _mm_prefetch(p + offset, _MM_HINT_T1);
}

struct Geometry {
  int64_t batch, num_heads, head_dim, num_kv_heads, num_blocks, block_size, groups, max_blocks, context;
};

inline Geometry geometry_of(const at::Tensor& cache, const at::Tensor& block_tables, int64_t batch, int64_t num_heads,
                     int64_t context) {
  TORCH_CHECK(cache.dim() == 4 && cache.is_contiguous(), "cache must be contiguous [kv_heads, blocks, block_size, head_dim]");
  TORCH_CHECK(block_tables.scalar_type() == at::kLong && block_tables.is_contiguous(), "block_tables must be contiguous int64");
  Geometry g{batch, num_heads, cache.size(3), cache.size(0), cache.size(1), cache.size(2), num_heads / cache.size(0),
             block_tables.size(1), context};
  TORCH_CHECK(num_heads % g.num_kv_heads == 0 && g.groups <= kMaxGroups, "unsupported number of query heads per kv head");
  TORCH_CHECK(g.head_dim % 16 == 0 && g.head_dim <= kMaxHeadDim, "head_dim must be a multiple of 16, at most 256");
  TORCH_CHECK(block_tables.size(0) == batch, "one block table row per sequence");
  TORCH_CHECK(context <= g.max_blocks * g.block_size, "context longer than the block tables");  // block ids: the caller's
  return g;
}

constexpr int64_t kRows = 16;  // tokens handled together (one vector of scores)

// (sequence, kv head) items per parallel task: a task of fewer than ~2k cached tokens does not pay
// for waking another thread (one stream at 200 tokens: 17 us on one thread, 24 us on two).
constexpr int64_t kTokensPerTask = 2048;
inline int64_t items_per_task(const Geometry& g) { return std::max<int64_t>(1, kTokensPerTask / std::max<int64_t>(1, g.context)); }

// A block's rows (up to 16; missing rows repeat the last) converted to fp32, [16][head_dim].
template <typename T>
void rows_to_float(const T* rows, int64_t n, int64_t head_dim, float* dst) {
  for (int64_t r = 0; r < kRows; ++r) {
    const T* row = rows + std::min(r, n - 1) * head_dim;
    for (int64_t c = 0; c < head_dim; c += 16) _mm512_store_ps(dst + r * head_dim + c, load(row + c, 16));
  }
}

// Scores of n <= 16 consecutive tokens of one key block for every query head of the group.
// `column` points at dimension pair 0 of the first token: pair d of token r is at column + (d * block_size + r) * 2.
template <typename T>
__attribute__((always_inline)) inline void scores16(const T* column, int64_t n, int64_t block_size, const T* q,
                                                    int64_t groups, int64_t head_dim, __m512* acc /* [groups] */) {
  const __mmask16 valid = static_cast<__mmask16>((1u << n) - 1);
#pragma GCC unroll 8
  for (int64_t h = 0; h < kMaxGroups; ++h)
    if (h < groups) acc[h] = _mm512_setzero_ps();
  if constexpr (std::is_same_v<T, c10::BFloat16>) {
    const uint32_t* q_pairs = reinterpret_cast<const uint32_t*>(q);  // (q[2d], q[2d+1]) per 32-bit word
    __m512 odd[kMaxGroups];  // odd pairs in a second chain: each multiply-add waits on its own
#pragma GCC unroll 8
    for (int64_t h = 0; h < kMaxGroups; ++h)
      if (h < groups) odd[h] = _mm512_setzero_ps();
    for (int64_t d = 0; d < head_dim / 2; d += 2) {  // head_dim / 2 is even: head_dim is a multiple of 16
      const __m512i k0 = _mm512_maskz_loadu_epi32(valid, column + d * block_size * 2);
      const __m512i k1 = _mm512_maskz_loadu_epi32(valid, column + (d + 1) * block_size * 2);
#pragma GCC unroll 8
      for (int64_t h = 0; h < kMaxGroups; ++h) {
        if (h < groups) {
          const uint32_t* qh = q_pairs + h * head_dim / 2 + d;
          acc[h] = tokenmill_vec::dot_bf16_pairs(acc[h], k0, _mm512_set1_epi32(static_cast<int>(qh[0])));
          odd[h] = tokenmill_vec::dot_bf16_pairs(odd[h], k1, _mm512_set1_epi32(static_cast<int>(qh[1])));
        }
      }
    }
#pragma GCC unroll 8
    for (int64_t h = 0; h < kMaxGroups; ++h)
      if (h < groups) acc[h] = _mm512_add_ps(acc[h], odd[h]);
    return;
  }
  // Other dtypes, in fp32: split each pair into even and odd dimensions
  const __m512i even_index = _mm512_setr_epi32(0, 2, 4, 6, 8, 10, 12, 14, 16, 18, 20, 22, 24, 26, 28, 30);
  const __m512i odd_index = _mm512_add_epi32(even_index, _mm512_set1_epi32(1));
  const int64_t first = std::min<int64_t>(2 * n, 16), second = std::max<int64_t>(2 * n - 16, 0);  // values
  for (int64_t d = 0; d < head_dim / 2; ++d) {
    const T* p = column + d * block_size * 2;
    const __m512 lo = load(p, first), hi = load(p + 16, second);
    const __m512 even = _mm512_permutex2var_ps(lo, even_index, hi), odd = _mm512_permutex2var_ps(lo, odd_index, hi);
#pragma GCC unroll 8
    for (int64_t h = 0; h < kMaxGroups; ++h) {
      if (h < groups) {
        acc[h] = _mm512_fmadd_ps(_mm512_set1_ps(static_cast<float>(q[h * head_dim + 2 * d])), even, acc[h]);
        acc[h] = _mm512_fmadd_ps(_mm512_set1_ps(static_cast<float>(q[h * head_dim + 2 * d + 1])), odd, acc[h]);
      }
    }
  }
}

// The first `len` cached tokens of one sequence in one kv head's cache, in runs of at most 16
// rows of one block: visit(block, r0, t0, n) sees tokens t0..t0+n-1, rows r0..r0+n-1 of `block`.
// Blocks kAhead ahead are prefetched.
template <typename T, typename Visit>
inline void for_each_run(const Geometry& g, const T* cache, const int64_t* blocks, int64_t len, Visit&& visit) {
  const int64_t block_elems = g.block_size * g.head_dim;
  for (int64_t start = 0, j = 0; start < len; start += g.block_size, ++j) {
    if (start + kAhead * g.block_size < len)
      prefetch_rows(cache + blocks[j + kAhead] * block_elems, block_elems * sizeof(T));
    for (int64_t r0 = 0; r0 < std::min(g.block_size, len - start); r0 += kRows)
      visit(cache + blocks[j] * block_elems, r0, start + r0, std::min({kRows, g.block_size - r0, len - start - r0}));
  }
}

// Scores of one (sequence, kv head) item for its group's query heads: out0[h * stride + t] =
// scale * q[head0 + h] . K[t] for t < len, -inf from len to context.
template <typename T>
void qk_item(const Geometry& g, const T* q_ptr, const T* k_ptr, const int64_t* table, int64_t b, int64_t kv,
             int64_t len, float scale, float* out0, int64_t stride) {
  const int64_t block_elems = g.block_size * g.head_dim;
  const int64_t head0 = b * g.num_heads + kv * g.groups;
  const T* cache = k_ptr + kv * g.num_blocks * block_elems;
  const __m512 scale_v = _mm512_set1_ps(scale);
  for_each_run(g, cache, table + b * g.max_blocks, len, [&](const T* block, int64_t r0, int64_t t0, int64_t n) {
    __m512 acc[kMaxGroups];
    scores16(block + r0 * 2, n, g.block_size, q_ptr + head0 * g.head_dim, g.groups, g.head_dim, acc);
    const __mmask16 keep = static_cast<__mmask16>((1u << n) - 1);
#pragma GCC unroll 8
    for (int64_t h = 0; h < kMaxGroups; ++h)
      if (h < g.groups) _mm512_mask_storeu_ps(out0 + h * stride + t0, keep, _mm512_mul_ps(acc[h], scale_v));
  });
  for (int64_t h = 0; h < g.groups; ++h)
    std::fill(out0 + h * stride + len, out0 + h * stride + g.context, -std::numeric_limits<float>::infinity());
}

template <typename T>
inline void store_row(T* dst, const float* src, int64_t n) {
  for (int64_t d = 0; d < n; ++d) dst[d] = static_cast<T>(src[d]);
}

// probs[r] * V[r] for up to 16 rows of any dtype, in fp32, added into acc ([groups][head_dim]).
template <typename T>
inline void pv_rows_float(const T* rows, int64_t n, const float* probs, int64_t probs_stride, int64_t groups,
                          int64_t head_dim, float* acc, float* rows_float /* [16][head_dim] scratch */) {
  rows_to_float(rows, n, head_dim, rows_float);
  for (int64_t h = 0; h < groups; ++h) {
    __m512 weight[kRows];  // probabilities of these rows; 0 for the repeated padding rows
    for (int64_t r = 0; r < kRows; ++r) weight[r] = _mm512_set1_ps(r < n ? probs[h * probs_stride + r] : 0.f);
    for (int64_t c = 0; c < head_dim; c += 16) {
      __m512 even = _mm512_load_ps(acc + h * head_dim + c), odd = _mm512_setzero_ps();
#pragma GCC unroll 8
      for (int64_t r = 0; r < kRows; r += 2) {  // two chains, half the FMA latency
        even = _mm512_fmadd_ps(weight[r], _mm512_load_ps(rows_float + r * head_dim + c), even);
        odd = _mm512_fmadd_ps(weight[r + 1], _mm512_load_ps(rows_float + (r + 1) * head_dim + c), odd);
      }
      _mm512_store_ps(acc + h * head_dim + c, _mm512_add_ps(even, odd));
    }
  }
}

// probs[r] * V[r] for up to 16 bf16 rows, added into acc with the bf16 pair dot product: rows
// 2i and 2i+1 are interleaved (unpacklo/hi_epi16) so that each 32-bit lane holds one dimension
// of both rows, and multiplied by the probability pair (p[2i], p[2i+1]). The interleave permutes
// dimensions: within chunk c (32 values), 128-bit lane L, element e, `acc[..][0]` holds dimension
// c + 8L + e and `acc[..][1]` dimension c + 8L + 4 + e (see unpermute_pairs).
inline void pv_rows_bf16(const c10::BFloat16* rows, int64_t n, const float* probs, int64_t probs_stride,
                         int64_t groups, int64_t head_dim, __m512* acc /* [groups][chunks][2] */) {
  alignas(32) uint32_t pairs[kMaxGroups][kRows / 2];  // bf16 (p[2i], p[2i+1]) per 32-bit word
  const __mmask16 valid = static_cast<__mmask16>((1u << n) - 1);
  for (int64_t h = 0; h < groups; ++h)
    _mm256_store_si256(reinterpret_cast<__m256i*>(pairs[h]),
                       tokenmill_vec::to_bf16(_mm512_maskz_loadu_ps(valid, probs + h * probs_stride)));
  const int64_t chunks = (head_dim + 31) / 32;
  for (int64_t c = 0; c < chunks; ++c) {
    const __mmask32 lanes = head_dim - c * 32 >= 32 ? ~__mmask32(0) : __mmask32(0xFFFF);
    __m512 lo[kMaxGroups], hi[kMaxGroups];
#pragma GCC unroll 8
    for (int64_t h = 0; h < kMaxGroups; ++h)
      if (h < groups) lo[h] = acc[(h * chunks + c) * 2], hi[h] = acc[(h * chunks + c) * 2 + 1];
    for (int64_t i = 0; 2 * i < n; ++i) {
      const __m512i a = _mm512_maskz_loadu_epi16(lanes, rows + 2 * i * head_dim + c * 32);
      const __m512i b = _mm512_maskz_loadu_epi16(lanes, rows + std::min(2 * i + 1, n - 1) * head_dim + c * 32);
      const __m512i ab_lo = _mm512_unpacklo_epi16(a, b), ab_hi = _mm512_unpackhi_epi16(a, b);
#pragma GCC unroll 8
      for (int64_t h = 0; h < kMaxGroups; ++h) {
        if (h < groups) {
          const __m512i w = _mm512_set1_epi32(static_cast<int>(pairs[h][i]));
          lo[h] = tokenmill_vec::dot_bf16_pairs(lo[h], ab_lo, w);
          hi[h] = tokenmill_vec::dot_bf16_pairs(hi[h], ab_hi, w);
        }
      }
    }
#pragma GCC unroll 8
    for (int64_t h = 0; h < kMaxGroups; ++h)
      if (h < groups) acc[(h * chunks + c) * 2] = lo[h], acc[(h * chunks + c) * 2 + 1] = hi[h];
  }
}

// acc of one query head ([chunks][2] vectors, dimensions permuted as above) -> plain order
inline void unpermute_pairs(const __m512* acc, int64_t head_dim, float* dst) {
  for (int64_t c = 0; c * 32 < head_dim; ++c) {
    alignas(64) float halves[2][16];
    _mm512_store_ps(halves[0], acc[c * 2]);
    _mm512_store_ps(halves[1], acc[c * 2 + 1]);
    for (int64_t d = 0; d < std::min<int64_t>(32, head_dim - c * 32); ++d)
      dst[c * 32 + d] = halves[(d % 8) / 4][(d / 8) * 4 + d % 4];
  }
}

// out[head0 + h] = sum_t p0[h * stride + t] V[t] over the first len tokens of one (sequence, kv head) item.
template <typename T>
void pv_item(const Geometry& g, const float* p0, int64_t stride, const T* v_ptr, const int64_t* table, int64_t b,
             int64_t kv, int64_t len, T* o_ptr) {
  const int64_t block_elems = g.block_size * g.head_dim;
  const int64_t head0 = b * g.num_heads + kv * g.groups;
  constexpr bool direct = std::is_same_v<T, c10::BFloat16>;
  alignas(64) float acc[kMaxGroups * (kMaxHeadDim + 32)];  // direct: [groups][chunks][2] vectors
  alignas(64) float rows_float[kRows * kMaxHeadDim];
  alignas(64) float plain[kMaxHeadDim];
  std::fill(acc, acc + g.groups * (g.head_dim + 32), 0.f);
  const T* cache = v_ptr + kv * g.num_blocks * block_elems;
  for_each_run(g, cache, table + b * g.max_blocks, len, [&](const T* block, int64_t r0, int64_t t0, int64_t n) {
    if constexpr (direct) {
      pv_rows_bf16(block + r0 * g.head_dim, n, p0 + t0, stride, g.groups, g.head_dim, reinterpret_cast<__m512*>(acc));
      return;
    }
    pv_rows_float(block + r0 * g.head_dim, n, p0 + t0, stride, g.groups, g.head_dim, acc, rows_float);
  });
  for (int64_t h = 0; h < g.groups; ++h) {
    const float* sums = acc + h * g.head_dim;
    if constexpr (direct) {
      const int64_t chunks = (g.head_dim + 31) / 32;
      unpermute_pairs(reinterpret_cast<const __m512*>(acc) + h * chunks * 2, g.head_dim, plain);
      sums = plain;
    }
    store_row(o_ptr + (head0 + h) * g.head_dim, sums, g.head_dim);
  }
}

// Softmax in place over a row's first len scores; the rest, up to context, become 0.
inline void softmax_row(float* s, int64_t len, int64_t context) {
  __m512 top = _mm512_set1_ps(-std::numeric_limits<float>::infinity());
  for (int64_t t = 0; t < len; t += 16)
    top = _mm512_mask_max_ps(top, tokenmill_vec::first(len - t), top, _mm512_loadu_ps(s + t));
  const __m512 max = _mm512_set1_ps(_mm512_reduce_max_ps(top));
  __m512 total = _mm512_setzero_ps();
  for (int64_t t = 0; t < len; t += 16) {
    const int64_t n = std::min<int64_t>(16, len - t);
    const __m512 e = tokenmill_vec::exp(_mm512_sub_ps(tokenmill_vec::load(s + t, n), max));
    total = _mm512_add_ps(total, _mm512_maskz_mov_ps(tokenmill_vec::first(n), e));
    tokenmill_vec::store(s + t, e, n);
  }
  const __m512 inverse = _mm512_set1_ps(1.0f / _mm512_reduce_add_ps(total));
  for (int64_t t = 0; t < len; t += 16) {
    const int64_t n = std::min<int64_t>(16, len - t);
    tokenmill_vec::store(s + t, _mm512_mul_ps(tokenmill_vec::load(s + t, n), inverse), n);
  }
  std::fill(s + len, s + context, 0.0f);
}

}  // namespace tokenmill_attention
