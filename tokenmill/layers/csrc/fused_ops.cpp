// The small per-layer steps of a forward pass, one op each instead of 3-10 PyTorch ops: at decode
// the tensors are a few hundred elements and each op's fixed cost (~2-5 us of dispatch and
// allocation) is most of the time.
//
//   rms_norm(x [T, H], w [H], eps) -> y                y = w * x / rms(x)
//   add_rms_norm_(x, residual, w, eps) -> y            residual += x (in place); y = rms_norm(residual)
//   rotary_(x [T, heads, D], positions [T], cos, sin)  rotate-half rotary embedding, in place;
//                                                      cos/sin: float32 [max_positions, D] tables
//   silu_and_mul(x [T, 2I]) -> [T, I]                  silu(x[:, :I]) * x[:, I:]
//   argmax_rows(x [B, V] float32) -> int64 [B]         as x.argmax(-1), ~20x faster on CPU logits
//   apply_token_bitmask_(x [B, V] float32, rows [R], bitmask int32 [R, ceil(V / 32)])
//                                                      x[rows[r], t] = -inf where bit t of bitmask[r] is 0
//   write_kv(k [T, kv_heads, D], v, k_cache, v_cache, slots [T])
//                                                      the new keys and values into the paged cache
//                                                      (keys by column; layouts in paged_decode.cpp)
//
// Arithmetic is float32, rounded once to the tensors' dtype (float32, bfloat16 or float16); the
// residual sum is rounded before it is normalised, as the unfused PyTorch code does.
#include <ATen/Parallel.h>
#include <ATen/core/Tensor.h>
#include <ATen/ops/empty.h>
#include <c10/util/BFloat16.h>
#include <c10/util/Half.h>
#include <torch/library.h>

#include "fused_rows.h"
#include "vec_math.h"

#include <algorithm>
#include <cmath>
#include <cstdint>
#include <cstring>
#include <limits>
#include <vector>

