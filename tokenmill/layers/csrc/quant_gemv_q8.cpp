// Matrix-vector products with group-quantized weights and 8-bit activations, for x86 CPUs with
// AVX-512 VNNI. The weights are in the interleaved layout (layers/quantized.py, interleave()),
// which puts 16 output rows side by side so that one vpdpbusd advances all 16 of them:
//
//   quant_gemv_q8(x [M, K], codes, scales [B, K/G, 16], offsets [B, K/G, 16], bits, G, N, two_parts) -> [M, N]
//
// Output rows go in B = ceil(N / 16) blocks of 16 (the last one padded with zero weights). Per
// block and group g of G input columns, the codes of the 16 rows come as G / 4 "quads" of 64
// bytes: byte 4 i + t of quad j is row i's code at column 4 j + t of the group, which is the
// operand layout of vpdpbusd (lane i sums row i's four products). 8-bit: the G / 4 quads one after
// another (16 G bytes). 4-bit: G / 8 vectors of 64 bytes, vector j holding quad j in its low
// nibbles and quad j + G / 8 in its high ones (8 G bytes). Lane i of scales/offsets is row i's.
//
// Each activation row is quantized per group, the weight's groups:
//   x[k] ~ d[g] * q[k],  d[g] = max |x| over the group / 127,  q int8
// and the group's exact float sum X[g] is kept. With w = s * u + o (u the unsigned code),
//   sum_k w[k] x[k] ~ sum_g  s[g] d[g] * sum_{k in g} u[k] q[k]   +   sum_g o[g] X[g]
// The integer sums over a group accumulate in int32 lanes (one per output row: no horizontal
// sums anywhere); each group then costs one conversion and two multiply-adds per 16 rows. The
// only error is rounding the activations to 8 bits:
//   |error| <= sum_g |s[g]| d[g] / 2 * sum_{k in g} u[k]   (see tests/test_quantized.py)
//
// two_parts (what layers use by default): the rounding error is itself rounded to 8 bits,
// x ~ d q + (d / 254) q2, and both parts go through vpdpbusd: 254 times less error (~16-bit
// activations). At one row the weights' memory traffic sets the pace either way.
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
#include <cstring>
#include <vector>

