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

#include "quant_gemv_q8.h"
#include "quant_layout.h"

#include <algorithm>
#include <cstdint>
#include <cstring>
#include <vector>

namespace {

#if defined(__AVX512VNNI__)
using namespace tokenmill_q8;

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
    std::vector<float> local(kPassRows * (end - begin) * kLanes);
    auto multiply = [&](auto* out_ptr) {
      multiply_blocks(rows.data(), M, code_ptr, scale_ptr, offset_ptr, bits, G, groups, two_parts, begin, end, N,
                      local.data(), out_ptr);
    };
    switch (out.scalar_type()) {
      case at::kFloat: multiply(out.data_ptr<float>()); break;
      case at::kBFloat16: multiply(out.data_ptr<c10::BFloat16>()); break;
      default: multiply(out.data_ptr<c10::Half>());
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
