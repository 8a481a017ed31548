// quant_gemv and quant_dequantize (the ops of quant_gemv.cpp, same layout, same schemas) for x86 CPUs
// with AVX2 and FMA but no AVX-512: the only kernels built there (cpu_kernels.py), with
// quant_gemv_i8, their faster few-row product for groups of a multiple of 32 columns.
//
// Weight n, column k, in group g = k / G:   w = scales[n, g] * u + offsets[n, g]
// so a row's product with x splits per group into   scales[n, g] * (u . x)_g + offsets[n, g] * sum(x)_g.
// The group sums of x are computed once per call, in float32.
//
// quant_gemv keeps x in float32: the inner loop converts 8 codes to float and multiply-adds them
// into the group's dot product, and the group's scale is applied once per group: the dequantized
// weight's product up to float32 rounding.
//
// quant_gemv_i8(x, codes, scales, offsets, bits, G, two_parts) rounds x per row and group of the
// weight's to 8-bit integers q1 with a scale sx = max|x| / 127 (as llama.cpp does) and, with
// two_parts, the remainder to q2 with scale sx / 256 (x to ~16 bits: ~exact), so that u . x is
// integer multiply-adds of 32 byte pairs at a time (vpmaddubsw, then vpmaddwd into int32):
// ~3x fewer instructions per weight than the float loop. 8-bit codes go in as signed u - 128
// (their sign moved onto x, so that no pair sum overflows int16), the offsets as o + 128 s.
// More than 4 rows take its batched loop: blocks of output rows whose codes stay in L1 while every
// row passes, in register tiles of 4 rows x 2 outputs, each pair's groups added in the same order
// and the same way (add_group, finish_pair) as the few-row loop: a row's product is bit for bit
// what it is alone.
#include <ATen/Parallel.h>
#include <ATen/core/Tensor.h>
#include <ATen/ops/empty.h>
#include <c10/util/BFloat16.h>
#include <c10/util/Half.h>
#include <immintrin.h>
#include <torch/library.h>

#include "quant_gemv_i8.h"
#include "quant_layout.h"

#include <algorithm>
#include <cmath>
#include <cstdint>
#include <type_traits>
#include <vector>