namespace {

template <typename Fn>
void for_dtype(const at::Tensor& t, const char* name, Fn&& fn) {
  switch (t.scalar_type()) {
    case at::kFloat: fn(float{}); break;
    case at::kBFloat16: fn(c10::BFloat16{}); break;
    case at::kHalf: fn(c10::Half{}); break;
    default: TORCH_CHECK(false, name, ": expected float32, bfloat16 or float16");
  }
}

void check_rows(const at::Tensor& x, const at::Tensor& w, const char* name) {
  TORCH_CHECK(x.dim() == 2 && x.stride(1) == 1, name, ": x must be [T, H] with unit column stride");
  TORCH_CHECK(w.dim() == 1 && w.size(0) == x.size(1) && w.is_contiguous(), name, ": weight must be [H]");
}

template <typename T, typename W>
void norm_rows(const T* x, int64_t x_stride, T* residual, int64_t res_stride, const W* w, T* y, int64_t rows,
               int64_t hidden, double eps) {
  at::parallel_for(0, rows, 16, [&](int64_t begin, int64_t end) {
    for (int64_t t = begin; t < end; ++t)
      tokenmill_rows::norm_row(x + t * x_stride, residual == nullptr ? nullptr : residual + t * res_stride, w,
                               y + t * hidden, hidden, eps);
  });
}

#ifdef __AVX512F__  // (the AVX2 build has no argmax_rows or apply_token_bitmask_)
// Index of each row's largest value (the first of equals; NaN counts as largest, as torch.argmax).
at::Tensor argmax_rows(const at::Tensor& x) {
  TORCH_CHECK(x.dim() == 2 && x.scalar_type() == at::kFloat && x.stride(1) == 1 && x.size(1) > 0,
              "argmax_rows: x must be float32 [B, V] with unit column stride");
  const int64_t rows = x.size(0), cols = x.size(1);
  at::Tensor out = at::empty({rows}, x.options().dtype(at::kLong));
  const float* base = x.data_ptr<float>();
  int64_t* result = out.data_ptr<int64_t>();
  at::parallel_for(0, rows, 1, [&](int64_t begin, int64_t end) {
    for (int64_t b = begin; b < end; ++b) {
      const float* row = base + b * x.stride(0);
      __m512 best = _mm512_set1_ps(-std::numeric_limits<float>::infinity());
      __m512i best_index = _mm512_set1_epi32(-1);
      __m512i index = _mm512_setr_epi32(0, 1, 2, 3, 4, 5, 6, 7, 8, 9, 10, 11, 12, 13, 14, 15);
      for (int64_t i = 0; i < cols; i += 16) {
        const __mmask16 valid = tokenmill_vec::first(cols - i);
        const __m512 v = _mm512_maskz_loadu_ps(valid, row + i);
        // a lane's first value is taken; then strictly greater keeps its first maximum, and a NaN
        // beats anything but an earlier NaN
        const __mmask16 better = (_mm512_cmpeq_epi32_mask(best_index, _mm512_set1_epi32(-1)) |
                                  _mm512_cmp_ps_mask(v, best, _CMP_GT_OQ) |
                                  (_mm512_cmp_ps_mask(v, v, _CMP_UNORD_Q) & ~_mm512_cmp_ps_mask(best, best, _CMP_UNORD_Q))) & valid;
        best = _mm512_mask_mov_ps(best, better, v);
        best_index = _mm512_mask_mov_epi32(best_index, better, index);
        index = _mm512_add_epi32(index, _mm512_set1_epi32(16));
      }
      alignas(64) float values[16];
      alignas(64) int32_t indices[16];
      _mm512_store_ps(values, best);
      _mm512_store_si512(indices, best_index);
      int64_t pick = -1;
      for (int l = 0; l < 16; ++l) {
        if (indices[l] < 0) continue;
        if (pick < 0) { pick = l; continue; }
        const bool nan_l = std::isnan(values[l]), nan_p = std::isnan(values[pick]);
        const bool wins = nan_l ? (!nan_p || indices[l] < indices[pick])
                                : (!nan_p && (values[l] > values[pick] || (values[l] == values[pick] && indices[l] < indices[pick])));
        if (wins) pick = l;
      }
      result[b] = indices[pick];
    }
  });
  return out;
}

// Structured outputs: one pass of masked stores, 16 tokens a store; words with every bit set
// (inside a JSON string most tokens are allowed) cost one compare.
void apply_token_bitmask_(const at::Tensor& x, const at::Tensor& rows, const at::Tensor& bitmask) {
  TORCH_CHECK(x.dim() == 2 && x.scalar_type() == at::kFloat && x.stride(1) == 1,
              "apply_token_bitmask_: x must be float32 [B, V] with unit column stride");
  TORCH_CHECK(rows.dim() == 1 && rows.scalar_type() == at::kLong && rows.is_contiguous(),
              "apply_token_bitmask_: rows must be int64 [R]");
  const int64_t vocab = x.size(1), words = (vocab + 31) / 32;
  TORCH_CHECK(bitmask.dim() == 2 && bitmask.scalar_type() == at::kInt && bitmask.is_contiguous() &&
                  bitmask.size(0) == rows.size(0) && bitmask.size(1) == words,
              "apply_token_bitmask_: bitmask must be int32 [R, ceil(V / 32)]");
  const int64_t* row_ids = rows.data_ptr<int64_t>();
  for (int64_t r = 0; r < rows.size(0); ++r)
    TORCH_CHECK(0 <= row_ids[r] && row_ids[r] < x.size(0), "apply_token_bitmask_: row out of range");
  const uint32_t* bits = reinterpret_cast<const uint32_t*>(bitmask.data_ptr<int32_t>());
  float* base = x.data_ptr<float>();
  const __m512 minus_inf = _mm512_set1_ps(-std::numeric_limits<float>::infinity());
  at::parallel_for(0, rows.size(0), 1, [&](int64_t begin, int64_t end) {
    for (int64_t r = begin; r < end; ++r) {
      float* row = base + row_ids[r] * x.stride(0);
      const uint32_t* row_bits = bits + r * words;
      for (int64_t w = 0; w < words; ++w) {
        const uint32_t allowed = row_bits[w];
        if (allowed == 0xFFFFFFFFu) continue;
        const int64_t t = w * 32;
        const __mmask16 low = static_cast<__mmask16>(~allowed & 0xFFFF) & tokenmill_vec::first(vocab - t);
        _mm512_mask_storeu_ps(row + t, low, minus_inf);
        if (vocab - t > 16) {
          const __mmask16 high = static_cast<__mmask16>(~allowed >> 16) & tokenmill_vec::first(vocab - t - 16);
          _mm512_mask_storeu_ps(row + t + 16, high, minus_inf);
        }
      }
    }
  });
}

#endif

at::Tensor norm(const at::Tensor& x, const at::Tensor* residual, const at::Tensor& w, double eps) {
  at::Tensor y = at::empty(x.sizes(), x.options());
  for_dtype(x, "rms_norm", [&](auto xt) {
    using T = decltype(xt);
    T* res = residual == nullptr ? nullptr : residual->data_ptr<T>();
    const int64_t res_stride = residual == nullptr ? 0 : residual->stride(0);
    for_dtype(w, "rms_norm weight", [&](auto wt) {
      using W = decltype(wt);
      norm_rows<T, W>(x.data_ptr<T>(), x.stride(0), res, res_stride, w.data_ptr<W>(), y.data_ptr<T>(), x.size(0),
                      x.size(1), eps);
    });
  });
  return y;
}

at::Tensor rms_norm(const at::Tensor& x, const at::Tensor& w, double eps) {
  check_rows(x, w, "rms_norm");
  return norm(x, nullptr, w, eps);
}

at::Tensor add_rms_norm_(const at::Tensor& x, const at::Tensor& residual, const at::Tensor& w, double eps) {
  check_rows(x, w, "add_rms_norm_");
  TORCH_CHECK(residual.sizes() == x.sizes() && residual.stride(1) == 1 && residual.scalar_type() == x.scalar_type(),
              "add_rms_norm_: residual must be like x");
  return norm(x, &residual, w, eps);
}

void rotary_(const at::Tensor& x, const at::Tensor& positions, const at::Tensor& cos, const at::Tensor& sin) {
  TORCH_CHECK(x.dim() == 3 && x.stride(2) == 1, "rotary_: x must be [T, heads, head_dim] with unit stride last");
  TORCH_CHECK(positions.scalar_type() == at::kLong && positions.dim() == 1 && positions.size(0) == x.size(0) &&
              positions.is_contiguous(), "rotary_: positions must be int64 [T]");
  const int64_t T = x.size(0), heads = x.size(1), D = x.size(2);
  TORCH_CHECK(D % 2 == 0 && cos.scalar_type() == at::kFloat && sin.scalar_type() == at::kFloat &&
              cos.dim() == 2 && cos.size(1) == D && cos.is_contiguous() && sin.sizes() == cos.sizes() &&
              sin.is_contiguous(), "rotary_: cos and sin must be contiguous float32 [max_positions, head_dim]");
  const int64_t* pos = positions.data_ptr<int64_t>();
  for (int64_t t = 0; t < T; ++t) {
    TORCH_CHECK(pos[t] >= 0 && pos[t] < cos.size(0), "rotary_: position ", pos[t], " is past the table");
  }
  for_dtype(x, "rotary_", [&](auto xt) {
    using S = decltype(xt);
    S* base = x.data_ptr<S>();
    const float* c = cos.data_ptr<float>();
    const float* s = sin.data_ptr<float>();
    at::parallel_for(0, T * heads, 64, [&](int64_t begin, int64_t end) {
      for (int64_t i = begin; i < end; ++i) {
        const int64_t t = i / heads, h = i % heads;
        tokenmill_rows::rotate_row(base + t * x.stride(0) + h * x.stride(1), c + pos[t] * D, s + pos[t] * D, D);
      }
    });
  });
}

at::Tensor silu_and_mul(const at::Tensor& x) {
  TORCH_CHECK(x.dim() == 2 && x.stride(1) == 1 && x.size(1) % 2 == 0, "silu_and_mul: x must be [T, 2I]");
  const int64_t T = x.size(0), I = x.size(1) / 2;
  at::Tensor out = at::empty({T, I}, x.options());
  for_dtype(x, "silu_and_mul", [&](auto xt) {
    using S = decltype(xt);
    const S* in = x.data_ptr<S>();
    S* o = out.data_ptr<S>();
    at::parallel_for(0, T, 16, [&](int64_t begin, int64_t end) {
      for (int64_t t = begin; t < end; ++t) tokenmill_rows::silu_and_mul_row(in + t * x.stride(0), o + t * I, I);
    });
  });
  return out;
}

void write_kv(const at::Tensor& k, const at::Tensor& v, const at::Tensor& k_cache, const at::Tensor& v_cache,
              const at::Tensor& slots) {
  TORCH_CHECK(k.dim() == 3 && v.sizes() == k.sizes() && k.stride(2) == 1 && v.stride(2) == 1,
              "write_kv: k and v must be [T, kv_heads, head_dim] with unit stride last");
  TORCH_CHECK(k_cache.dim() == 4 && k_cache.is_contiguous() && v_cache.sizes() == k_cache.sizes() &&
              v_cache.is_contiguous(), "write_kv: caches must be contiguous [kv_heads, blocks, block_size, head_dim]");
  TORCH_CHECK(k.scalar_type() == k_cache.scalar_type() && v.scalar_type() == v_cache.scalar_type(),
              "write_kv: keys and values must have their cache's dtype");
  TORCH_CHECK(slots.scalar_type() == at::kLong && slots.dim() == 1 && slots.size(0) == k.size(0) &&
              slots.is_contiguous(), "write_kv: slots must be int64 [T]");
  const int64_t T = k.size(0), heads = k.size(1), D = k.size(2);
  const int64_t blocks = k_cache.size(1), block_size = k_cache.size(2);
  TORCH_CHECK(k_cache.size(0) == heads && k_cache.size(3) == D && D % 2 == 0, "write_kv: shapes do not match");
  const int64_t* slot = slots.data_ptr<int64_t>();
  for (int64_t t = 0; t < T; ++t) {
    TORCH_CHECK(slot[t] >= 0 && slot[t] < blocks * block_size, "write_kv: slot ", slot[t], " is past the cache");
  }
  const int64_t elem = k.element_size();
  const char* kp = static_cast<const char*>(k.data_ptr());
  const char* vp = static_cast<const char*>(v.data_ptr());
  char* kc = static_cast<char*>(k_cache.data_ptr());
  char* vc = static_cast<char*>(v_cache.data_ptr());
  at::parallel_for(0, T * heads, 64, [&](int64_t begin, int64_t end) {
    for (int64_t i = begin; i < end; ++i) {
      const int64_t t = i / heads, h = i % heads;
      tokenmill_rows::write_kv_row(kp + (t * k.stride(0) + h * k.stride(1)) * elem,
                                   vp + (t * v.stride(0) + h * v.stride(1)) * elem, kc, vc, h, slot[t], blocks,
                                   block_size, D, elem);
    }
  });
}

}  // namespace

