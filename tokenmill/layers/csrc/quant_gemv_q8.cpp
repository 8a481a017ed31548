// Matrix-vector products with group-quantized weights and 8-bit activations, for x86 CPUs with
// AVX-512 VNNI: the same weight layout as quant_gemv.cpp, four times the multiply-adds per
// instruction. This is how llama.cpp runs its quantized types on these CPUs.
//
//   quant_gemv_q8(x [M, K], codes, scales [N, K/G], offsets [N, K/G], bits, G, two_parts) -> [M, N] in x's dtype
//
// Each activation row is quantized per group of G columns, the same groups as the weight's:
//   x[k] ~ d[g] * q[k],  d[g] = max |x| over the group / 127,  q int8
// and the group's exact float sum X[g] is kept. With w = s * u + o (u the unsigned code),
//   sum_k w[k] x[k] ~ sum_g  s[g] d[g] * sum_{k in g} u[k] q[k]   +   sum_g o[g] X[g]
// The inner integer sums are vpdpbusd (64 u8 x s8 products into 16 int32 lanes, lane l holding
// columns 4l..4l+3 of a 64-column chunk); each lane is scaled by its group's s * d, picked out
// of a vector of 16 groups' s * d by one permute. The only error is rounding the activations to
// 8 bits: |error| <= sum_g |s[g]| d[g] / 2 * sum_{k in g} u[k] (see tests/test_quantized.py).
//
// two_parts (what layers use by default): the rounding error is itself rounded to 8 bits,
// x ~ d q + (d / 254) q2, and both parts go through vpdpbusd: 254 times less error (~16-bit
// activations) for ~1.5x the arithmetic, which the weights' memory traffic hides at one row.
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

#if defined(__AVX512VNNI__)

constexpr int64_t kChunk = 64;   // columns per vpdpbusd (and per packed 4-bit chunk)
constexpr int64_t kMaxRows = 8;  // activation rows sharing one pass over the weights
constexpr int64_t kPrefetchRows = 8;  // how far ahead of the current output row its weights are fetched

using tokenmill_vec::load;  // n <= 16 elements as float32, zero past n

// Activations of one row, quantized per group: q (K rounded up to 64, zero past K), the
// group scales d and the groups' float sums X (groups rounded up to 16, zero past the end).
struct QuantizedRow {
  int8_t* q;
  int8_t* q2;  // two_parts: the rounding error of q, in steps of d / 254 (else nullptr)
  float* d;
  float* sums;
};

template <typename X>
void quantize_row(const X* x, int64_t K, int64_t G, QuantizedRow row) {
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
    for (int64_t k = g * G; k < (g + 1) * G; k += 16) {
      const __m512 steps = _mm512_mul_ps(load(x + k, 16), inverse);  // x / d
      const __m512i rounded = _mm512_cvtps_epi32(steps);
      _mm_storeu_si128(reinterpret_cast<__m128i*>(row.q + k), _mm512_cvtsepi32_epi8(rounded));
      if (row.q2 != nullptr) {  // (x / d - q) in [-1/2, 1/2], in 254ths
        const __m512 error = _mm512_mul_ps(_mm512_sub_ps(steps, _mm512_cvtepi32_ps(rounded)), _mm512_set1_ps(254.0f));
        _mm_storeu_si128(reinterpret_cast<__m128i*>(row.q2 + k), _mm512_cvtsepi32_epi8(_mm512_cvtps_epi32(error)));
      }
    }
  }
}

