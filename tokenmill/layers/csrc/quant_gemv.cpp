// Matrix-vector products with group-quantized weights for x86 CPUs with AVX-512: the few-row
// linears of decode (one stream or a handful) read 4- or 8-bit weights straight from memory.
//
//   quant_gemv(x [M, K], codes, scales [N, K/G], offsets [N, K/G], bits, G) -> [M, N]
//   quant_dequantize(codes, scales, offsets, bits, G, dtype) -> the weight [N, K] in dtype
//
// Weight n, column k, in group g = k / G:   w = scales[n, g] * u + offsets[n, g]
// where u is the unsigned code. Codes are stored by output row; 8-bit codes one byte each,
// 4-bit codes two per byte in chunks of 64 columns: byte j of a chunk holds column j (low nibble)
// and column j + 32 (high nibble); a final chunk of 32 columns holds j and j + 16 in 16 bytes.
//
// Each 16 codes become 16 float weights in registers (one fused multiply-add with their group's
// scale and offset), which then multiply-add into one accumulator per activation row: the
// activations stay in float32, so the result is the dequantized weight's product up to float32
// rounding. A single row is bound by reading the codes (0.5 or 1 byte per weight instead of 2
// for bf16); the conversion is shared by all rows of x.
#include <ATen/Parallel.h>
#include <ATen/core/Tensor.h>
#include <ATen/ops/empty.h>
#include <c10/util/BFloat16.h>
#include <c10/util/Half.h>
#include <immintrin.h>
#include <torch/library.h>

#include "quant_layout.h"
#include "vec_math.h"

#include <algorithm>
#include <cstdint>
#include <vector>

