// One row of each of fused_ops.cpp's steps (what they compute: its header comment). The ops loop
// over rows with these, and the fused decode step (decode_step.cpp) calls them as they are, so that
// both compute the same values bit for bit.
#pragma once
#include <c10/util/BFloat16.h>
#include <c10/util/Half.h>

#include <algorithm>
#include <cmath>
#include <cstdint>
#include <cstring>

#include "vec_math.h"

namespace tokenmill_rows {

// y = w * r / rms(r) where r is x, or residual += x first (rounded to T) and r is the residual.
template <typename T, typename W>
inline void norm_row(const T* x, T* residual, const W* w, T* y, int64_t hidden, double eps) {
  using namespace tokenmill_vec;
  const T* r = residual != nullptr ? residual : x;
  Vec16 squares = zero();
  for (int64_t i = 0; i < hidden; i += 16) {
    const int64_t n = std::min<int64_t>(16, hidden - i);
    Vec16 v = load(x + i, n);
    if (residual != nullptr) {  // the sum squared as stored (reading it back stalled on the store)
      const Vec16 sum = add(load(residual + i, n), v);
      store(residual + i, sum, n);
      v = as_stored<T>(sum);
    }
    squares = fmadd(v, v, squares);
  }
  const float inv_rms = 1.0f / std::sqrt(reduce_add(squares) / static_cast<float>(hidden) + static_cast<float>(eps));
  const Vec16 scale = set1(inv_rms);
  for (int64_t i = 0; i < hidden; i += 16) {
    const int64_t n = std::min<int64_t>(16, hidden - i);
    store(y + i, mul(mul(load(r + i, n), scale), load(w + i, n)), n);
  }
}

// One head's row [D] rotated in place (rotate-half) by its position's float32 cos/sin rows [D].
template <typename S>
inline void rotate_row(S* row, const float* cos, const float* sin, int64_t D) {
  const int64_t half = D / 2;
  for (int64_t j = 0; j < half; ++j) {
    const float a = static_cast<float>(row[j]), b = static_cast<float>(row[j + half]);
    row[j] = static_cast<S>(a * cos[j] - b * sin[j]);
    row[j + half] = static_cast<S>(b * cos[j + half] + a * sin[j + half]);
  }
}

// silu(g) * u, lane by lane (quant_gemm_q8.cpp's fused [gate; up] tiles call it too).
inline tokenmill_vec::Vec16 silu_times(tokenmill_vec::Vec16 g, tokenmill_vec::Vec16 u) {
  using namespace tokenmill_vec;
  return mul(div(g, add(set1(1.0f), exp(sub(zero(), g)))), u);
}

// out[i] = silu(gate[i]) * gate[I + i] for i < I.
template <typename S>
inline void silu_and_mul_row(const S* gate, S* out, int64_t I) {
  using namespace tokenmill_vec;
  for (int64_t i = 0; i < I; i += 16) {
    const int64_t n = std::min<int64_t>(16, I - i);
    store(out + i, silu_times(load(gate + i, n), load(gate + I + i, n)), n);
  }
}

// pairs words from src (one after another) to dst, dst_stride bytes apart
template <typename Word>
inline void copy_pairs(const char* src, char* dst, int64_t pairs, int64_t dst_stride) {
  for (int64_t p = 0; p < pairs; ++p) {
    Word word;
    std::memcpy(&word, src + p * sizeof(Word), sizeof(Word));
    std::memcpy(dst + p * dst_stride, &word, sizeof(Word));
  }
}

// One token's key and value rows [D] of kv head h into the caches [kv_heads, blocks, block_size, D]
// at `slot` (values by row; keys by column, layouts in paged_decode.cpp); elem: bytes per value.
inline void write_kv_row(const char* key, const char* value, char* k_cache, char* v_cache, int64_t h, int64_t slot,
                         int64_t blocks, int64_t block_size, int64_t D, int64_t elem) {
  const int64_t block = slot / block_size, offset = slot % block_size;
  const int64_t head_block = (h * blocks + block) * block_size * D;  // element index of the block
  std::memcpy(v_cache + (head_block + offset * D) * elem, value, D * elem);
  // keys: dimension pair p of token `offset` sits at [p, offset, 0:2] of the block
  char* column = k_cache + (head_block + offset * 2) * elem;
  if (elem == 2) {  // a pair is one 32-bit word
    copy_pairs<uint32_t>(key, column, D / 2, block_size * 2 * elem);
  } else {
    copy_pairs<uint64_t>(key, column, D / 2, block_size * 2 * elem);
  }
}

}  // namespace tokenmill_rows