// The 64 (or, in a 32-column tail, 32 then zeros) codes of a chunk as bytes in column order.
inline __m512i load_codes(const uint8_t* row, int64_t chunk_start, int64_t width, int bits) {
  if (bits == 8) {
    if (width == kChunk) return _mm512_loadu_si512(row + chunk_start);
    return _mm512_zextsi256_si512(_mm256_loadu_si256(reinterpret_cast<const __m256i*>(row + chunk_start)));
  }
  const uint8_t* packed = row + chunk_start / 2;
  if (width == kChunk) {  // bytes 0-31: columns 0-31 in the low nibbles, 32-63 in the high ones
    const __m256i bytes = _mm256_loadu_si256(reinterpret_cast<const __m256i*>(packed));
    const __m512i both = _mm512_inserti64x4(_mm512_castsi256_si512(bytes), _mm256_srli_epi16(bytes, 4), 1);
    return _mm512_and_si512(both, _mm512_set1_epi8(0x0F));
  }
  const __m128i bytes = _mm_loadu_si128(reinterpret_cast<const __m128i*>(packed));  // 0-15 low, 16-31 high
  const __m128i nibble = _mm_set1_epi8(0x0F);
  const __m256i both = _mm256_set_m128i(_mm_and_si128(_mm_srli_epi16(bytes, 4), nibble), _mm_and_si128(bytes, nibble));
  return _mm512_zextsi256_si512(both);
}

// Output rows [n_begin, n_end) for ROWS activation rows, into out[r * out_stride + n - n_begin].
// Columns go in blocks of 16 groups: per block, each activation row's 16 lane scales s * d are one multiply; per chunk, lane l of
// the int32 sums takes the scale of group (64 c + 4 l) / G, picked by lane_index[c].
template <int ROWS, bool TWO_PARTS, typename S>
void gemv_rows(const QuantizedRow* x, const uint8_t* codes, const S* scales, const S* offsets, int64_t n_begin,
               int64_t n_end, int64_t K, int64_t G, int bits, const __m512i* lane_index, float* out, int64_t out_stride) {
  // Chunks go in pairs into two accumulators per row (a chain of multiply-adds waits on itself);
  // the indices are compile-time constants so that the accumulators stay in registers.
  constexpr int kAcc = ROWS <= 4 ? 2 : 1;
  const int64_t row_bytes = bits == 8 ? K : K / 2;
  const int64_t groups = K / G;
  const int64_t block_cols = 16 * G;
  for (int64_t n = n_begin; n < n_end; ++n) {
    const uint8_t* w = codes + n * row_bytes;
    const S* s = scales + n * groups;
    const S* o = offsets + n * groups;
    if (n + kPrefetchRows < n_end) {  // weights stream from memory: ask for them before they are due
      const char* ahead = reinterpret_cast<const char*>(w + kPrefetchRows * row_bytes);
      for (int64_t b = 0; b < row_bytes; b += 64) _mm_prefetch(ahead + b, _MM_HINT_T0);
      _mm_prefetch(reinterpret_cast<const char*>(s + kPrefetchRows * groups), _MM_HINT_T0);
      _mm_prefetch(reinterpret_cast<const char*>(o + kPrefetchRows * groups), _MM_HINT_T0);
    }
    __m512 acc[ROWS][kAcc];
    for (int r = 0; r < ROWS; ++r)
      for (int a = 0; a < kAcc; ++a) acc[r][a] = _mm512_setzero_ps();
    for (int64_t block = 0; block * block_cols < K; ++block) {
      const int64_t g0 = block * 16, count = std::min<int64_t>(16, groups - g0);
      const __m512 block_scales = load(s + g0, count);
      const __m512 block_offsets = load(o + g0, count);
      __m512 lane_scales[ROWS];
      for (int r = 0; r < ROWS; ++r) {
        lane_scales[r] = _mm512_mul_ps(block_scales, _mm512_loadu_ps(x[r].d + g0));
        acc[r][0] = _mm512_fmadd_ps(block_offsets, _mm512_loadu_ps(x[r].sums + g0), acc[r][0]);
      }
      const int64_t start = block * block_cols, end = std::min(K, start + block_cols);
      auto chunk = [&](int64_t c, __m512* row_acc[ROWS]) {
        const __m512i weights = load_codes(w, c, std::min(kChunk, K - c), bits);
        const __m512i index = lane_index[(c - start) / kChunk];
        for (int r = 0; r < ROWS; ++r) {
          const __m512i dots = _mm512_dpbusd_epi32(_mm512_setzero_si512(), weights,
                                                   _mm512_loadu_si512(x[r].q + c));
          __m512 sum = _mm512_cvtepi32_ps(dots);
          if constexpr (TWO_PARTS) {
            const __m512i low = _mm512_dpbusd_epi32(_mm512_setzero_si512(), weights,
                                                    _mm512_loadu_si512(x[r].q2 + c));
            sum = _mm512_fmadd_ps(_mm512_cvtepi32_ps(low), _mm512_set1_ps(1.0f / 254.0f), sum);
          }
          const __m512 scale = _mm512_permutexvar_ps(index, lane_scales[r]);
          *row_acc[r] = _mm512_fmadd_ps(sum, scale, *row_acc[r]);
        }
      };
      __m512* first[ROWS];
      __m512* second[ROWS];
      for (int r = 0; r < ROWS; ++r) {
        first[r] = &acc[r][0];
        second[r] = &acc[r][kAcc - 1];
      }
      int64_t c = start;
      for (; c + kChunk < end; c += 2 * kChunk) {
        chunk(c, first);
        chunk(c + kChunk, second);
      }
      if (c < end) chunk(c, first);
    }
    for (int r = 0; r < ROWS; ++r) {
      __m512 total = acc[r][0];
      for (int k = 1; k < kAcc; ++k) total = _mm512_add_ps(total, acc[r][k]);
      out[r * out_stride + n - n_begin] = _mm512_reduce_add_ps(total);
    }
  }
}

