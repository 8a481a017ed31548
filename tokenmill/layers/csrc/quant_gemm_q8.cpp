// Many bf16 activation rows (prefill, large decode batches) times a group-quantized weight in the
// interleaved layout, on AVX-512 VNNI, with the activations rounded to 8 bits per group of the
// weight's (as llama.cpp's Q8 activations are):
//
//   quant_gemm_q8(x [M, K] bf16, codes, scales, offsets, bits, G, N) -> [M, N] bf16
//   quant_gemm_q8_silu_and_mul(x, codes, scales, offsets, bits, G, 2 I) -> [M, I] bf16
//     for a fused [gate; up] weight: silu(gate) * up from the tiles, the same bits as the product
//     followed by fused_ops' silu_and_mul, without writing and reading back the [M, 2 I] product
//     (~8% of a 16 x 256 prefill burst on the Zen 5)
//
// For CPUs without AMX, where csrc/quant_gemm.cpp's bf16 products are the bound: vdpbf16ps does 32
// multiply-adds an instruction, vpdpbusd 64. With x ~ d q per group (q in [-127, 127]), output n
// of row m is, summed over groups g,
//
//   s[n, g] d[m, g] sum_k u[n, k] q[m, k] + o[n, g] d[m, g] sum_k q[m, k]
//
// The offset term takes the rounded activations too, so that their rounding error meets the
// weight s u + o, centred, rather than s u alone (half the error on Q4_1-style weights).
// The threads take tasks (a run of output blocks, <= 256 KB of codes, in L2; a panel of 64 rows)
// from a shared counter, and a task runs 4 rows against 2 blocks in registers: 16 integer sums a
// group (two per row and block), then 8 float accumulators. The per-group float step (convert, two
// scales, the offset) is what keeps this from twice quant_gemm's speed (a third of the time goes
// to it): per group the tile issues 64 vpdpbusd and 24 float multiplies (a mul and two fmas per
// row and block, the fewest for these weights: each scale product is used once). On the Zen 5 the
// loop runs at ~0.65-0.7 of torch._int_mm's int8 rate, about what that count allows if the
// multiplies and vpdpbusd share two pipes (our reading of the measurements, not verified). On the AMD
// EPYC (Zen 5), interleaved A/B runs of the default model's four shapes: two chains and the
// unrolling ~1.3x the kernel with one chain a sum and the group size known at run time at 2,048
// rows, ~1.14x at 13 and 100 (README, "Against llama.cpp and vLLM").
#include <ATen/Parallel.h>
#include <ATen/core/Tensor.h>
#include <ATen/ops/empty.h>
#include <c10/util/BFloat16.h>
#include <c10/util/Half.h>
#include <immintrin.h>
#include <torch/library.h>

#include <algorithm>
#include <atomic>
#include <cstdint>
#include <memory>
#include <type_traits>

#include "fused_rows.h"
#include "quant_gemv_q8.h"
#include "quant_layout.h"