TORCH_LIBRARY_FRAGMENT(tokenmill, m) {
  m.def("rms_norm(Tensor x, Tensor weight, float eps) -> Tensor");
  m.def("add_rms_norm_(Tensor x, Tensor(a!) residual, Tensor weight, float eps) -> Tensor");
  m.def("rotary_(Tensor(a!) x, Tensor positions, Tensor cos, Tensor sin) -> ()");
  m.def("silu_and_mul(Tensor x) -> Tensor");
#ifdef __AVX512F__
  m.def("argmax_rows(Tensor x) -> Tensor");
  m.def("apply_token_bitmask_(Tensor(a!) x, Tensor rows, Tensor bitmask) -> ()");
#endif
  m.def("write_kv(Tensor k, Tensor v, Tensor(a!) k_cache, Tensor(b!) v_cache, Tensor slots) -> ()");
}

TORCH_LIBRARY_IMPL(tokenmill, CPU, m) {
  m.impl("rms_norm", rms_norm);
  m.impl("add_rms_norm_", add_rms_norm_);
  m.impl("rotary_", rotary_);
  m.impl("silu_and_mul", silu_and_mul);
#ifdef __AVX512F__
  m.impl("argmax_rows", argmax_rows);
  m.impl("apply_token_bitmask_", apply_token_bitmask_);
#endif
  m.impl("write_kv", write_kv);
}