template <typename S>
using GemvFn = void (*)(const QuantizedRow*, const uint8_t*, const S*, const S*, int64_t, int64_t, int64_t,
                        int64_t, int, const __m512i*, float*, int64_t);
template <bool TWO, typename S>
constexpr GemvFn<S> kGemvFor[kMaxRows] = {gemv_rows<1, TWO, S>, gemv_rows<2, TWO, S>, gemv_rows<3, TWO, S>,
                                          gemv_rows<4, TWO, S>, gemv_rows<5, TWO, S>, gemv_rows<6, TWO, S>,
                                          gemv_rows<7, TWO, S>, gemv_rows<8, TWO, S>};

template <typename T>
void store_rows(const float* src, int64_t src_stride, T* dst, int64_t dst_stride, int64_t rows, int64_t begin,
                int64_t end) {
  for (int64_t r = 0; r < rows; ++r)
    for (int64_t n = begin; n < end; ++n) dst[r * dst_stride + n] = static_cast<T>(src[r * src_stride + n - begin]);
}

template <typename X, typename S>
void run(const at::Tensor& x, const at::Tensor& codes, const at::Tensor& scales, const at::Tensor& offsets,
         int64_t bits, int64_t G, bool two_parts, at::Tensor& out) {
  const int64_t M = x.size(0), K = x.size(1), N = codes.size(0);
  const int64_t k_padded = (K + kChunk - 1) / kChunk * kChunk;
  const int64_t groups_padded = (K / G + 15) / 16 * 16;
  std::vector<int8_t> q(M * k_padded, 0), q2(two_parts ? M * k_padded : 0, 0);
  std::vector<float> d(M * groups_padded, 0.0f), sums(M * groups_padded, 0.0f);
  std::vector<QuantizedRow> rows(M);
  for (int64_t m = 0; m < M; ++m) {
    rows[m] = {q.data() + m * k_padded, two_parts ? q2.data() + m * k_padded : nullptr,
               d.data() + m * groups_padded, sums.data() + m * groups_padded};
    quantize_row(x.data_ptr<X>() + m * K, K, G, rows[m]);
  }
  const GemvFn<S>* gemv = two_parts ? kGemvFor<true, S> : kGemvFor<false, S>;
  // lane l of chunk i of a 16-group block takes group (64 i + 4 l) / G of the block
  const int64_t chunks_per_block = 16 * G / kChunk;
  std::vector<__m512i> lane_index(chunks_per_block);
  for (int64_t i = 0; i < chunks_per_block; ++i) {
    alignas(64) int32_t lanes[16];
    for (int l = 0; l < 16; ++l) lanes[l] = static_cast<int32_t>((kChunk * i + 4 * l) / G);
    lane_index[i] = _mm512_load_si512(lanes);
  }
  const uint8_t* code_ptr = codes.data_ptr<uint8_t>();
  const S* scale_ptr = scales.data_ptr<S>();
  const S* offset_ptr = offsets.data_ptr<S>();
  const bool float_out = out.scalar_type() == at::kFloat;
  at::parallel_for(0, N, 16, [&](int64_t begin, int64_t end) {
    std::vector<float> local(float_out ? 0 : kMaxRows * (end - begin));
    for (int64_t m = 0; m < M; m += kMaxRows) {
      const int64_t count = std::min(kMaxRows, M - m);
      if (float_out) {
        gemv[count - 1](rows.data() + m, code_ptr, scale_ptr, offset_ptr, begin, end, K, G,
                            static_cast<int>(bits), lane_index.data(), out.data_ptr<float>() + m * N + begin, N);
        continue;
      }
      gemv[count - 1](rows.data() + m, code_ptr, scale_ptr, offset_ptr, begin, end, K, G,
                          static_cast<int>(bits), lane_index.data(), local.data(), end - begin);
      if (out.scalar_type() == at::kBFloat16) {
        store_rows(local.data(), end - begin, out.data_ptr<c10::BFloat16>() + m * N, N, count, begin, end);
      } else {
        store_rows(local.data(), end - begin, out.data_ptr<c10::Half>() + m * N, N, count, begin, end);
      }
    }
  });
}

