// The core of quant_gemv_q8 (layout and arithmetic in quant_gemv_q8.cpp's header comment): one
// activation row quantized per group, and the VNNI multiply over a range of 16-row blocks. The op
// (quant_gemv_q8.cpp) and the fused decode step (decode_step.cpp) both run these, so that they
// compute the same sums bit for bit.
#pragma once
#include <immintrin.h>

#include <algorithm>
#include <cstdint>
#include <cstring>

#include "quant_layout.h"
#include "vec_math.h"

#if defined(__AVX512VNNI__)
namespace tokenmill_q8 {

constexpr int64_t kLanes = tokenmill_quant::kInterleavedLanes;  // output rows per block
constexpr int64_t kPassRows = 4;   // activation rows per pass over a block (the rest: more passes, from L1)
// Codes, scales and offsets are prefetched this many steps (of NB blocks) ahead, into L2: the
// hardware prefetchers alone left one row's stream of the weights at ~2/3 of the speed it reaches
// with them, and on the AMD EPYC (2 threads streaming the default model's layers) prefetching into
// L1 only the codes reached 17-18 GB/s where this reaches 21-25.
constexpr int64_t kPrefetchAhead = 2;

inline void prefetch_l2(const void* p) { _mm_prefetch(static_cast<const char*>(p), _MM_HINT_T1); }

using tokenmill_vec::load;  // n <= 16 elements as float32

// Activations of one row, quantized per group: q [K], the group scales d and sums X [K / G].
struct QuantizedRow {
  int8_t* q;
  int8_t* q2;  // two_parts: the rounding error of q, in steps of d / 254 (else nullptr)
  float* d;
  float* sums;
};

// Lane j of the result: a[j]'s 16 lanes reduced by `op` (max or add, exact in any order), for 16
// vectors at once: four rounds of shuffles, each halving the vectors, then one permutation.
template <typename Op>
inline __m512 reduce_each(__m512 (&a)[16], Op op) {
  __m512 c[8], e[4], f[2];
  for (int i = 0; i < 8; ++i)  // quarters of a[2i] (lanes 0-7) and of a[2i + 1] (8-15), halved
    c[i] = op(_mm512_shuffle_f32x4(a[2 * i], a[2 * i + 1], 0x44), _mm512_shuffle_f32x4(a[2 * i], a[2 * i + 1], 0xEE));
  for (int i = 0; i < 4; ++i)  // quarter k: vector 4i + k's four partials
    e[i] = op(_mm512_shuffle_f32x4(c[2 * i], c[2 * i + 1], 0x88), _mm512_shuffle_f32x4(c[2 * i], c[2 * i + 1], 0xDD));
  for (int i = 0; i < 2; ++i)
    f[i] = op(_mm512_shuffle_ps(e[2 * i], e[2 * i + 1], 0x44), _mm512_shuffle_ps(e[2 * i], e[2 * i + 1], 0xEE));
  const __m512 g = op(_mm512_shuffle_ps(f[0], f[1], 0x88), _mm512_shuffle_ps(f[0], f[1], 0xDD));
  // lane 4k + m now holds vector 4m + k
  const __m512i order = _mm512_setr_epi32(0, 4, 8, 12, 1, 5, 9, 13, 2, 6, 10, 14, 3, 7, 11, 15);
  return _mm512_permutexvar_ps(order, g);
}

// One part (row.q2 == nullptr), groups of 32: as quantize_row below, bit for bit (a maximum and an
// integer sum are exact in any order), with each group's two horizontal reductions done for 16
// groups at once (reduce_each) instead of one by one. The batched kernel quantizes every
// activation row of a prompt with this.
template <typename X>
inline void quantize_row_groups_of_32(const X* x, int64_t K, QuantizedRow row) {
  const auto max = [](__m512 a, __m512 b) { return _mm512_max_ps(a, b); };
  const auto add = [](__m512 a, __m512 b) {
    return _mm512_castsi512_ps(_mm512_add_epi32(_mm512_castps_si512(a), _mm512_castps_si512(b)));
  };
  for (int64_t g0 = 0; g0 < K / 32; g0 += 16) {
    const int64_t n = std::min<int64_t>(16, K / 32 - g0);
    const X* xg = x + g0 * 32;
    __m512 top[16];
    for (int64_t j = 0; j < 16; ++j)
      top[j] = j < n ? _mm512_max_ps(_mm512_abs_ps(load(xg + 32 * j, 16)), _mm512_abs_ps(load(xg + 32 * j + 16, 16)))
                     : _mm512_setzero_ps();
    const __m512 tops = reduce_each(top, max);
    const __m512 d = _mm512_div_ps(tops, _mm512_set1_ps(127.0f));
    alignas(64) float inverse[16];
    _mm512_store_ps(inverse, _mm512_maskz_div_ps(_mm512_cmp_ps_mask(tops, _mm512_setzero_ps(), _CMP_GT_OQ),
                                                 _mm512_set1_ps(127.0f), tops));
    __m512 code_sums[16];
    for (int64_t j = 0; j < 16; ++j) {
      if (j >= n) {
        code_sums[j] = _mm512_setzero_ps();
        continue;
      }
      const __m512 scale = _mm512_set1_ps(inverse[j]);
      const __m512i low = _mm512_cvtps_epi32(_mm512_mul_ps(load(xg + 32 * j, 16), scale));
      const __m512i high = _mm512_cvtps_epi32(_mm512_mul_ps(load(xg + 32 * j + 16, 16), scale));
      _mm_storeu_si128(reinterpret_cast<__m128i*>(row.q + (g0 + j) * 32), _mm512_cvtsepi32_epi8(low));
      _mm_storeu_si128(reinterpret_cast<__m128i*>(row.q + (g0 + j) * 32 + 16), _mm512_cvtsepi32_epi8(high));
      code_sums[j] = _mm512_castsi512_ps(_mm512_add_epi32(low, high));
    }
    const __m512i sums = _mm512_castps_si512(reduce_each(code_sums, add));
    const __mmask16 groups = tokenmill_vec::first(n);
    _mm512_mask_storeu_ps(row.d + g0, groups, d);
    _mm512_mask_storeu_ps(row.sums + g0, groups, _mm512_mul_ps(d, _mm512_cvtepi32_ps(sums)));
  }
}

// X[g] is the exact sum of x over the group with two parts; with one, d[g] * sum q (the rounded
// activations' sum), so that the offset term meets the rounding error too: the weight s u + o is
// then multiplied centred, not s u alone (half the error on Q4_1-style weights), and one-part rows
// give the same sums here as in quant_gemm_q8.cpp, bit for bit.
template <typename X>
inline void quantize_row(const X* x, int64_t K, int64_t G, QuantizedRow row) {
  if (row.q2 == nullptr && G == 32) return quantize_row_groups_of_32(x, K, row);
  for (int64_t g = 0; g < K / G; ++g) {
    __m512 amax = _mm512_setzero_ps(), sum = _mm512_setzero_ps();
    for (int64_t k = g * G; k < (g + 1) * G; k += 16) {
      const __m512 v = load(x + k, 16);
      amax = _mm512_max_ps(amax, _mm512_abs_ps(v));
      sum = _mm512_add_ps(sum, v);
    }
    const float top = _mm512_reduce_max_ps(amax);
    row.d[g] = top / 127.0f;
    row.sums[g] = _mm512_reduce_add_ps(sum);
    const __m512 inverse = _mm512_set1_ps(top > 0.0f ? 127.0f / top : 0.0f);
    __m512i code_sum = _mm512_setzero_si512();
    for (int64_t k = g * G; k < (g + 1) * G; k += 16) {
      const __m512 steps = _mm512_mul_ps(load(x + k, 16), inverse);  // x / d, |x / d| <= 127
      const __m512i rounded = _mm512_cvtps_epi32(steps);
      code_sum = _mm512_add_epi32(code_sum, rounded);
      _mm_storeu_si128(reinterpret_cast<__m128i*>(row.q + k), _mm512_cvtsepi32_epi8(rounded));
      if (row.q2 != nullptr) {  // (x / d - q) in [-1/2, 1/2], in 254ths
        const __m512 error = _mm512_mul_ps(_mm512_sub_ps(steps, _mm512_cvtepi32_ps(rounded)), _mm512_set1_ps(254.0f));
        _mm_storeu_si128(reinterpret_cast<__m128i*>(row.q2 + k), _mm512_cvtsepi32_epi8(_mm512_cvtps_epi32(error)));
      }
    }
    if (row.q2 == nullptr) row.sums[g] = row.d[g] * static_cast<float>(_mm512_reduce_add_epi32(code_sum));
  }
}

// Four activation bytes (columns k .. k + 3) in every lane.
__attribute__((always_inline)) inline __m512i broadcast4(const int8_t* q) {
  int32_t quad;
  std::memcpy(&quad, q, sizeof(quad));
  return _mm512_set1_epi32(quad);
}

// Blocks [b_begin, b_end) for ROWS activation rows, NB blocks at a time (independent chains of
// multiply-adds: one waits on itself), into out[r * out_stride + 16 (b - b_begin) + i]. Each
// group's integer sums go into two accumulators per part (low and high nibbles, or even and odd
// quads), for the same reason. FIXED_G > 0: the group size known when compiling (gemv_for), so that a
// group's loop unrolls.
template <int ROWS, int NB, bool TWO_PARTS, int BITS, int FIXED_G, typename S>
void gemv_blocks(const QuantizedRow* x, const uint8_t* codes, const S* scales, const S* offsets, int64_t b_begin,
                 int64_t b_end, int64_t groups, int64_t runtime_g, float* out, int64_t out_stride) {
  const int64_t G = FIXED_G > 0 ? FIXED_G : runtime_g;
  constexpr int kParts = TWO_PARTS ? 2 : 1;
  const int64_t group_bytes = kLanes * G * BITS / 8;
  const __m512i nibble = _mm512_set1_epi8(0x0F);
  int64_t b = b_begin;
  for (; b + NB <= b_end; b += NB) {
    __m512 acc[ROWS][NB];
    for (int r = 0; r < ROWS; ++r)
      for (int n = 0; n < NB; ++n) acc[r][n] = _mm512_setzero_ps();
    for (int64_t g = 0; g < groups; ++g) {
      __m512i isum[ROWS][NB][kParts][2];
      for (int r = 0; r < ROWS; ++r)
        for (int n = 0; n < NB; ++n)
          for (int p = 0; p < kParts; ++p) isum[r][n][p][0] = isum[r][n][p][1] = _mm512_setzero_si512();
      const int64_t col = g * G;
      if (b + kPrefetchAhead * NB < b_end) {  // this group of the blocks two steps on
        for (int n = 0; n < NB; ++n) {
          const int64_t ahead = (b + kPrefetchAhead * NB + n) * groups + g;
          for (int64_t line = 0; line < group_bytes; line += 64) prefetch_l2(codes + ahead * group_bytes + line);
          prefetch_l2(scales + ahead * kLanes);
          prefetch_l2(offsets + ahead * kLanes);
        }
      }
      if constexpr (BITS == 4) {
#pragma GCC unroll 8
        for (int64_t j = 0; j < G / 8; ++j) {
          __m512i low[NB], high[NB];
          for (int n = 0; n < NB; ++n) {
            const __m512i v = _mm512_loadu_si512(codes + ((b + n) * groups + g) * group_bytes + 64 * j);
            low[n] = _mm512_and_si512(v, nibble);
            high[n] = _mm512_and_si512(_mm512_srli_epi16(v, 4), nibble);
          }
          for (int r = 0; r < ROWS; ++r) {
            for (int p = 0; p < kParts; ++p) {
              const int8_t* q = p == 0 ? x[r].q : x[r].q2;
              const __m512i qa = broadcast4(q + col + 4 * j), qb = broadcast4(q + col + 4 * (j + G / 8));
              for (int n = 0; n < NB; ++n) {
                isum[r][n][p][0] = _mm512_dpbusd_epi32(isum[r][n][p][0], low[n], qa);
                isum[r][n][p][1] = _mm512_dpbusd_epi32(isum[r][n][p][1], high[n], qb);
              }
            }
          }
        }
      } else {
#pragma GCC unroll 8
        for (int64_t j = 0; j < G / 4; j += 2) {  // G is a multiple of 16: quads in pairs, one per accumulator
          // (a [j & 1] index in a loop GCC did not unroll put the accumulators on the stack)
          const uint8_t* quads = codes + (b * groups + g) * group_bytes;
          __m512i even[NB], odd[NB];
          for (int n = 0; n < NB; ++n) {
            even[n] = _mm512_loadu_si512(quads + n * groups * group_bytes + 64 * j);
            odd[n] = _mm512_loadu_si512(quads + n * groups * group_bytes + 64 * (j + 1));
          }
          for (int r = 0; r < ROWS; ++r) {
            for (int p = 0; p < kParts; ++p) {
              const int8_t* q = (p == 0 ? x[r].q : x[r].q2) + col + 4 * j;
              const __m512i qa = broadcast4(q), qb = broadcast4(q + 4);
              for (int n = 0; n < NB; ++n) {
                isum[r][n][p][0] = _mm512_dpbusd_epi32(isum[r][n][p][0], even[n], qa);
                isum[r][n][p][1] = _mm512_dpbusd_epi32(isum[r][n][p][1], odd[n], qb);
              }
            }
          }
        }
      }
      for (int n = 0; n < NB; ++n) {
        const __m512 s = load(scales + ((b + n) * groups + g) * kLanes, kLanes);
        const __m512 o = load(offsets + ((b + n) * groups + g) * kLanes, kLanes);
        for (int r = 0; r < ROWS; ++r) {
          __m512 sum = _mm512_cvtepi32_ps(_mm512_add_epi32(isum[r][n][0][0], isum[r][n][0][1]));
          if constexpr (TWO_PARTS) {
            const __m512 low = _mm512_cvtepi32_ps(_mm512_add_epi32(isum[r][n][1][0], isum[r][n][1][1]));
            sum = _mm512_fmadd_ps(low, _mm512_set1_ps(1.0f / 254.0f), sum);
          }
          acc[r][n] = _mm512_fmadd_ps(_mm512_mul_ps(sum, _mm512_set1_ps(x[r].d[g])), s, acc[r][n]);
          acc[r][n] = _mm512_fmadd_ps(o, _mm512_set1_ps(x[r].sums[g]), acc[r][n]);
        }
      }
    }
    for (int r = 0; r < ROWS; ++r)
      for (int n = 0; n < NB; ++n) _mm512_storeu_ps(out + r * out_stride + (b + n - b_begin) * kLanes, acc[r][n]);
  }
  if constexpr (NB > 1) {  // the last blocks, one at a time
    if (b < b_end)
      gemv_blocks<ROWS, 1, TWO_PARTS, BITS, FIXED_G, S>(x, codes, scales, offsets, b, b_end, groups, G,
                                               out + (b - b_begin) * kLanes, out_stride);
  }
}

template <typename S>
using GemvFn = void (*)(const QuantizedRow*, const uint8_t*, const S*, const S*, int64_t, int64_t, int64_t, int64_t,
                        float*, int64_t);

// Two blocks at a time while one or two rows leave registers for them.
// FIXED_G 32 (every GGUF type but Q6_K, and ours) unrolls a group's multiply-adds.
template <int ROWS, bool TWO, typename S>
GemvFn<S> gemv_for(int64_t bits, int64_t G) {
  constexpr int NB = ROWS <= 2 ? 2 : 1;
  if (G == 32) return bits == 8 ? gemv_blocks<ROWS, NB, TWO, 8, 32, S> : gemv_blocks<ROWS, NB, TWO, 4, 32, S>;
  return bits == 8 ? gemv_blocks<ROWS, NB, TWO, 8, 0, S> : gemv_blocks<ROWS, NB, TWO, 4, 0, S>;
}

template <bool TWO, typename S>
GemvFn<S> select_gemv(int64_t rows, int64_t bits, int64_t G) {
  switch (rows) {
    case 1: return gemv_for<1, TWO, S>(bits, G);
    case 2: return gemv_for<2, TWO, S>(bits, G);
    case 3: return gemv_for<3, TWO, S>(bits, G);
    default: return gemv_for<4, TWO, S>(bits, G);
  }
}

template <typename T>
inline void store_rows(const float* src, int64_t src_stride, T* dst, int64_t dst_stride, int64_t rows, int64_t begin,
                int64_t end) {
  for (int64_t r = 0; r < rows; ++r)
    for (int64_t n = begin; n < end; ++n) dst[r * dst_stride + n] = static_cast<T>(src[r * src_stride + n - begin]);
}

// out [M, N] (T) = M quantized activation rows times blocks [begin, end) of a weight, kPassRows
// rows a pass; local: float scratch of kPassRows * 16 (end - begin).
template <typename T, typename S>
void multiply_blocks(const QuantizedRow* rows, int64_t M, const uint8_t* codes, const S* scales, const S* offsets,
                     int64_t bits, int64_t G, int64_t groups, bool two_parts, int64_t begin, int64_t end, int64_t N,
                     float* local, T* out) {
  const int64_t width = (end - begin) * kLanes, n_end = std::min(N, end * kLanes);
  for (int64_t m = 0; m < M; m += kPassRows) {
    const int64_t count = std::min(kPassRows, M - m);
    const GemvFn<S> gemv = two_parts ? select_gemv<true, S>(count, bits, G) : select_gemv<false, S>(count, bits, G);
    gemv(rows + m, codes, scales, offsets, begin, end, groups, G, local, width);
    store_rows(local, width, out + m * N, N, count, begin * kLanes, n_end);
  }
}

}  // namespace tokenmill_q8
#endif  // __AVX512VNNI__
