// Decode attention of one (sequence, kv head) over the PyTorch path's cache layout (rows
// [kv_heads, blocks, block_size, D], read through a block table), on AVX2: what
// decode_attention_rows.cpp's ops and the fused decode step (decode_step_avx2.cpp) both run, so
// that they compute the same values bit for bit. Arithmetic is float32 (a softmax with the max
// subtracted, vec_math.h's exp); each key and value row is read once for the kv head's group of
// query heads (GQA).
#pragma once
#include <c10/util/BFloat16.h>
#include <c10/util/Half.h>
#include <immintrin.h>

#include <algorithm>
#include <cstdint>
#include <type_traits>
#include <vector>

#include "vec_math.h"

namespace tokenmill_rows {

constexpr int64_t kMaxGroups = 8;  // query heads per kv head

// 8 consecutive values as float32.
template <typename C>
inline __m256 load8(const C* p) {
  if constexpr (std::is_same_v<C, float>) {
    return _mm256_loadu_ps(p);
  } else if constexpr (std::is_same_v<C, c10::Half>) {
    return _mm256_cvtph_ps(_mm_loadu_si128(reinterpret_cast<const __m128i*>(p)));
  } else {  // bfloat16: the high half of a float32
    return _mm256_castsi256_ps(
        _mm256_slli_epi32(_mm256_cvtepu16_epi32(_mm_loadu_si128(reinterpret_cast<const __m128i*>(p))), 16));
  }
}

// The first n < 8 of them, zero past n (a row's tail where D is not a multiple of 8).
template <typename C>
inline __m256 load_tail(const C* p, int64_t n) {
  alignas(32) float buf[8] = {};
  for (int64_t i = 0; i < n; ++i) buf[i] = static_cast<float>(p[i]);
  return _mm256_load_ps(buf);
}

// Lane i of the result: the sum of the lanes of a[i].
inline __m256 sum_each(const __m256 a[8]) {
  const __m256 pairs = _mm256_hadd_ps(_mm256_hadd_ps(a[0], a[1]), _mm256_hadd_ps(a[2], a[3]));
  const __m256 more = _mm256_hadd_ps(_mm256_hadd_ps(a[4], a[5]), _mm256_hadd_ps(a[6], a[7]));
  // pairs: [0..3 low halves, 0..3 high halves], more: the same for 4..7
  return _mm256_add_ps(_mm256_permute2f128_ps(pairs, more, 0x20), _mm256_permute2f128_ps(pairs, more, 0x31));
}

// Calls visit(first row, t0, n) for each run of n <= 8 consecutive rows [t0, t0 + n) among a
// sequence's first L rows in one kv head's cache, walking the sequence's block table.
template <typename C, typename Visit>
inline void for_each_run(const C* head_cache, const int64_t* table, int64_t L, int64_t block_size, int64_t D,
                         Visit&& visit) {
  for (int64_t start = 0, i = 0; start < L; start += block_size, ++i) {
    const C* rows = head_cache + table[i] * block_size * D;
    const int64_t end = std::min(L, start + block_size);
    for (int64_t t = start; t < end; t += 8) visit(rows + (t - start) * D, t, std::min<int64_t>(8, end - t));
  }
}

// One (sequence, kv head): scores[g, t] = q_g . k_t (q pre-scaled) for its GROUPS query heads,
// 8 rows at a time, each row's key read once for all of them.
template <int GROUPS, typename C>
void score_rows(const float* queries, const C* head_cache, const int64_t* table, int64_t L, int64_t block_size,
                int64_t D, float* scores) {
  const int64_t full = D / 8, vectors = (D + 7) / 8;
  for_each_run(head_cache, table, L, block_size, D, [&](const C* keys, int64_t t0, int64_t n) {
    __m256 partial[GROUPS][8];
    for (int64_t r = 0; r < 8; ++r) {
      __m256 dots[GROUPS];
      for (int g = 0; g < GROUPS; ++g) dots[g] = _mm256_setzero_ps();
      if (r < n) {
        for (int64_t v = 0; v < vectors; ++v) {
          const __m256 key = v < full ? load8(keys + r * D + 8 * v) : load_tail(keys + r * D + 8 * v, D - 8 * v);
          for (int g = 0; g < GROUPS; ++g) {
            dots[g] = _mm256_fmadd_ps(_mm256_loadu_ps(queries + (g * vectors + v) * 8), key, dots[g]);
          }
        }
      }
      for (int g = 0; g < GROUPS; ++g) partial[g][r] = dots[g];
    }
    for (int g = 0; g < GROUPS; ++g) {
      alignas(32) float sums[8];
      _mm256_store_ps(sums, sum_each(partial[g]));
      std::copy(sums, sums + n, scores + g * L + t0);
    }
  });
}

template <typename C>
using ScoreFn = void (*)(const float*, const C*, const int64_t*, int64_t, int64_t, int64_t, float*);
template <typename C>
constexpr ScoreFn<C> kScoreRows[kMaxGroups] = {score_rows<1, C>, score_rows<2, C>, score_rows<3, C>, score_rows<4, C>,
                                                score_rows<5, C>, score_rows<6, C>, score_rows<7, C>, score_rows<8, C>};

// out[8 (v0 + j) ...] = sum over rows t of p_t v_t[8 (v0 + j) ...], for NV vectors of D from
// vector v0; TAIL: the one vector is D's last, partial one.
template <int NV, bool TAIL, typename C>
void weigh_values(const float* p, const C* head_cache, const int64_t* table, int64_t L, int64_t block_size,
                  int64_t D, int64_t v0, float* out) {
  for (int j = 0; j < NV; ++j) _mm256_storeu_ps(out + 8 * (v0 + j), _mm256_setzero_ps());
  for_each_run(head_cache, table, L, block_size, D, [&](const C* values, int64_t t0, int64_t n) {
    __m256 acc[NV];  // in registers for the run (a lambda's captures live in memory)
#pragma GCC unroll 8
    for (int j = 0; j < NV; ++j) acc[j] = _mm256_loadu_ps(out + 8 * (v0 + j));
    for (int64_t r = 0; r < n; ++r) {
      const __m256 weight = _mm256_set1_ps(p[t0 + r]);
      const C* row = values + r * D + 8 * v0;
#pragma GCC unroll 8
      for (int j = 0; j < NV; ++j) {
        acc[j] = _mm256_fmadd_ps(weight, TAIL ? load_tail(row, D - 8 * v0) : load8(row + 8 * j), acc[j]);
      }
    }
#pragma GCC unroll 8
    for (int j = 0; j < NV; ++j) _mm256_storeu_ps(out + 8 * (v0 + j), acc[j]);
  });
}

// One (sequence, kv head): its group's query-head count, head_dim, the sequence's length L and
// block table, and the softmax scale. attend_item reads the group's query rows [groups, D] and
// writes its output rows [groups, D].
struct AttentionItem {
  int64_t groups, D, L, block_size;
  const int64_t* table;
  float scale;
};

// Scratch space one thread reuses across items.
struct AttentionScratch {
  std::vector<float> queries, acc, scores;
};

template <typename T, typename C>  // T: queries and output, C: the caches
void attend_item(const AttentionItem& item, const T* q_heads, const C* head_keys, const C* head_values, T* out,
                 AttentionScratch& scratch) {
  using namespace tokenmill_vec;
  const int64_t groups = item.groups, D = item.D, L = item.L, block_size = item.block_size;
  const int64_t vectors = (D + 7) / 8, padded = vectors * 8;
  scratch.queries.assign(groups * padded, 0.0f);
  scratch.acc.resize(padded);
  scratch.scores.resize(groups * L);
  float* queries = scratch.queries.data();
  for (int64_t g = 0; g < groups; ++g) {
    for (int64_t d = 0; d < D; ++d) queries[g * padded + d] = static_cast<float>(q_heads[g * D + d]) * item.scale;
  }
  kScoreRows<C>[groups - 1](queries, head_keys, item.table, L, block_size, D, scratch.scores.data());
  for (int64_t g = 0; g < groups; ++g) {  // softmax over t, 16 lanes at a time
    float* s = scratch.scores.data() + g * L;
    const Vec16 top = set1(*std::max_element(s, s + L));
    Vec16 total = zero();
    for (int64_t t = 0; t < L; t += 16) {
      const int64_t n = std::min<int64_t>(16, L - t);
      const Vec16 e = exp(sub(load(s + t, n), top));
      store(s + t, e, n);
      total = add(total, load(s + t, n));  // zero past n, as the tail's exp is not
    }
    const Vec16 inverse = set1(1.0f / reduce_add(total));
    for (int64_t t = 0; t < L; t += 16) {
      const int64_t n = std::min<int64_t>(16, L - t);
      store(s + t, mul(load(s + t, n), inverse), n);
    }
    float* acc = scratch.acc.data();
    int64_t v = 0;
    for (; v + 8 <= D / 8; v += 8) weigh_values<8, false>(s, head_values, item.table, L, block_size, D, v, acc);
    for (; v < D / 8; ++v) weigh_values<1, false>(s, head_values, item.table, L, block_size, D, v, acc);
    if (D % 8) weigh_values<1, true>(s, head_values, item.table, L, block_size, D, v, acc);
    for (int64_t d = 0; d < D; d += 16) store(out + g * D + d, load(acc + d, std::min<int64_t>(16, D - d)), std::min<int64_t>(16, D - d));
  }
}

// One row [D] of T rounded to the cache's C at dst.
template <typename T, typename C>
inline void store_row(const T* row, C* dst, int64_t D) {
  using namespace tokenmill_vec;
  for (int64_t d = 0; d < D; d += 16) {
    const int64_t n = std::min<int64_t>(16, D - d);
    store(dst + d, load(row + d, n), n);
  }
}

}  // namespace tokenmill_rows