namespace {

#if defined(__AVX512VNNI__)
using namespace tokenmill_q8;

constexpr int64_t kRows = 4;           // activation rows in registers
constexpr int64_t kBlocks = 2;         // output blocks in registers
constexpr int64_t kChunkBytes = 256 << 10;  // at most this much of the codes a task (in L2)
constexpr int64_t kPanelRows = 64;      // rows a task (a multiple of kRows)
constexpr int64_t kTasksPerThread = 8;  // at least, where the shape allows

struct Activations {  // the rows quantized: q [M, K], d and d * sum q [M, K / G]
  const int8_t* q;
  const float* d;
  const float* sums;
  int64_t K, groups;
};

using tokenmill_vec::to_bf16;

// v rounded to bf16 and back.
inline __m512 round_to_bf16(__m512 v) {
  return _mm512_castsi512_ps(_mm512_slli_epi32(_mm512_cvtepu16_epi32(to_bf16(v)), 16));
}

// isum[r][n][P] += w[n] . the quad of row r at x (rows a stride apart), for every r and n.
template <int R, int NB, int P>
__attribute__((always_inline)) inline void multiply_quads(__m512i (&isum)[R][NB][2], const __m512i (&w)[NB],
                                                          const int8_t* x, int64_t stride) {
#pragma GCC unroll 8
  for (int r = 0; r < R; ++r) {
    const __m512i x4 = broadcast4(x + r * stride);
#pragma GCC unroll 8
    for (int n = 0; n < NB; ++n) isum[r][n][P] = _mm512_dpbusd_epi32(isum[r][n][P], w[n], x4);
  }
}

// Rows [m, m + R) against blocks b, b + step, ... (NB of them): out [R, 16 NB] (row stride N),
// outputs below N. SILU (NB = 2, a gate block and its up block): out [R, 16] is silu(gate) * up,
// each rounded to bf16 first, as the unfused product and silu_and_mul round them.
// FIXED_G > 0 is the group size known when compiling (32: every GGUF type but Q6_K, and ours), so
// that a group's multiply-adds unroll; each sum of a group runs in two halves (two chains of
// vpdpbusd: one chain waits on its latency), added before the float step. The unroll pragmas keep
// the accumulators in registers (without them GCC kept a copy of each on the stack).
template <int R, int NB, int BITS, int FIXED_G, bool SILU, typename S>
void tile(const Activations& a, int64_t m, int64_t runtime_g, const uint8_t* codes, const S* scales, const S* offsets,
          int64_t b, int64_t step, c10::BFloat16* out, int64_t N) {
  static_assert(!SILU || NB == 2, "a silu tile pairs one gate block with one up block");
  const int64_t G = FIXED_G > 0 ? FIXED_G : runtime_g;
  const int64_t groups = a.groups, group_bytes = kLanes * G * BITS / 8;
  const int8_t* q = a.q + m * a.K;
  const float* d = a.d + m * groups;
  const float* sums = a.sums + m * groups;
  const __m512i nibble = _mm512_set1_epi8(0x0F);
  __m512 acc[R][NB];
#pragma GCC unroll 8
  for (int r = 0; r < R; ++r)
#pragma GCC unroll 8
    for (int n = 0; n < NB; ++n) acc[r][n] = _mm512_setzero_ps();
  for (int64_t g = 0; g < groups; ++g) {
    __m512i isum[R][NB][2];
#pragma GCC unroll 8
    for (int r = 0; r < R; ++r)
#pragma GCC unroll 8
      for (int n = 0; n < NB; ++n) isum[r][n][0] = isum[r][n][1] = _mm512_setzero_si512();
    const int8_t* qg = q + g * G;
    const uint8_t* cg[NB];
#pragma GCC unroll 8
    for (int n = 0; n < NB; ++n) cg[n] = codes + ((b + n * step) * groups + g) * group_bytes;
    if constexpr (BITS == 4) {  // vector j: quad j in the low nibbles, quad j + G / 8 in the high ones
#pragma GCC unroll 8
      for (int64_t j = 0; j < G / 8; ++j) {
        __m512i low[NB], high[NB];
#pragma GCC unroll 8
        for (int n = 0; n < NB; ++n) {
          const __m512i v = _mm512_loadu_si512(cg[n] + 64 * j);
          low[n] = _mm512_and_si512(v, nibble);
          high[n] = _mm512_and_si512(_mm512_srli_epi16(v, 4), nibble);
        }
        multiply_quads<R, NB, 0>(isum, low, qg + 4 * j, a.K);
        multiply_quads<R, NB, 1>(isum, high, qg + 4 * (j + G / 8), a.K);
      }
    } else {  // G is a multiple of 16: quads in pairs
#pragma GCC unroll 8
      for (int64_t j = 0; j < G / 4; j += 2) {
        __m512i even[NB], odd[NB];
#pragma GCC unroll 8
        for (int n = 0; n < NB; ++n) {
          even[n] = _mm512_loadu_si512(cg[n] + 64 * j);
          odd[n] = _mm512_loadu_si512(cg[n] + 64 * (j + 1));
        }
        multiply_quads<R, NB, 0>(isum, even, qg + 4 * j, a.K);
        multiply_quads<R, NB, 1>(isum, odd, qg + 4 * (j + 1), a.K);
      }
    }
#pragma GCC unroll 8
    for (int n = 0; n < NB; ++n) {
      const __m512 s = load(scales + ((b + n * step) * groups + g) * kLanes, kLanes);
      const __m512 o = load(offsets + ((b + n * step) * groups + g) * kLanes, kLanes);
#pragma GCC unroll 8
      for (int r = 0; r < R; ++r) {
        const __m512i isum_rn = _mm512_add_epi32(isum[r][n][0], isum[r][n][1]);
        const __m512 dot = _mm512_mul_ps(_mm512_cvtepi32_ps(isum_rn), _mm512_set1_ps(d[r * groups + g]));
        acc[r][n] = _mm512_fmadd_ps(o, _mm512_set1_ps(sums[r * groups + g]), _mm512_fmadd_ps(dot, s, acc[r][n]));
      }
    }
  }
  if constexpr (SILU) {  // out has N = the intermediate size columns; blocks of 16 (no tail)
#pragma GCC unroll 8
    for (int r = 0; r < R; ++r) {
      const __m512 value = tokenmill_rows::silu_times(round_to_bf16(acc[r][0]), round_to_bf16(acc[r][1]));
      _mm256_storeu_si256(reinterpret_cast<__m256i*>(out + r * N + b * kLanes), to_bf16(value));
    }
  } else {
#pragma GCC unroll 8
    for (int n = 0; n < NB; ++n) {
      const int64_t n0 = (b + n) * kLanes, width = std::min<int64_t>(kLanes, N - n0);
      const __mmask16 keep = width == kLanes ? __mmask16(0xFFFF) : __mmask16((1u << width) - 1);
#pragma GCC unroll 8
      for (int r = 0; r < R; ++r) _mm256_mask_storeu_epi16(out + r * N + n0, keep, to_bf16(acc[r][n]));
    }
  }
}

// Rows [m, m + R) against the tiles of blocks [begin, end): pairs of neighbours, or (SILU) gate
// block b with its up block b + `step`.
template <int R, int BITS, int FIXED_G, bool SILU, typename S>
void blocks_for_rows(const Activations& a, int64_t m, int64_t G, const uint8_t* codes, const S* scales,
                     const S* offsets, int64_t begin, int64_t end, int64_t step, c10::BFloat16* out, int64_t N) {
  if constexpr (SILU) {
    for (int64_t b = begin; b < end; ++b)
      tile<R, 2, BITS, FIXED_G, true, S>(a, m, G, codes, scales, offsets, b, step, out, N);
  } else {
    int64_t b = begin;
    for (; b + kBlocks <= end; b += kBlocks)
      tile<R, kBlocks, BITS, FIXED_G, false, S>(a, m, G, codes, scales, offsets, b, 1, out, N);
    if (b < end) tile<R, 1, BITS, FIXED_G, false, S>(a, m, G, codes, scales, offsets, b, 1, out, N);
  }
}

// out [M, N] = the product, or (SILU) [M, N] = silu(gate) * up for the fused [gate; up] weight of
// 2 N rows. The work is cut into tasks of (a run of units, a panel of rows), a unit being two
// blocks' codes (a pair of neighbours, or a gate block and its up block), and the threads take
// tasks in turn from a shared counter: with a fixed share each, the first done waited at the end
// for the other (~8% of a prefill's time on the 2-core AMD EPYC here, whose cores do not run at one
// speed). A task's units are at most kChunkBytes of codes (in L2 while its rows pass), and few
// enough that every thread gets several tasks.
template <int BITS, int FIXED_G, bool SILU, typename S>
void run(const Activations& a, int64_t M, int64_t G, const at::Tensor& codes, const at::Tensor& scales,
         const at::Tensor& offsets, at::Tensor& out) {
  const int64_t N = out.size(1), blocks = SILU ? codes.size(0) / 2 : codes.size(0);
  const int64_t units = SILU ? blocks : (blocks + kBlocks - 1) / kBlocks;
  const uint8_t* code_ptr = codes.data_ptr<uint8_t>();
  const S* scale_ptr = scales.data_ptr<S>();
  const S* offset_ptr = offsets.data_ptr<S>();
  c10::BFloat16* out_ptr = out.data_ptr<c10::BFloat16>();
  const int64_t threads = at::get_num_threads();
  const int64_t panels = (M + kPanelRows - 1) / kPanelRows;
  const int64_t wanted_runs = std::max<int64_t>(1, (kTasksPerThread * threads + panels - 1) / panels);
  const int64_t unit_bytes = 2 * kLanes * a.K * BITS / 8;
  const int64_t per_task = std::clamp<int64_t>((units + wanted_runs - 1) / wanted_runs, 1,
                                               std::max<int64_t>(1, kChunkBytes / unit_bytes));
  const int64_t tasks = (units + per_task - 1) / per_task * panels;
  std::atomic<int64_t> next{0};
  at::parallel_for(0, threads, 1, [&](int64_t, int64_t) {
    for (int64_t task = next++; task < tasks; task = next++) {
      const int64_t u0 = task / panels * per_task, u1 = std::min(units, u0 + per_task);
      const int64_t b0 = SILU ? u0 : u0 * kBlocks, b1 = SILU ? u1 : std::min(blocks, u1 * kBlocks);
      const int64_t m_end = std::min(M, (task % panels + 1) * kPanelRows);
      int64_t m = task % panels * kPanelRows;
      for (; m + kRows <= m_end; m += kRows)
        blocks_for_rows<kRows, BITS, FIXED_G, SILU, S>(a, m, G, code_ptr, scale_ptr, offset_ptr, b0, b1, blocks,
                                                       out_ptr + m * N, N);
      for (; m < m_end; ++m)
        blocks_for_rows<1, BITS, FIXED_G, SILU, S>(a, m, G, code_ptr, scale_ptr, offset_ptr, b0, b1, blocks,
                                                   out_ptr + m * N, N);
    }
  });
}

#endif  // __AVX512VNNI__

// x [M, K] against the weight of `rows` outputs: [M, rows], or (silu) [M, rows / 2] = silu(gate) * up.
at::Tensor multiply(const at::Tensor& x_in, const at::Tensor& codes, const at::Tensor& scales,
                    const at::Tensor& offsets, int64_t bits, int64_t group_size, int64_t rows, bool silu) {
  TORCH_CHECK(x_in.dim() == 2 && x_in.scalar_type() == at::kBFloat16, "x must be a bfloat16 [M, K] matrix");
  tokenmill_quant::check_interleaved(x_in, codes, scales, offsets, bits, group_size, rows);
  TORCH_CHECK(!silu || rows % (2 * tokenmill_quant::kInterleavedLanes) == 0,
              "a fused [gate; up] weight needs a multiple of 32 rows");
#if defined(__AVX512VNNI__)
  const at::Tensor x = x_in.contiguous();
  const int64_t M = x.size(0), K = x.size(1), G = group_size, groups = K / G;
  // (not zero-filled: every element is written first)
  std::unique_ptr<int8_t[]> q(new int8_t[M * K]);
  std::unique_ptr<float[]> d(new float[M * groups]), sums(new float[M * groups]);
  const c10::BFloat16* xs = x.data_ptr<c10::BFloat16>();
  at::parallel_for(0, M, 16, [&](int64_t begin, int64_t end) {
    for (int64_t m = begin; m < end; ++m)
      quantize_row(xs + m * K, K, G, {q.get() + m * K, nullptr, d.get() + m * groups, sums.get() + m * groups});
  });
  const Activations a{q.get(), d.get(), sums.get(), K, groups};
  at::Tensor out = at::empty({M, silu ? rows / 2 : rows}, x.options());
  const bool half = scales.scalar_type() == at::kHalf;
  auto run_with = [&](auto bits_c, auto group_c, auto silu_c) {
    constexpr int B = decltype(bits_c)::value, FIXED_G = decltype(group_c)::value;
    constexpr bool SILU = decltype(silu_c)::value;
    half ? run<B, FIXED_G, SILU, c10::Half>(a, M, G, codes, scales, offsets, out)
         : run<B, FIXED_G, SILU, float>(a, M, G, codes, scales, offsets, out);
  };
  auto with_silu = [&](auto bits_c, auto group_c) {
    silu ? run_with(bits_c, group_c, std::true_type{}) : run_with(bits_c, group_c, std::false_type{});
  };
  using Four = std::integral_constant<int, 4>;
  using Eight = std::integral_constant<int, 8>;
  using Group32 = std::integral_constant<int, 32>;
  using AnyGroup = std::integral_constant<int, 0>;
  if (bits == 4)
    G == 32 ? with_silu(Four{}, Group32{}) : with_silu(Four{}, AnyGroup{});
  else
    G == 32 ? with_silu(Eight{}, Group32{}) : with_silu(Eight{}, AnyGroup{});
  return out;
#else
  TORCH_CHECK(false, "quant_gemm_q8 needs a CPU with AVX-512 VNNI");
#endif
}

at::Tensor quant_gemm_q8(const at::Tensor& x, const at::Tensor& codes, const at::Tensor& scales,
                         const at::Tensor& offsets, int64_t bits, int64_t group_size, int64_t rows) {
  return multiply(x, codes, scales, offsets, bits, group_size, rows, false);
}

at::Tensor quant_gemm_q8_silu_and_mul(const at::Tensor& x, const at::Tensor& codes, const at::Tensor& scales,
                                      const at::Tensor& offsets, int64_t bits, int64_t group_size, int64_t rows) {
  return multiply(x, codes, scales, offsets, bits, group_size, rows, true);
}

}  // namespace

TORCH_LIBRARY_FRAGMENT(tokenmill, m) {
  m.def("quant_gemm_q8(Tensor x, Tensor codes, Tensor scales, Tensor offsets, int bits, int group_size, int rows) "
        "-> Tensor");
  m.def("quant_gemm_q8_silu_and_mul(Tensor x, Tensor codes, Tensor scales, Tensor offsets, int bits, int group_size, "
        "int rows) -> Tensor");
}

TORCH_LIBRARY_IMPL(tokenmill, CPU, m) {
  m.impl("quant_gemm_q8", quant_gemm_q8);
  m.impl("quant_gemm_q8_silu_and_mul", quant_gemm_q8_silu_and_mul);
}