namespace {

constexpr int64_t kChunk = 64;    // columns per packed 4-bit chunk
constexpr int64_t kMaxRows = 8;   // activation rows sharing one pass over the weights

// The 64 (or, in a 32-column tail, 32) codes of a chunk as four (two) vectors of 16 int32.
inline int load_chunk(const uint8_t* row, int64_t chunk_start, int64_t width, int bits, __m512i q[4]) {
  if (bits == 8) {
    for (int j = 0; j < width / 16; ++j) {
      q[j] = _mm512_cvtepu8_epi32(_mm_loadu_si128(reinterpret_cast<const __m128i*>(row + chunk_start + 16 * j)));
    }
    return static_cast<int>(width / 16);
  }
  const uint8_t* packed = row + chunk_start / 2;
  if (width == kChunk) {  // bytes 0-31: columns 0-31 in the low nibbles, 32-63 in the high ones
    const __m256i nibble = _mm256_set1_epi8(0x0F);
    const __m256i bytes = _mm256_loadu_si256(reinterpret_cast<const __m256i*>(packed));
    const __m256i low = _mm256_and_si256(bytes, nibble);
    const __m256i high = _mm256_and_si256(_mm256_srli_epi16(bytes, 4), nibble);
    q[0] = _mm512_cvtepu8_epi32(_mm256_castsi256_si128(low));
    q[1] = _mm512_cvtepu8_epi32(_mm256_extracti128_si256(low, 1));
    q[2] = _mm512_cvtepu8_epi32(_mm256_castsi256_si128(high));
    q[3] = _mm512_cvtepu8_epi32(_mm256_extracti128_si256(high, 1));
    return 4;
  }
  // a 32-column tail, bytes 0-15: columns 0-15 low, 16-31 high
  const __m128i nibble = _mm_set1_epi8(0x0F);
  const __m128i bytes = _mm_loadu_si128(reinterpret_cast<const __m128i*>(packed));
  q[0] = _mm512_cvtepu8_epi32(_mm_and_si128(bytes, nibble));
  q[1] = _mm512_cvtepu8_epi32(_mm_and_si128(_mm_srli_epi16(bytes, 4), nibble));
  return 2;
}

// A row's group scales (or offsets) as float32: float16 ones converted 16 at a time into buf.
inline const float* as_float(const float* src, float*, int64_t) { return src; }
inline const float* as_float(const c10::Half* src, float* buf, int64_t n) {
  int64_t i = 0;
  for (; i + 16 <= n; i += 16) {
    _mm512_storeu_ps(buf + i, _mm512_cvtph_ps(_mm256_loadu_si256(reinterpret_cast<const __m256i*>(src + i))));
  }
  if (i < n) {
    const __mmask16 mask = static_cast<__mmask16>((1u << (n - i)) - 1);
    const __m256i halves = _mm256_maskz_loadu_epi16(mask, src + i);
    _mm512_mask_storeu_ps(buf + i, mask, _mm512_cvtph_ps(halves));
  }
  return buf;
}

// One output row at a time; ROWS activation rows share its codes. A single row keeps four
// independent accumulators (one per 16 columns of a chunk) so that the multiply-adds do not
// wait on each other; more rows are independent chains already.
template <int ROWS, typename S>
void gemv_rows(const float* x, int64_t x_stride, const uint8_t* codes, const S* scales, const S* offsets,
               int64_t n_begin, int64_t n_end, int64_t K, int64_t G, int bits, float* out, int64_t out_stride) {
  constexpr int kAcc = ROWS == 1 ? 4 : ROWS == 2 ? 2 : 1;
  const int64_t row_bytes = bits == 8 ? K : K / 2;
  const int64_t groups = K / G;
  const int64_t blocks_per_group = G / 16;
  std::vector<float> scale_buf(groups), offset_buf(groups);
  for (int64_t n = n_begin; n < n_end; ++n) {
    const uint8_t* w = codes + n * row_bytes;
    const float* s = as_float(scales + n * groups, scale_buf.data(), groups);
    const float* o = as_float(offsets + n * groups, offset_buf.data(), groups);
    __m512 acc[ROWS][kAcc];
    for (int r = 0; r < ROWS; ++r)
      for (int a = 0; a < kAcc; ++a) acc[r][a] = _mm512_setzero_ps();
    int64_t g = 0, blocks_left = blocks_per_group;  // the group of the current 16 columns (no division)
    for (int64_t c = 0; c < K; c += kChunk) {
      const int64_t width = std::min(kChunk, K - c);
      __m512i q[4];
      const int parts = load_chunk(w, c, width, bits, q);
      for (int j = 0; j < parts; ++j) {
        const int64_t col = c + 16 * j;
        const __m512 weight = _mm512_fmadd_ps(_mm512_cvtepi32_ps(q[j]), _mm512_set1_ps(s[g]), _mm512_set1_ps(o[g]));
        for (int r = 0; r < ROWS; ++r) {
          acc[r][j % kAcc] = _mm512_fmadd_ps(weight, _mm512_loadu_ps(x + r * x_stride + col), acc[r][j % kAcc]);
        }
        if (--blocks_left == 0) {
          ++g;
          blocks_left = blocks_per_group;
        }
      }
    }
    for (int r = 0; r < ROWS; ++r) {
      __m512 total = acc[r][0];
      for (int a = 1; a < kAcc; ++a) total = _mm512_add_ps(total, acc[r][a]);
      out[r * out_stride + n] = _mm512_reduce_add_ps(total);
    }
  }
}

template <typename S>
using GemvFn = void (*)(const float*, int64_t, const uint8_t*, const S*, const S*, int64_t, int64_t,
                        int64_t, int64_t, int, float*, int64_t);
template <typename S>
constexpr GemvFn<S> kGemv[kMaxRows] = {gemv_rows<1, S>, gemv_rows<2, S>, gemv_rows<3, S>, gemv_rows<4, S>,
                                       gemv_rows<5, S>, gemv_rows<6, S>, gemv_rows<7, S>, gemv_rows<8, S>};

template <typename S>
void run(const float* x, int64_t M, int64_t K, const at::Tensor& codes, const at::Tensor& scales,
         const at::Tensor& offsets, int64_t bits, int64_t group_size, float* out) {
  const int64_t N = codes.size(0);
  const uint8_t* code_ptr = codes.data_ptr<uint8_t>();
  const S* scale_ptr = scales.data_ptr<S>();
  const S* offset_ptr = offsets.data_ptr<S>();
  at::parallel_for(0, N, 16, [&](int64_t begin, int64_t end) {
    for (int64_t m = 0; m < M; m += kMaxRows) {
      const int64_t count = std::min(kMaxRows, M - m);
      kGemv<S>[count - 1](x + m * K, K, code_ptr, scale_ptr, offset_ptr, begin, end, K, group_size,
                          static_cast<int>(bits), out + m * N, N);
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

// The whole weight [N, K] in `dtype`: w = s * u + o, rounded once (what a load does to give the
// batched path its dense copy: ~10x PyTorch's unpack-convert-multiply-add).
template <typename S, typename T>
void dequantize_rows(const at::Tensor& codes, const at::Tensor& scales, const at::Tensor& offsets, int64_t bits,
                     int64_t G, int64_t K, at::Tensor& out) {
  const int64_t N = codes.size(0), groups = K / G, row_bytes = bits == 8 ? K : K / 2;
  const uint8_t* code_ptr = codes.data_ptr<uint8_t>();
  const S* scale_ptr = scales.data_ptr<S>();
  const S* offset_ptr = offsets.data_ptr<S>();
  T* out_ptr = out.data_ptr<T>();
  at::parallel_for(0, N, 16, [&](int64_t begin, int64_t end) {
    std::vector<float> scale_buf(groups), offset_buf(groups);
    for (int64_t n = begin; n < end; ++n) {
      const float* s = as_float(scale_ptr + n * groups, scale_buf.data(), groups);
      const float* o = as_float(offset_ptr + n * groups, offset_buf.data(), groups);
      for (int64_t c = 0; c < K; c += kChunk) {
        __m512i q[4];
        const int parts = load_chunk(code_ptr + n * row_bytes, c, std::min(kChunk, K - c), static_cast<int>(bits), q);
        for (int j = 0; j < parts; ++j) {
          const int64_t col = c + 16 * j, g = col / G;
          const __m512 w = _mm512_fmadd_ps(_mm512_cvtepi32_ps(q[j]), _mm512_set1_ps(s[g]), _mm512_set1_ps(o[g]));
          tokenmill_vec::store(out_ptr + n * K + col, w, 16);
        }
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
}

TORCH_LIBRARY_IMPL(tokenmill, CPU, m) {
  m.impl("quant_gemv", quant_gemv);
  m.impl("quant_dequantize", quant_dequantize);
}