template <typename X>
void run_for_scales(const at::Tensor& x, const at::Tensor& codes, const at::Tensor& scales,
                    const at::Tensor& offsets, int64_t bits, int64_t G, bool two_parts, at::Tensor& out) {
  if (scales.scalar_type() == at::kHalf) {
    run<X, c10::Half>(x, codes, scales, offsets, bits, G, two_parts, out);
  } else {
    run<X, float>(x, codes, scales, offsets, bits, G, two_parts, out);
  }
}

#endif  // __AVX512VNNI__

at::Tensor quant_gemv_q8(const at::Tensor& x_in, const at::Tensor& codes, const at::Tensor& scales,
                         const at::Tensor& offsets, int64_t bits, int64_t group_size, bool two_parts) {
#if defined(__AVX512VNNI__)
  tokenmill_quant::check_arguments(x_in, codes, scales, offsets, bits, group_size);
  const int64_t M = x_in.size(0), N = codes.size(0);
  const at::Tensor x = x_in.contiguous();
  at::Tensor out = at::empty({M, N}, x.options());
  switch (x.scalar_type()) {
    case at::kFloat: run_for_scales<float>(x, codes, scales, offsets, bits, group_size, two_parts, out); break;
    case at::kBFloat16:
      run_for_scales<c10::BFloat16>(x, codes, scales, offsets, bits, group_size, two_parts, out);
      break;
    case at::kHalf: run_for_scales<c10::Half>(x, codes, scales, offsets, bits, group_size, two_parts, out); break;
    default: TORCH_CHECK(false, "x must be float32, bfloat16 or float16");
  }
  return out;
#else
  TORCH_CHECK(false, "quant_gemv_q8 needs a CPU with AVX-512 VNNI");
#endif
}

}  // namespace

TORCH_LIBRARY_FRAGMENT(tokenmill, m) {
  m.def("quant_gemv_q8(Tensor x, Tensor codes, Tensor scales, Tensor offsets, int bits, int group_size, "
        "bool two_parts=False) -> Tensor");
}

TORCH_LIBRARY_IMPL(tokenmill, CPU, m) {
  m.impl("quant_gemv_q8", quant_gemv_q8);
}
