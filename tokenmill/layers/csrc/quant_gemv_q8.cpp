// Matrix-vector products with group-quantized weights and 8-bit activations, for x86 CPUs with
// AVX-512 VNNI. The weights are in the interleaved layout (layers/quantized.py, interleave()),
// which puts 16 output rows side by side so that one vpdpbusd advances all 16 of them:
//
//   quant_gemv_q8(x [M, K], codes, scales [B, K/G, 16], offsets [B, K/G, 16], bits, G, N, two_parts) -> [M, N]
//   quant_rows_q8(codes, scales, offsets, bits, G, N, ids [T] int64, dtype) -> [T, K]
//     rows of the weight, w = s * u + o in one fused multiply-add rounded once to dtype, as
//     quant_dequantize does the row layout's: a tied model's embedding lookups
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
#include <cmath>
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

// out [T, K] = rows ids of the weight; codes of row n sit in block n / 16, lane n % 16 of each group.
template <typename S, typename T>
void rows_of(const at::Tensor& codes, const at::Tensor& scales, const at::Tensor& offsets, int64_t bits, int64_t G,
             const int64_t* ids, int64_t count, T* out) {
  const int64_t groups = codes.size(1), K = groups * G, group_bytes = codes.size(2), half = G / 8;
  const uint8_t* code_ptr = codes.data_ptr<uint8_t>();
  const S* scale_ptr = scales.data_ptr<S>();
  const S* offset_ptr = offsets.data_ptr<S>();
  at::parallel_for(0, count, 64, [&](int64_t begin, int64_t end) {
    for (int64_t t = begin; t < end; ++t) {
      const int64_t block = ids[t] / kLanes, lane = ids[t] % kLanes;
      for (int64_t g = 0; g < groups; ++g) {
        const uint8_t* quads = code_ptr + (block * groups + g) * group_bytes;
        const float s = static_cast<float>(scale_ptr[(block * groups + g) * kLanes + lane]);
        const float o = static_cast<float>(offset_ptr[(block * groups + g) * kLanes + lane]);
        for (int64_t c = 0; c < G; ++c) {  // column c of the group: byte c % 4 of quad c / 4, this lane's
          const int64_t quad = c / 4;
          int u;
          if (bits == 8) {
            u = quads[(quad * kLanes + lane) * 4 + c % 4];
          } else {  // quads j and j + G / 8 share bytes: low and high nibble
            const uint8_t byte = quads[((quad % half) * kLanes + lane) * 4 + c % 4];
            u = quad < half ? byte & 0xF : byte >> 4;
          }
          out[t * K + g * G + c] = static_cast<T>(std::fma(static_cast<float>(u), s, o));
        }
      }
    }
  });
}

#endif  // __AVX512VNNI__

at::Tensor quant_rows_q8(const at::Tensor& codes, const at::Tensor& scales, const at::Tensor& offsets, int64_t bits,
                         int64_t group_size, int64_t N, const at::Tensor& ids_in, at::ScalarType dtype) {
#if defined(__AVX512VNNI__)
  TORCH_CHECK(codes.dim() == 3, "codes must be [ceil(N / 16), K / G, 16 G bits / 8]");
  tokenmill_quant::check_interleaved_weight(codes, scales, offsets, bits, group_size, N, codes.size(1) * group_size);
  TORCH_CHECK(ids_in.scalar_type() == at::kLong && ids_in.dim() == 1, "ids must be int64 [T]");
  const at::Tensor ids = ids_in.contiguous();
  const int64_t* id_ptr = ids.data_ptr<int64_t>();
  for (int64_t t = 0; t < ids.size(0); ++t)
    TORCH_CHECK(id_ptr[t] >= 0 && id_ptr[t] < N, "quant_rows_q8: id ", id_ptr[t], " is not a row of the weight");
  at::Tensor out = at::empty({ids.size(0), codes.size(1) * group_size}, codes.options().dtype(dtype));
  auto with_scales = [&](auto out_type) {
    using T = decltype(out_type);
    if (scales.scalar_type() == at::kHalf) {
      rows_of<c10::Half, T>(codes, scales, offsets, bits, group_size, id_ptr, ids.size(0), out.data_ptr<T>());
    } else {
      rows_of<float, T>(codes, scales, offsets, bits, group_size, id_ptr, ids.size(0), out.data_ptr<T>());
    }
  };
  switch (dtype) {
    case at::kFloat: with_scales(float{}); break;
    case at::kBFloat16: with_scales(c10::BFloat16{}); break;
    case at::kHalf: with_scales(c10::Half{}); break;
    default: TORCH_CHECK(false, "quant_rows_q8: dtype must be float32, bfloat16 or float16");
  }
  return out;
#else
  TORCH_CHECK(false, "quant_rows_q8 needs a CPU with AVX-512 VNNI");
#endif
}

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
  m.def("quant_rows_q8(Tensor codes, Tensor scales, Tensor offsets, int bits, int group_size, int rows, Tensor ids, "
        "ScalarType dtype) -> Tensor");
}

TORCH_LIBRARY_IMPL(tokenmill, CPU, m) {
  m.impl("quant_gemv_q8", quant_gemv_q8);
  m.impl("quant_rows_q8", quant_rows_q8);
}