namespace {

using namespace tokenmill_i8;

constexpr int64_t kBlockBytes = 16 << 10;  // codes per block of output rows in quant_gemv_i8's batched loop

// The codes of the chunk starting at column c of a row, 16 per vector (one per byte): four vectors
// for a full chunk, two for a final 32-column one (see the layout at the top of quant_gemv.cpp);
// returns how many.
inline int load_pieces(const uint8_t* row, int64_t c, int64_t K, int bits, __m128i pieces[4]) {
  const int64_t width = std::min(kChunk, K - c);
  if (bits == 8) {
    for (int p = 0; p < 4; ++p) {
      if (16 * p < width) pieces[p] = _mm_loadu_si128(reinterpret_cast<const __m128i*>(row + c + 16 * p));
    }
    return static_cast<int>(width / 16);
  }
  const __m128i nibble = _mm_set1_epi8(0x0F);
  const uint8_t* packed = row + c / 2;
  const __m128i first = _mm_loadu_si128(reinterpret_cast<const __m128i*>(packed));
  if (width < kChunk) {  // columns 0-15 in the low nibbles of its 16 bytes, 16-31 in the high ones
    pieces[0] = _mm_and_si128(first, nibble);
    pieces[1] = _mm_and_si128(_mm_srli_epi16(first, 4), nibble);
    return 2;
  }
  const __m128i second = _mm_loadu_si128(reinterpret_cast<const __m128i*>(packed + 16));
  pieces[0] = _mm_and_si128(first, nibble);  // columns 0-31 in the low nibbles of its 32 bytes
  pieces[1] = _mm_and_si128(second, nibble);
  pieces[2] = _mm_and_si128(_mm_srli_epi16(first, 4), nibble);  // 32-63 in the high ones
  pieces[3] = _mm_and_si128(_mm_srli_epi16(second, 4), nibble);
  return 4;
}

// 16 codes as two vectors of 8 floats.
inline void widen(__m128i codes, __m256& low, __m256& high) {
  low = _mm256_cvtepi32_ps(_mm256_cvtepu8_epi32(codes));
  high = _mm256_cvtepi32_ps(_mm256_cvtepu8_epi32(_mm_srli_si128(codes, 8)));
}


// Output rows [n_begin, n_end) for ROWS activation rows; x_sums[r * groups + g] = sum of x row r over group g.
template <int ROWS, typename S>
void gemv_rows(const float* x, int64_t x_stride, const float* x_sums, const uint8_t* codes, const S* scales,
               const S* offsets, int64_t n_begin, int64_t n_end, int64_t K, int64_t G, int bits, float* out,
               int64_t out_stride) {
  const int64_t row_bytes = bits == 8 ? K : K / 2;
  const int64_t groups = K / G;
  std::vector<float> scale_buf(groups), offset_buf(groups);
  for (int64_t n = n_begin; n < n_end; ++n) {
    const uint8_t* w = codes + n * row_bytes;
    const float* s = as_float(scales + n * groups, scale_buf.data(), groups);
    const float* o = as_float(offsets + n * groups, offset_buf.data(), groups);
    __m256 acc[ROWS];
    for (int r = 0; r < ROWS; ++r) acc[r] = _mm256_setzero_ps();
    __m256 dot_low[ROWS], dot_high[ROWS];  // the current group's u . x, two chains per row
    for (int r = 0; r < ROWS; ++r) dot_low[r] = dot_high[r] = _mm256_setzero_ps();
    int64_t g = 0, pieces_left = G / 16;  // the group of the current 16 columns (no division)
    for (int64_t c = 0; c < K; c += kChunk) {
      __m128i pieces[4];
      const int count = load_pieces(w, c, K, bits, pieces);
#pragma GCC unroll 4
      for (int p = 0; p < 4; ++p) {
        if (p >= count) break;
        __m256 low, high;
        widen(pieces[p], low, high);
        const int64_t col = c + 16 * p;
        for (int r = 0; r < ROWS; ++r) {
          dot_low[r] = _mm256_fmadd_ps(low, _mm256_loadu_ps(x + r * x_stride + col), dot_low[r]);
          dot_high[r] = _mm256_fmadd_ps(high, _mm256_loadu_ps(x + r * x_stride + col + 8), dot_high[r]);
        }
        if (--pieces_left == 0) {  // the group ends: its scale multiplies its dot product once
          const __m256 scale = _mm256_set1_ps(s[g++]);
          for (int r = 0; r < ROWS; ++r) {
            acc[r] = _mm256_fmadd_ps(_mm256_add_ps(dot_low[r], dot_high[r]), scale, acc[r]);
            dot_low[r] = dot_high[r] = _mm256_setzero_ps();
          }
          pieces_left = G / 16;
        }
      }
    }
    for (int r = 0; r < ROWS; ++r) {
      float offset_term = 0.0f;
      for (int64_t g = 0; g < groups; ++g) offset_term += o[g] * x_sums[r * groups + g];
      out[r * out_stride + n] = horizontal_sum(acc[r]) + offset_term;
    }
  }
}

template <typename S>
using GemvFn = void (*)(const float*, int64_t, const float*, const uint8_t*, const S*, const S*, int64_t, int64_t,
                        int64_t, int64_t, int, float*, int64_t);
template <typename S>
constexpr GemvFn<S> kGemv[kMaxRows] = {gemv_rows<1, S>, gemv_rows<2, S>, gemv_rows<3, S>, gemv_rows<4, S>};

template <typename S>
void run(const float* x, int64_t M, int64_t K, const at::Tensor& codes, const at::Tensor& scales,
         const at::Tensor& offsets, int64_t bits, int64_t G, float* out) {
  const int64_t N = codes.size(0), groups = K / G;
  std::vector<float> x_sums(M * groups);
  for (int64_t m = 0; m < M; ++m) {
    for (int64_t g = 0; g < groups; ++g) {
      __m256 sum = _mm256_setzero_ps();
      for (int64_t k = g * G; k < (g + 1) * G; k += 8) sum = _mm256_add_ps(sum, _mm256_loadu_ps(x + m * K + k));
      x_sums[m * groups + g] = horizontal_sum(sum);
    }
  }
  const uint8_t* code_ptr = codes.data_ptr<uint8_t>();
  const S* scale_ptr = scales.data_ptr<S>();
  const S* offset_ptr = offsets.data_ptr<S>();
  at::parallel_for(0, N, 16, [&](int64_t begin, int64_t end) {
    for (int64_t m = 0; m < M; m += kMaxRows) {
      const int64_t count = std::min(kMaxRows, M - m);
      kGemv<S>[count - 1](x + m * K, K, x_sums.data() + m * groups, code_ptr, scale_ptr, offset_ptr, begin, end, K,
                          G, static_cast<int>(bits), out + m * N, N);
    }
  });
}

at::Tensor quant_gemv(const at::Tensor& x, const at::Tensor& codes, const at::Tensor& scales,
                      const at::Tensor& offsets, int64_t bits, int64_t group_size) {
  return tokenmill_quant::gemv_op(x, codes, scales, offsets, bits, group_size,
                                  [&](auto scale_type, const float* x32, int64_t M, int64_t K, float* out) {
                                    run<decltype(scale_type)>(x32, M, K, codes, scales, offsets, bits, group_size, out);
                                  });
}


// The batched loop of gemv_i8_rows_g32: tiles of 4 activation rows x NR output rows in registers
// (each output row's codes loaded and unpacked once for the 4 rows). ws: the NR rows' float
// scales, offsets: their code offsets ([NR, groups] each).
template <int NR, int BITS, bool TWO_PARTS>
inline void tile_i8_g32(const QuantizedActivations& a, int64_t m, const uint8_t* w, int64_t row_bytes,
                        const float* ws, const float* offsets, int64_t K, int64_t n, float* out, int64_t out_stride) {
  constexpr int MR = 4;
  const int64_t groups = K / 32, full = K - K % kChunk;
  const int8_t* q1 = a.q1.data() + m * K;
  const int8_t* q2 = TWO_PARTS ? a.q2.data() + m * K : nullptr;
  const float* sx = a.scale.data() + m * groups;
  const __m256i nibble = _mm256_set1_epi8(0x0F);
  __m256 acc[MR][NR];  // in registers as far as they go: the loops over r and j unrolled in full (outputs_g32)
#pragma GCC unroll 8
  for (int r = 0; r < MR; ++r)
#pragma GCC unroll 8
    for (int j = 0; j < NR; ++j) acc[r][j] = _mm256_setzero_ps();
  auto group = [&](const __m256i* codes, int64_t g) {
    const int64_t col = g * 32;
    __m256 w_scale[NR];
#pragma GCC unroll 8
    for (int j = 0; j < NR; ++j) w_scale[j] = _mm256_broadcast_ss(ws + j * groups + g);
#pragma GCC unroll 8
    for (int r = 0; r < MR; ++r) {
      const __m256 x_scale = _mm256_broadcast_ss(sx + r * groups + g);
#pragma GCC unroll 8
      for (int j = 0; j < NR; ++j) {
        acc[r][j] = add_group<BITS, TWO_PARTS>(codes[j], q1 + r * K + col, TWO_PARTS ? q2 + r * K + col : nullptr,
                                               _mm256_mul_ps(w_scale[j], x_scale), acc[r][j]);
      }
    }
  };
  for (int64_t c = 0; c < full; c += kChunk) {
    __m256i first[NR], second[NR];
#pragma GCC unroll 8
    for (int j = 0; j < NR; ++j) {
      if constexpr (BITS == 8) {
        first[j] = _mm256_loadu_si256(reinterpret_cast<const __m256i*>(w + j * row_bytes + c));
        second[j] = _mm256_loadu_si256(reinterpret_cast<const __m256i*>(w + j * row_bytes + c + 32));
      } else {
        const __m256i bytes = _mm256_loadu_si256(reinterpret_cast<const __m256i*>(w + j * row_bytes + c / 2));
        first[j] = _mm256_and_si256(bytes, nibble);
        second[j] = _mm256_and_si256(_mm256_srli_epi16(bytes, 4), nibble);
      }
    }
    group(first, c / 32);
    group(second, c / 32 + 1);
  }
  if (full < K) {  // a final 32-column chunk
    __m256i last[NR];
#pragma GCC unroll 8
    for (int j = 0; j < NR; ++j) last[j] = load_codes32(w + j * row_bytes, full, K, BITS);
    group(last, groups - 1);
  }
#pragma GCC unroll 8
  for (int r = 0; r < MR; ++r) {
#pragma GCC unroll 8
    for (int j = 0; j < NR; ++j) {
      out[(m + r) * out_stride + n + j] =
          finish_pair(acc[r][j], offsets + j * groups, a.sums.data() + (m + r) * groups, groups);
    }
  }
}

// Activation rows [0, rows) (a multiple of 4) against output rows [n_begin, n_end), in tiles.
template <int BITS, bool TWO_PARTS, typename S>
void gemm_i8_block_g32(const QuantizedActivations& a, int64_t rows, const uint8_t* codes, const S* scales,
                       const S* offsets, int64_t n_begin, int64_t n_end, int64_t K, float* out, int64_t out_stride) {
  const int64_t row_bytes = BITS == 8 ? K : K / 2, groups = K / 32, count = n_end - n_begin;
  std::vector<float> ws(count * groups), os(count * groups);
  for (int64_t i = 0; i < count; ++i) {  // the block's scales and code offsets as float32, once
    float* s = ws.data() + i * groups;
    float* o = os.data() + i * groups;
    to_float(scales + (n_begin + i) * groups, s, groups);
    to_float(offsets + (n_begin + i) * groups, o, groups);
    code_offsets<BITS>(o, s, groups, o);
  }
  for (int64_t m = 0; m < rows; m += 4) {
    int64_t i = 0;
    for (; i + 2 <= count; i += 2) {
      tile_i8_g32<2, BITS, TWO_PARTS>(a, m, codes + (n_begin + i) * row_bytes, row_bytes, ws.data() + i * groups,
                                      os.data() + i * groups, K, n_begin + i, out, out_stride);
    }
    if (i < count) {
      tile_i8_g32<1, BITS, TWO_PARTS>(a, m, codes + (n_begin + i) * row_bytes, row_bytes, ws.data() + i * groups,
                                      os.data() + i * groups, K, n_begin + i, out, out_stride);
    }
  }
}


template <typename S>
void run_i8(const QuantizedActivations& a, int64_t M, int64_t K, const at::Tensor& codes, const at::Tensor& scales,
            const at::Tensor& offsets, int64_t bits, int64_t G, bool two_parts, float* out) {
  const int64_t N = codes.size(0);
  const uint8_t* code_ptr = codes.data_ptr<uint8_t>();
  const S* scale_ptr = scales.data_ptr<S>();
  const S* offset_ptr = offsets.data_ptr<S>();
  if (M <= kMaxRows) {  // a few rows: one pass over the weights, straight from memory
    at::parallel_for(0, N, 16, [&](int64_t begin, int64_t end) {
      gemv_i8_fn<S>(M, bits, two_parts)(a, 0, code_ptr, scale_ptr, offset_ptr, begin, end, K, G, out, N);
    });
    return;
  }
  // Many rows: blocks of output rows whose codes stay in L1 while every activation row passes,
  // in 4 x 2 tiles where the groups are 32 columns wide; a remainder of rows goes the few-row way.
  const int64_t row_bytes = bits == 8 ? K : K / 2;
  const int64_t block = std::max<int64_t>(16, kBlockBytes / row_bytes / 2 * 2);
  const int64_t tiled = G == 32 ? M - M % 4 : 0;
  auto tiles = bits == 4 ? (two_parts ? gemm_i8_block_g32<4, true, S> : gemm_i8_block_g32<4, false, S>)
                         : (two_parts ? gemm_i8_block_g32<8, true, S> : gemm_i8_block_g32<8, false, S>);
  at::parallel_for(0, N, block, [&](int64_t begin, int64_t end) {
    for (int64_t n0 = begin; n0 < end; n0 += block) {
      const int64_t n1 = std::min(end, n0 + block);
      if (tiled) tiles(a, tiled, code_ptr, scale_ptr, offset_ptr, n0, n1, K, out, N);
      for (int64_t m = tiled; m < M; m += kMaxRows) {
        const int64_t count = std::min(kMaxRows, M - m);
        gemv_i8_fn<S>(count, bits, two_parts)(a, m, code_ptr, scale_ptr, offset_ptr, n0, n1, K, G, out + m * N, N);
      }
    }
  });
}

at::Tensor quant_gemv_i8(const at::Tensor& x, const at::Tensor& codes, const at::Tensor& scales,
                         const at::Tensor& offsets, int64_t bits, int64_t group_size, bool two_parts) {
  tokenmill_quant::check_arguments(x, codes, scales, offsets, bits, group_size);
  TORCH_CHECK(group_size % 32 == 0, "quant_gemv_i8: the group size must be a multiple of 32");
  const int64_t M = x.size(0), K = x.size(1), N = codes.size(0);
  const at::Tensor x32 = x.to(at::kFloat).contiguous();
  const QuantizedActivations a = quantize_activations(x32.data_ptr<float>(), M, K, group_size, two_parts);
  at::Tensor out = at::empty({M, N}, x.options().dtype(at::kFloat));
  if (scales.scalar_type() == at::kHalf) {
    run_i8<c10::Half>(a, M, K, codes, scales, offsets, bits, group_size, two_parts, out.data_ptr<float>());
  } else {
    run_i8<float>(a, M, K, codes, scales, offsets, bits, group_size, two_parts, out.data_ptr<float>());
  }
  return x.scalar_type() == at::kFloat ? out : out.to(x.scalar_type());
}

// ---- quant_dequantize -------------------------------------------------------------------------

// The whole weight [N, K] in `dtype`: w = s * u + o in float32, rounded once to T.
template <typename S, typename T>
void dequantize_rows(const at::Tensor& codes, const at::Tensor& scales, const at::Tensor& offsets, int64_t bits,
                     int64_t G, int64_t K, at::Tensor& out) {
  const int64_t N = codes.size(0), groups = K / G, row_bytes = bits == 8 ? K : K / 2;
  const uint8_t* code_ptr = codes.data_ptr<uint8_t>();
  const S* scale_ptr = scales.data_ptr<S>();
  const S* offset_ptr = offsets.data_ptr<S>();
  T* out_ptr = out.data_ptr<T>();
  at::parallel_for(0, N, 16, [&](int64_t begin, int64_t end) {
    std::vector<float> scale_buf(groups), offset_buf(groups), row(std::is_same_v<T, float> ? 0 : K);
    for (int64_t n = begin; n < end; ++n) {
      const float* s = as_float(scale_ptr + n * groups, scale_buf.data(), groups);
      const float* o = as_float(offset_ptr + n * groups, offset_buf.data(), groups);
      float* dst = std::is_same_v<T, float> ? reinterpret_cast<float*>(out_ptr + n * K) : row.data();
      for (int64_t c = 0; c < K; c += kChunk) {
        __m128i pieces[4];
        const int count = load_pieces(code_ptr + n * row_bytes, c, K, static_cast<int>(bits), pieces);
        for (int p = 0; p < count; ++p) {
          const int64_t col = c + 16 * p;
          const __m256 scale = _mm256_set1_ps(s[col / G]), offset = _mm256_set1_ps(o[col / G]);
          __m256 low, high;
          widen(pieces[p], low, high);
          _mm256_storeu_ps(dst + col, _mm256_fmadd_ps(low, scale, offset));
          _mm256_storeu_ps(dst + col + 8, _mm256_fmadd_ps(high, scale, offset));
        }
      }
      if constexpr (!std::is_same_v<T, float>) {
        for (int64_t k = 0; k < K; ++k) out_ptr[n * K + k] = static_cast<T>(row[k]);  // round to nearest even
      }
    }
  });
}

at::Tensor quant_dequantize(const at::Tensor& codes, const at::Tensor& scales, const at::Tensor& offsets, int64_t bits,
                            int64_t group_size, at::ScalarType dtype) {
  return tokenmill_quant::dequantize_op(codes, scales, offsets, bits, group_size, dtype,
                                        [&](auto scale_type, auto out_type, int64_t K, at::Tensor& out) {
                                          dequantize_rows<decltype(scale_type), decltype(out_type)>(
                                              codes, scales, offsets, bits, group_size, K, out);
                                        });
}

}  // namespace

TORCH_LIBRARY_FRAGMENT(tokenmill, m) {
  m.def(tokenmill_quant::kQuantGemvSchema);
  m.def(tokenmill_quant::kQuantDequantizeSchema);
  m.def("quant_gemv_i8(Tensor x, Tensor codes, Tensor scales, Tensor offsets, int bits, int group_size, "
        "bool two_parts) -> Tensor");
}

TORCH_LIBRARY_IMPL(tokenmill, CPU, m) {
  m.impl("quant_gemv", quant_gemv);
  m.impl("quant_dequantize", quant_dequantize);
  m.impl("quant_gemv_i8", quant_gemv_i8);
}
