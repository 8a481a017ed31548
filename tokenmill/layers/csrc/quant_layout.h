// Argument checks of the quantized-weight kernels (quant_gemv.cpp, quant_gemv_avx2.cpp, quant_gemv_q8.cpp,
// quant_gemm.cpp; layouts in layers/quantized.py), and the op wrappers quant_gemv.cpp and its AVX2 twin share,
// so that each rule is written once.
#pragma once
#include <ATen/core/Tensor.h>
#include <ATen/ops/empty.h>
#include <c10/util/BFloat16.h>
#include <c10/util/Half.h>

namespace tokenmill_quant {

constexpr int64_t kInterleavedLanes = 16;  // output rows per block of the interleaved layout

// x [M, K] in float32, bfloat16 or float16.
inline void check_activations(const at::Tensor& x) {
  TORCH_CHECK(x.dim() == 2, "x must be a [M, K] matrix");
  TORCH_CHECK(x.scalar_type() == at::kFloat || x.scalar_type() == at::kBFloat16 || x.scalar_type() == at::kHalf,
              "x must be float32, bfloat16 or float16");
}

inline void check_bits_and_group(int64_t bits, int64_t group_size) {
  TORCH_CHECK(bits == 4 || bits == 8, "bits must be 4 or 8");
  TORCH_CHECK(group_size > 0 && group_size % 16 == 0, "the group size must be a multiple of 16");
}

// offsets like scales, both contiguous float32 or both float16.
inline void check_scales(const at::Tensor& scales, const at::Tensor& offsets) {
  TORCH_CHECK((scales.scalar_type() == at::kFloat || scales.scalar_type() == at::kHalf) && scales.is_contiguous(),
              "scales must be contiguous float32 or float16");
  TORCH_CHECK(offsets.scalar_type() == scales.scalar_type() && offsets.is_contiguous() &&
              offsets.sizes() == scales.sizes(), "offsets must be like scales");
}

// The row layout of a [N, K] weight: codes uint8 [N, K] (8-bit) or [N, K / 2] (4-bit); scales and
// offsets [N, K / G].
inline void check_row_weight(const at::Tensor& codes, const at::Tensor& scales, const at::Tensor& offsets,
                             int64_t bits, int64_t group_size, int64_t K) {
  check_bits_and_group(bits, group_size);
  TORCH_CHECK(codes.scalar_type() == at::kByte && codes.is_contiguous() && codes.dim() == 2,
              "codes must be contiguous uint8 [N, bytes per row]");
  check_scales(scales, offsets);
  const int64_t N = codes.size(0);
  TORCH_CHECK(K % 32 == 0 && K % group_size == 0, "K must be a multiple of 32 and of the group size");
  TORCH_CHECK(codes.size(1) == (bits == 8 ? K : K / 2), "codes do not match K");
  TORCH_CHECK(scales.dim() == 2 && scales.size(0) == N && scales.size(1) == K / group_size,
              "scales must be [N, K / group_size]");
}

// x [M, K] against a weight in the row layout.
inline void check_arguments(const at::Tensor& x, const at::Tensor& codes, const at::Tensor& scales,
                            const at::Tensor& offsets, int64_t bits, int64_t group_size) {
  check_activations(x);
  check_row_weight(codes, scales, offsets, bits, group_size, x.size(1));
}

// A [N, K] weight in the interleaved layout (quant_gemv_q8.cpp).
inline void check_interleaved_weight(const at::Tensor& codes, const at::Tensor& scales, const at::Tensor& offsets,
                                     int64_t bits, int64_t G, int64_t N, int64_t K) {
  check_bits_and_group(bits, G);
  TORCH_CHECK(K % G == 0, "K must be a multiple of the group size");
  const int64_t blocks = (N + kInterleavedLanes - 1) / kInterleavedLanes;
  TORCH_CHECK(codes.scalar_type() == at::kByte && codes.is_contiguous() && codes.dim() == 3 &&
                  codes.size(0) == blocks && codes.size(1) == K / G && codes.size(2) == kInterleavedLanes * G * bits / 8,
              "codes must be contiguous uint8 [ceil(N / 16), K / G, 16 G bits / 8]");
  check_scales(scales, offsets);
  TORCH_CHECK(scales.dim() == 3 && scales.size(0) == blocks && scales.size(1) == K / G && scales.size(2) == kInterleavedLanes,
              "scales must be [ceil(N / 16), K / G, 16]");
}

// x [M, K] against a weight in the interleaved layout of N output rows.
inline void check_interleaved(const at::Tensor& x, const at::Tensor& codes, const at::Tensor& scales,
                              const at::Tensor& offsets, int64_t bits, int64_t G, int64_t N) {
  check_activations(x);
  check_interleaved_weight(codes, scales, offsets, bits, G, N, x.size(1));
}

// quant_gemv(x, codes, scales, offsets, bits, G) -> [M, N] in x's dtype: checks, x in float32, and
// run(S{}, x32, M, K, out32) for S the scales' type (float or c10::Half) fills the float32 result.
template <typename Run>
at::Tensor gemv_op(const at::Tensor& x, const at::Tensor& codes, const at::Tensor& scales, const at::Tensor& offsets,
                   int64_t bits, int64_t group_size, Run&& run) {
  check_arguments(x, codes, scales, offsets, bits, group_size);
  const int64_t M = x.size(0), K = x.size(1), N = codes.size(0);
  const at::Tensor x32 = x.to(at::kFloat).contiguous();
  at::Tensor out = at::empty({M, N}, x.options().dtype(at::kFloat));
  if (scales.scalar_type() == at::kHalf) {
    run(c10::Half{}, x32.data_ptr<float>(), M, K, out.data_ptr<float>());
  } else {
    run(float{}, x32.data_ptr<float>(), M, K, out.data_ptr<float>());
  }
  return x.scalar_type() == at::kFloat ? out : out.to(x.scalar_type());
}

// quant_dequantize(codes, scales, offsets, bits, G, dtype) -> the weight [N, K]: checks, and rows(S{}, T{}, K, out)
// for S the scales' type and T the output's fills it.
template <typename Rows>
at::Tensor dequantize_op(const at::Tensor& codes, const at::Tensor& scales, const at::Tensor& offsets, int64_t bits,
                         int64_t group_size, at::ScalarType dtype, Rows&& rows) {
  TORCH_CHECK(scales.dim() == 2, "scales must be [N, K / group_size]");
  const int64_t K = scales.size(1) * group_size;
  check_row_weight(codes, scales, offsets, bits, group_size, K);
  at::Tensor out = at::empty({codes.size(0), K}, scales.options().dtype(dtype));
  auto with_output = [&](auto scale_type) {
    switch (dtype) {
      case at::kFloat: rows(scale_type, float{}, K, out); break;
      case at::kBFloat16: rows(scale_type, c10::BFloat16{}, K, out); break;
      case at::kHalf: rows(scale_type, c10::Half{}, K, out); break;
      default: TORCH_CHECK(false, "quant_dequantize: dtype must be float32, bfloat16 or float16");
    }
  };
  if (scales.scalar_type() == at::kHalf) {
    with_output(c10::Half{});
  } else {
    with_output(float{});
  }
  return out;
}

constexpr const char* kQuantGemvSchema =
    "quant_gemv(Tensor x, Tensor codes, Tensor scales, Tensor offsets, int bits, int group_size) -> Tensor";
constexpr const char* kQuantDequantizeSchema =
    "quant_dequantize(Tensor codes, Tensor scales, Tensor offsets, int bits, int group_size, ScalarType dtype) -> Tensor";

}  // namespace tokenmill_quant