namespace {

constexpr int64_t kLanes = tokenmill_quant::kInterleavedLanes;  // output rows per block

#if defined(__AVX512VNNI__)

constexpr int64_t kPassRows = 4;   // activation rows per pass over a block (the rest: more passes, from L1)
// Codes are prefetched this many steps (of NB blocks) ahead: the hardware prefetchers alone left
// one row's stream of the weights at ~2/3 of the speed it reaches with them.
constexpr int64_t kPrefetchAhead = 2;

using tokenmill_vec::load;  // n <= 16 elements as float32

// Activations of one row, quantized per group: q [K], the group scales d and sums X [K / G].
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

// Four activation bytes (columns k .. k + 3) in every lane.
__attribute__((always_inline)) inline __m512i broadcast4(const int8_t* q) {
  int32_t quad;
  std::memcpy(&quad, q, sizeof(quad));
  return _mm512_set1_epi32(quad);
}

// Blocks [b_begin, b_end) for ROWS activation rows, NB blocks at a time (independent chains of
// multiply-adds: one waits on itself), into out[r * out_stride + 16 (b - b_begin) + i]. Each
// group's integer sums go into two accumulators per part (low and high nibbles, or even and odd
// quads), for the same reason.
template <int ROWS, int NB, bool TWO_PARTS, int BITS, typename S>
void gemv_blocks(const QuantizedRow* x, const uint8_t* codes, const S* scales, const S* offsets, int64_t b_begin,
                 int64_t b_end, int64_t groups, int64_t G, float* out, int64_t out_stride) {
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
      if (b + kPrefetchAhead * NB < b_end) {  // this group of the blocks two steps on (+30% at one row)
        for (int n = 0; n < NB; ++n)
          for (int64_t line = 0; line < group_bytes; line += 64)
            _mm_prefetch(reinterpret_cast<const char*>(codes + ((b + kPrefetchAhead * NB + n) * groups + g) * group_bytes +
                                                       line), _MM_HINT_T0);
      }
      if constexpr (BITS == 4) {
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
        for (int64_t j = 0; j < G / 4; ++j) {
          __m512i w[NB];
          for (int n = 0; n < NB; ++n) w[n] = _mm512_loadu_si512(codes + ((b + n) * groups + g) * group_bytes + 64 * j);
          for (int r = 0; r < ROWS; ++r) {
            for (int p = 0; p < kParts; ++p) {
              const __m512i qa = broadcast4((p == 0 ? x[r].q : x[r].q2) + col + 4 * j);
              for (int n = 0; n < NB; ++n) isum[r][n][p][j & 1] = _mm512_dpbusd_epi32(isum[r][n][p][j & 1], w[n], qa);
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
      gemv_blocks<ROWS, 1, TWO_PARTS, BITS, S>(x, codes, scales, offsets, b, b_end, groups, G,
                                               out + (b - b_begin) * kLanes, out_stride);
  }
}

template <typename S>
using GemvFn = void (*)(const QuantizedRow*, const uint8_t*, const S*, const S*, int64_t, int64_t, int64_t, int64_t,
                        float*, int64_t);

// Two blocks at a time while one or two rows leave registers for them.
template <int ROWS, bool TWO, typename S>
GemvFn<S> gemv_for(int64_t bits) {
  constexpr int NB = ROWS <= 2 ? 2 : 1;
  return bits == 8 ? gemv_blocks<ROWS, NB, TWO, 8, S> : gemv_blocks<ROWS, NB, TWO, 4, S>;
}

template <bool TWO, typename S>
GemvFn<S> select_gemv(int64_t rows, int64_t bits) {
  switch (rows) {
    case 1: return gemv_for<1, TWO, S>(bits);
    case 2: return gemv_for<2, TWO, S>(bits);
    case 3: return gemv_for<3, TWO, S>(bits);
    default: return gemv_for<4, TWO, S>(bits);
  }
}

template <typename T>
void store_rows(const float* src, int64_t src_stride, T* dst, int64_t dst_stride, int64_t rows, int64_t begin,
                int64_t end) {
  for (int64_t r = 0; r < rows; ++r)
    for (int64_t n = begin; n < end; ++n) dst[r * dst_stride + n] = static_cast<T>(src[r * src_stride + n - begin]);
}

template <typename X, typename S>
void run(const at::Tensor& x, const at::Tensor& codes, const at::Tensor& scales, const at::Tensor& offsets,
         int64_t bits, int64_t G, bool two_parts, at::Tensor& out) {
  const int64_t M = x.size(0), K = x.size(1), N = out.size(1);
  const int64_t groups = K / G, blocks = codes.size(0);
  std::vector<int8_t> q(M * K), q2(two_parts ? M * K : 0);
  std::vector<float> d(M * groups), sums(M * groups);
  std::vector<QuantizedRow> rows(M);
  for (int64_t m = 0; m < M; ++m) {
    rows[m] = {q.data() + m * K, two_parts ? q2.data() + m * K : nullptr, d.data() + m * groups,
               sums.data() + m * groups};
    quantize_row(x.data_ptr<X>() + m * K, K, G, rows[m]);
  }
  const uint8_t* code_ptr = codes.data_ptr<uint8_t>();
  const S* scale_ptr = scales.data_ptr<S>();
  const S* offset_ptr = offsets.data_ptr<S>();
  at::parallel_for(0, blocks, 4, [&](int64_t begin, int64_t end) {
    const int64_t width = (end - begin) * kLanes, n_end = std::min(N, end * kLanes);
    std::vector<float> local(kPassRows * width);
    for (int64_t m = 0; m < M; m += kPassRows) {
      const int64_t count = std::min(kPassRows, M - m);
      const GemvFn<S> gemv = two_parts ? select_gemv<true, S>(count, bits) : select_gemv<false, S>(count, bits);
      gemv(rows.data() + m, code_ptr, scale_ptr, offset_ptr, begin, end, groups, G, local.data(), width);
      switch (out.scalar_type()) {
        case at::kFloat:
          store_rows(local.data(), width, out.data_ptr<float>() + m * N, N, count, begin * kLanes, n_end);
          break;
        case at::kBFloat16:
          store_rows(local.data(), width, out.data_ptr<c10::BFloat16>() + m * N, N, count, begin * kLanes, n_end);
          break;
        default:
          store_rows(local.data(), width, out.data_ptr<c10::Half>() + m * N, N, count, begin * kLanes, n_end);
      }
    }
  });
}

#endif  // __AVX512VNNI__

at::Tensor quant_gemv_q8(const at::Tensor& x_in, const at::Tensor& codes, const at::Tensor& scales,
                         const at::Tensor& offsets, int64_t bits, int64_t group_size, int64_t N, bool two_parts) {
#if defined(__AVX512VNNI__)
  tokenmill_quant::check_interleaved(x_in, codes, scales, offsets, bits, group_size, N);
  const at::Tensor x = x_in.contiguous();
  at::Tensor out = at::empty({x.size(0), N}, x.options());
  const bool half_scales = scales.scalar_type() == at::kHalf;
  switch (x.scalar_type()) {
    case at::kFloat:
      half_scales ? run<float, c10::Half>(x, codes, scales, offsets, bits, group_size, two_parts, out)
                  : run<float, float>(x, codes, scales, offsets, bits, group_size, two_parts, out);
      break;
    case at::kBFloat16:
      half_scales ? run<c10::BFloat16, c10::Half>(x, codes, scales, offsets, bits, group_size, two_parts, out)
                  : run<c10::BFloat16, float>(x, codes, scales, offsets, bits, group_size, two_parts, out);
      break;
    default:
      half_scales ? run<c10::Half, c10::Half>(x, codes, scales, offsets, bits, group_size, two_parts, out)
                  : run<c10::Half, float>(x, codes, scales, offsets, bits, group_size, two_parts, out);
  }
  return out;
#else
  TORCH_CHECK(false, "quant_gemv_q8 needs a CPU with AVX-512 VNNI");
#endif
}

}  // namespace

TORCH_LIBRARY_FRAGMENT(tokenmill, m) {
  m.def("quant_gemv_q8(Tensor x, Tensor codes, Tensor scales, Tensor offsets, int bits, int group_size, int rows, "
        "bool two_parts=False) -> Tensor");
}

TORCH_LIBRARY_IMPL(tokenmill, CPU, m) {
  m.impl("quant_gemv_q8", quant_gemv_q8);
}
