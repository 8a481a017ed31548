// The AVX2 build's few-row products of quantized weights (the row layout of quant_gemv.cpp) with
// activations rounded to 8 bits per group (quant_gemv_i8, arithmetic in quant_gemv_avx2.cpp's
// header comment): the activations' rounding and the loops over a range of output rows. The op
// (quant_gemv_avx2.cpp) and the fused decode step (decode_step_avx2.cpp) both run these, so that
// they compute the same sums bit for bit.
#pragma once
#include <ATen/Parallel.h>
#include <c10/util/Half.h>
#include <immintrin.h>

#include <algorithm>
#include <cmath>
#include <cstdint>
#include <vector>

namespace tokenmill_i8 {


constexpr int64_t kChunk = 64;   // columns per packed 4-bit chunk
constexpr int64_t kMaxRows = 4;  // activation rows sharing one pass over the weights (16 ymm registers)
constexpr int64_t kAhead = 4;    // rows of codes prefetched ahead by quant_gemv_i8

// A row's group scales (or offsets) as float32: float16 ones converted into buf.
inline const float* as_float(const float* src, float*, int64_t) { return src; }
inline __attribute__((always_inline)) const float* as_float(const c10::Half* src, float* buf, int64_t n) {
  int64_t i = 0;
  for (; i + 8 <= n; i += 8) {
    _mm256_storeu_ps(buf + i, _mm256_cvtph_ps(_mm_loadu_si128(reinterpret_cast<const __m128i*>(src + i))));
  }
  for (; i < n; ++i) buf[i] = _cvtsh_ss(src[i].x);  // F16C (c10::Half's own conversion is bit arithmetic)
  return buf;
}

inline void to_float(const float* src, float* dst, int64_t n) { std::copy(src, src + n, dst); }
inline void to_float(const c10::Half* src, float* dst, int64_t n) { as_float(src, dst, n); }

inline float horizontal_sum(__m256 v) {
  const __m128 pair = _mm_add_ps(_mm256_castps256_ps128(v), _mm256_extractf128_ps(v, 1));
  const __m128 two = _mm_add_ps(pair, _mm_movehl_ps(pair, pair));
  return _mm_cvtss_f32(_mm_add_ss(two, _mm_shuffle_ps(two, two, 1)));
}

// ---- activations rounded per group ----------------------------------------------------------

// x rounded per row and group: q1 (and q2) int8 [M, K], their scale per group, and group sums.
struct QuantizedActivations {
  std::vector<int8_t> q1, q2;
  std::vector<float> scale, sums;  // [M, groups]
};

// 32 int32 values (four vectors) as 32 int8 in order; values are within [-127, 127].
inline __m256i pack32(__m256i a, __m256i b, __m256i c, __m256i d) {
  const __m256i packed = _mm256_packs_epi16(_mm256_packs_epi32(a, b), _mm256_packs_epi32(c, d));
  return _mm256_permutevar8x32_epi32(packed, _mm256_setr_epi32(0, 4, 1, 5, 2, 6, 3, 7));
}

inline float horizontal_max(__m256 v) {
  const __m128 pair = _mm_max_ps(_mm256_castps256_ps128(v), _mm256_extractf128_ps(v, 1));
  const __m128 two = _mm_max_ps(pair, _mm_movehl_ps(pair, pair));
  return _mm_cvtss_f32(_mm_max_ss(two, _mm_shuffle_ps(two, two, 1)));
}

// One group of G (a multiple of 32) values of x: q1 = round(x / s) with s = max|x| / 127 and, with
// two_parts, q2 = round((x - q1 s) * 256 / s) clamped to [-127, 127]. The group's sum, which the
// weight's offsets meet, is x's own with two parts (~exact anyway) and the rounded values' (s sum q1)
// with one, as in quant_gemv_q8.h: the product is then that of the rounded row with the whole
// weight s u + o, so the rounding error meets the centred weight, not s u alone.
inline void quantize_group(const float* xg, int64_t G, bool two_parts, int8_t* q1, int8_t* q2, float& scale_out,
                           float& sum_out) {
  const __m256 abs_mask = _mm256_castsi256_ps(_mm256_set1_epi32(0x7FFFFFFF));
  __m256 amax8 = _mm256_setzero_ps(), sum8 = _mm256_setzero_ps();
  for (int64_t k = 0; k < G; k += 8) {
    const __m256 v = _mm256_loadu_ps(xg + k);
    amax8 = _mm256_max_ps(amax8, _mm256_and_ps(v, abs_mask));
    sum8 = _mm256_add_ps(sum8, v);
  }
  const float amax = horizontal_max(amax8);
  const float scale = amax / 127.0f, inverse = amax > 0.0f ? 127.0f / amax : 0.0f;
  const __m256 inv = _mm256_set1_ps(inverse), step = _mm256_set1_ps(scale), fine = _mm256_set1_ps(inverse * 256.0f);
  const __m256 low = _mm256_set1_ps(-127.0f), high = _mm256_set1_ps(127.0f);
  constexpr int kNearest = _MM_FROUND_TO_NEAREST_INT | _MM_FROUND_NO_EXC;
  __m256 rounded_sum8 = _mm256_setzero_ps();  // integers: exact in any order
  for (int64_t k = 0; k < G; k += 32) {
    __m256i whole[4], rest[4];
    for (int j = 0; j < 4; ++j) {
      const __m256 v = _mm256_loadu_ps(xg + k + 8 * j);
      const __m256 q = _mm256_round_ps(_mm256_mul_ps(v, inv), kNearest);
      whole[j] = _mm256_cvtps_epi32(q);
      if (two_parts) {  // the remainder, |r| <= s / 2, in steps of s / 256
        const __m256 r = _mm256_round_ps(_mm256_mul_ps(_mm256_fnmadd_ps(q, step, v), fine), kNearest);
        rest[j] = _mm256_cvtps_epi32(_mm256_min_ps(_mm256_max_ps(r, low), high));
      } else {
        rounded_sum8 = _mm256_add_ps(rounded_sum8, q);
      }
    }
    _mm256_storeu_si256(reinterpret_cast<__m256i*>(q1 + k), pack32(whole[0], whole[1], whole[2], whole[3]));
    if (two_parts) _mm256_storeu_si256(reinterpret_cast<__m256i*>(q2 + k), pack32(rest[0], rest[1], rest[2], rest[3]));
  }
  scale_out = two_parts ? scale / 256.0f : scale;
  sum_out = two_parts ? horizontal_sum(sum8) : scale * horizontal_sum(rounded_sum8);
}

// Groups [begin, end) of x [M, K] (group i: row i / groups) rounded into a, sized for them.
inline void quantize_groups(const float* x, int64_t G, bool two_parts, int64_t begin, int64_t end,
                            QuantizedActivations& a) {
  for (int64_t i = begin; i < end; ++i) {
    quantize_group(x + i * G, G, two_parts, a.q1.data() + i * G, two_parts ? a.q2.data() + i * G : nullptr,
                   a.scale[i], a.sums[i]);
  }
}

// a sized for x [M, K] in groups of G (no allocation once it has held as many).
inline void size_for(QuantizedActivations& a, int64_t M, int64_t K, int64_t G, bool two_parts) {
  a.q1.resize(M * K);
  a.q2.resize(two_parts ? M * K : 0);
  a.scale.resize(M * K / G);
  a.sums.resize(M * K / G);
}

inline QuantizedActivations quantize_activations(const float* x, int64_t M, int64_t K, int64_t G, bool two_parts) {
  QuantizedActivations a;
  size_for(a, M, K, G, two_parts);
  at::parallel_for(0, M * (K / G), 256, [&](int64_t begin, int64_t end) { quantize_groups(x, G, two_parts, begin, end, a); });
  return a;
}

// The 32 codes of columns [col, col + 32) (col a multiple of 32) as bytes.
inline __m256i load_codes32(const uint8_t* row, int64_t col, int64_t K, int bits) {
  if (bits == 8) return _mm256_loadu_si256(reinterpret_cast<const __m256i*>(row + col));
  const __m256i nibble = _mm256_set1_epi8(0x0F);
  const int64_t chunk_start = col - col % kChunk;
  if (chunk_start + kChunk <= K) {  // a full chunk: columns 0-31 low nibbles of its 32 bytes, 32-63 high
    const __m256i bytes = _mm256_loadu_si256(reinterpret_cast<const __m256i*>(row + chunk_start / 2));
    return _mm256_and_si256(col == chunk_start ? bytes : _mm256_srli_epi16(bytes, 4), nibble);
  }
  const __m128i bytes = _mm_loadu_si128(reinterpret_cast<const __m128i*>(row + chunk_start / 2));
  return _mm256_and_si256(_mm256_set_m128i(_mm_srli_epi16(bytes, 4), bytes), nibble);  // a 32-column tail
}

// u . q over 32 columns as 16 int16 sums of adjacent pairs; 8-bit codes as signed u - 128 (sign
// moved onto q: |pair| <= 2 * 128 * 127 fits).
inline __m256i pair_products32(__m256i codes, const int8_t* q, int bits) {
  __m256i xq = _mm256_loadu_si256(reinterpret_cast<const __m256i*>(q));
  if (bits == 8) {
    const __m256i signed_codes = _mm256_xor_si256(codes, _mm256_set1_epi8(static_cast<char>(0x80)));
    xq = _mm256_sign_epi8(xq, signed_codes);
    codes = _mm256_abs_epi8(signed_codes);
  }
  return _mm256_maddubs_epi16(codes, xq);
}

// u . q over 32 columns as 8 int32 partial sums.
inline __m256i dot32(__m256i codes, const int8_t* q, int bits) {
  return _mm256_madd_epi16(pair_products32(codes, q, bits), _mm256_set1_epi16(1));
}

// One group of 32 columns of one (activation row, output row) pair added into acc: the integer
// u . q scaled by the product of the weight's and the row's group scales. quant_gemv_i8's few-row
// and batched loops both add every group this way, in column order, and finish a pair with
// finish_pair, so a row's product is bit for bit the same alone or among many. Two parts: 256 u . q1
// + u . q2, the shift folded into the pair sums' widening multiply-add.
template <int BITS, bool TWO_PARTS>
inline __m256 add_group(__m256i codes, const int8_t* q1, const int8_t* q2, __m256 scale, __m256 acc) {
  __m256i d;
  if constexpr (TWO_PARTS) {
    d = _mm256_add_epi32(_mm256_madd_epi16(pair_products32(codes, q1, BITS), _mm256_set1_epi16(256)),
                         dot32(codes, q2, BITS));
  } else {
    d = dot32(codes, q1, BITS);
  }
  return _mm256_fmadd_ps(_mm256_cvtepi32_ps(d), scale, acc);
}

// The pair's product: its scaled integer sums plus the weight's offsets times the group sums of x,
// the offsets' vector part added into the same accumulator, so one horizontal sum a pair.
inline float finish_pair(__m256 acc, const float* offsets, const float* x_sums, int64_t groups) {
  int64_t g = 0;
  for (; g + 8 <= groups; g += 8) acc = _mm256_fmadd_ps(_mm256_loadu_ps(offsets + g), _mm256_loadu_ps(x_sums + g), acc);
  float total = horizontal_sum(acc);
  // fused by hand: whether the compiler fuses `total += a * b` depends on where it is inlined, and the
  // few-row and batched loops must round alike
  for (; g < groups; ++g) total = std::fma(offsets[g], x_sums[g], total);
  return total;
}

// A row's group offsets as they meet the group sums of x: 8-bit codes went in as u - 128.
template <int BITS>
inline const float* code_offsets(const float* o, const float* s, int64_t groups, float* buf) {
  if constexpr (BITS != 8) return o;
  for (int64_t g = 0; g < groups; ++g) buf[g] = o[g] + 128.0f * s[g];
  return buf;
}

// u . q of one group of 32 columns for ROWS activation rows, scaled by the products of the weight's
// and the rows' group scales (scale_products: row r's at r * groups) into acc.
template <int ROWS, int BITS, bool TWO_PARTS>
inline void group32(__m256i codes, const int8_t* q1, const int8_t* q2, int64_t K, const float* scale_products,
                    int64_t groups, __m256* acc) {
#pragma GCC unroll 8
  for (int r = 0; r < ROWS; ++r) {
    acc[r] = add_group<BITS, TWO_PARTS>(codes, q1 + r * K, TWO_PARTS ? q2 + r * K : nullptr,
                                        _mm256_broadcast_ss(scale_products + r * groups), acc[r]);
  }
}

// products[r * groups + g] = w[g] * sx[r * groups + g] for ROWS rows: one output row's group
// scales times the activation rows', a vector at a time (the same float products add_group's
// callers take one by one).
template <int ROWS>
inline void scale_products(const float* w, const float* sx, int64_t groups, float* products) {
  for (int r = 0; r < ROWS; ++r) {
    int64_t g = 0;
    for (; g + 8 <= groups; g += 8)
      _mm256_storeu_ps(products + r * groups + g,
                       _mm256_mul_ps(_mm256_loadu_ps(w + g), _mm256_loadu_ps(sx + r * groups + g)));
    for (; g < groups; ++g) products[r * groups + g] = w[g] * sx[r * groups + g];
  }
}

// NR output rows [n, n + NR) of gemv_i8_rows_g32, side by side: NR x ROWS accumulators, each its
// own chain of multiply-adds (one row alone waits on the float multiply-add's latency every group).
// The NR rows' scales and offsets are contiguous: converted, and (one activation row) multiplied by
// sx_tiled (the row's group scales NR times over), NR rows at a time, so that a short row (the
// default model's 18 groups) pays one vector tail a block rather than three scalar ones a row (the
// few-row loop spent half its time outside the products). buf: float scratch of
// NR * (3 + ROWS) * groups.
template <int ROWS, int NR, int BITS, bool TWO_PARTS, typename S>
inline void outputs_g32(const QuantizedActivations& a, int64_t row0, const uint8_t* codes, const S* scales,
                        const S* offsets, int64_t n, int64_t n_end, int64_t K, const float* sx_tiled, float* buf,
                        float* out, int64_t out_stride) {
  const int64_t row_bytes = BITS == 8 ? K : K / 2, groups = K / 32, full = K - K % kChunk, block = NR * groups;
  const int8_t* q1 = a.q1.data() + row0 * K;
  const int8_t* q2 = TWO_PARTS ? a.q2.data() + row0 * K : nullptr;
  const float* sx = a.scale.data() + row0 * groups;
  const float* sums = a.sums.data() + row0 * groups;
  const __m256i nibble = _mm256_set1_epi8(0x0F);
  const uint8_t* w[NR];
  const float* s = as_float(scales + n * groups, buf, block);
  const float* o = as_float(offsets + n * groups, buf + block, block);
  float* products = buf + 2 * block;  // output row j's for activation row r at (j * ROWS + r) * groups
  if constexpr (ROWS == 1) {
    scale_products<1>(s, sx_tiled, block, products);  // the block's rows as one long row
  } else {
    for (int j = 0; j < NR; ++j) scale_products<ROWS>(s + j * groups, sx, groups, products + j * ROWS * groups);
  }
  for (int j = 0; j < NR; ++j) {
    w[j] = codes + (n + j) * row_bytes;
    if (n + j + kAhead < n_end) {  // the row kAhead rows on, into L2: the weights come from DRAM
      for (int64_t b = 0; b < row_bytes; b += 64)
        _mm_prefetch(reinterpret_cast<const char*>(w[j] + kAhead * row_bytes + b), _MM_HINT_T1);
    }
  }
  // Every loop over j and r is unrolled in full (the pragmas): with one left rolled, GCC keeps acc
  // in a stack array, a store every step and a multiply-add chain through memory.
  __m256 acc[NR][ROWS];
#pragma GCC unroll 8
  for (int j = 0; j < NR; ++j)
    for (int r = 0; r < ROWS; ++r) acc[j][r] = _mm256_setzero_ps();
  for (int64_t c = 0; c < full; c += kChunk) {
    const int64_t g = c / 32;
#pragma GCC unroll 8
    for (int j = 0; j < NR; ++j) {
      __m256i first, second;
      if constexpr (BITS == 8) {
        first = _mm256_loadu_si256(reinterpret_cast<const __m256i*>(w[j] + c));
        second = _mm256_loadu_si256(reinterpret_cast<const __m256i*>(w[j] + c + 32));
      } else {
        const __m256i bytes = _mm256_loadu_si256(reinterpret_cast<const __m256i*>(w[j] + c / 2));
        first = _mm256_and_si256(bytes, nibble);
        second = _mm256_and_si256(_mm256_srli_epi16(bytes, 4), nibble);
      }
      const float* p = products + j * ROWS * groups;
      group32<ROWS, BITS, TWO_PARTS>(first, q1 + c, TWO_PARTS ? q2 + c : nullptr, K, p + g, groups, acc[j]);
      group32<ROWS, BITS, TWO_PARTS>(second, q1 + c + 32, TWO_PARTS ? q2 + c + 32 : nullptr, K, p + g + 1, groups,
                                     acc[j]);
    }
  }
  if (full < K) {  // a final 32-column chunk
#pragma GCC unroll 8
    for (int j = 0; j < NR; ++j)
      group32<ROWS, BITS, TWO_PARTS>(load_codes32(w[j], full, K, BITS), q1 + full, TWO_PARTS ? q2 + full : nullptr,
                                     K, products + j * ROWS * groups + groups - 1, groups, acc[j]);
  }
  float* shifted = buf + (2 + ROWS) * block;
#pragma GCC unroll 8
  for (int j = 0; j < NR; ++j) {
    const float* offset = code_offsets<BITS>(o + j * groups, s + j * groups, groups, shifted);
#pragma GCC unroll 8
    for (int r = 0; r < ROWS; ++r) out[r * out_stride + n + j] = finish_pair(acc[j][r], offset, sums + r * groups, groups);
  }
}

// gemv_i8_rows for groups of 32 columns (most GGUF types, and ours): a 4-bit chunk of 64 columns is
// exactly two groups, one in the low nibbles of its 32 bytes and one in the high ones, so the loop
// has no layout arithmetic. With 4-bit codes one or two activation rows take 4 or 2 output rows
// at a time (single-thread, the default model's shapes under AVX2 on the AMD EPYC: 1.08-1.19x);
// 8-bit codes, with more work per group, measured fastest one output row at a time.
template <int ROWS, int BITS, bool TWO_PARTS, typename S>
void gemv_i8_rows_g32(const QuantizedActivations& a, int64_t row0, const uint8_t* codes, const S* scales,
                      const S* offsets, int64_t n_begin, int64_t n_end, int64_t K, float* out, int64_t out_stride) {
  constexpr int NR = BITS == 8 ? 1 : ROWS == 1 ? 4 : ROWS == 2 ? 2 : 1;
  const int64_t groups = K / 32;
  std::vector<float> buf(NR * (3 + ROWS) * groups + (ROWS == 1 ? NR * groups : 0));
  float* sx_tiled = buf.data() + NR * (3 + ROWS) * groups;
  if constexpr (ROWS == 1) {
    for (int j = 0; j < NR; ++j) std::copy_n(a.scale.data() + row0 * groups, groups, sx_tiled + j * groups);
  }
  int64_t n = n_begin;
  for (; n + NR <= n_end; n += NR)
    outputs_g32<ROWS, NR, BITS, TWO_PARTS, S>(a, row0, codes, scales, offsets, n, n_end, K, sx_tiled, buf.data(), out,
                                              out_stride);
  for (; n < n_end; ++n)
    outputs_g32<ROWS, 1, BITS, TWO_PARTS, S>(a, row0, codes, scales, offsets, n, n_end, K, sx_tiled, buf.data(), out,
                                             out_stride);
}

template <int ROWS, int BITS, bool TWO_PARTS, typename S>
void gemv_i8_rows(const QuantizedActivations& a, int64_t row0, const uint8_t* codes, const S* scales,
                  const S* offsets, int64_t n_begin, int64_t n_end, int64_t K, int64_t G, float* out,
                  int64_t out_stride) {
  constexpr int bits = BITS;
  constexpr bool two_parts = TWO_PARTS;
  const int64_t row_bytes = bits == 8 ? K : K / 2, groups = K / G;
  std::vector<float> scale_buf(groups), offset_buf(groups), shifted(bits == 8 ? groups : 0);
  const int8_t* q1 = a.q1.data() + row0 * K;
  const int8_t* q2 = two_parts ? a.q2.data() + row0 * K : nullptr;
  const float* sx = a.scale.data() + row0 * groups;
  const float* sums = a.sums.data() + row0 * groups;
  for (int64_t n = n_begin; n < n_end; ++n) {
    const uint8_t* w = codes + n * row_bytes;
    const float* s = as_float(scales + n * groups, scale_buf.data(), groups);
    const float* o = as_float(offsets + n * groups, offset_buf.data(), groups);
    __m256 acc[ROWS];
    for (int r = 0; r < ROWS; ++r) acc[r] = _mm256_setzero_ps();
    for (int64_t g = 0; g < groups; ++g) {
      __m256i dot[ROWS];
      for (int r = 0; r < ROWS; ++r) dot[r] = _mm256_setzero_si256();
      for (int64_t col = g * G; col < (g + 1) * G; col += 32) {
        const __m256i u = load_codes32(w, col, K, bits);
        for (int r = 0; r < ROWS; ++r) {
          __m256i d = dot32(u, q1 + r * K + col, bits);
          if (two_parts) d = _mm256_add_epi32(_mm256_slli_epi32(d, 8), dot32(u, q2 + r * K + col, bits));
          dot[r] = _mm256_add_epi32(dot[r], d);
        }
      }
      for (int r = 0; r < ROWS; ++r) {
        acc[r] = _mm256_fmadd_ps(_mm256_cvtepi32_ps(dot[r]), _mm256_set1_ps(s[g] * sx[r * groups + g]), acc[r]);
      }
    }
    const float* offset = code_offsets<BITS>(o, s, groups, shifted.data());
    for (int r = 0; r < ROWS; ++r) out[r * out_stride + n] = finish_pair(acc[r], offset, sums + r * groups, groups);
  }
}

template <typename S>
using GemvI8Fn = void (*)(const QuantizedActivations&, int64_t, const uint8_t*, const S*, const S*, int64_t, int64_t,
                          int64_t, int64_t, float*, int64_t);
template <int ROWS, int BITS, bool TWO_PARTS, typename S>
void gemv_i8_any(const QuantizedActivations& a, int64_t row0, const uint8_t* codes, const S* scales, const S* offsets,
                 int64_t n_begin, int64_t n_end, int64_t K, int64_t G, float* out, int64_t out_stride) {
  if (G == 32) {
    gemv_i8_rows_g32<ROWS, BITS, TWO_PARTS, S>(a, row0, codes, scales, offsets, n_begin, n_end, K, out, out_stride);
  } else {
    gemv_i8_rows<ROWS, BITS, TWO_PARTS, S>(a, row0, codes, scales, offsets, n_begin, n_end, K, G, out, out_stride);
  }
}
template <int BITS, bool TWO_PARTS, typename S>
constexpr GemvI8Fn<S> kGemvI8Rows[kMaxRows] = {gemv_i8_any<1, BITS, TWO_PARTS, S>, gemv_i8_any<2, BITS, TWO_PARTS, S>,
                                               gemv_i8_any<3, BITS, TWO_PARTS, S>, gemv_i8_any<4, BITS, TWO_PARTS, S>};
template <typename S>
GemvI8Fn<S> gemv_i8_fn(int64_t rows, int64_t bits, bool two_parts) {
  if (bits == 4) return two_parts ? kGemvI8Rows<4, true, S>[rows - 1] : kGemvI8Rows<4, false, S>[rows - 1];
  return two_parts ? kGemvI8Rows<8, true, S>[rows - 1] : kGemvI8Rows<8, false, S>[rows - 1];
}

}  // namespace tokenmill_i8
