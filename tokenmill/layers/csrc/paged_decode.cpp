// Paged decode attention for x86 CPUs with AVX-512: one query token per sequence, keys and
// values read in place through the block table (no gathered copy of the context).
//
//   paged_decode_qk: scores[b, head, t] = scale * q[b, head] . K[b, t]   (-inf past the sequence)
//   paged_decode_pv: out[b, head] = sum_t probs[b, head, t] * V[b, t]
//   paged_decode:    the two with the softmax between them, one op
//   decode_attention: rotary and the KV write, then paged_decode, from the fused q/k/v (what a
//                    decode step calls)
// Work is split over (sequence, kv head): each
// cache block is read once for all query heads of its group (GQA). bf16 caches use the bf16 pair
// dot product (vdpbf16ps, or its two FMAs without AVX-512 BF16: vec_math.h's dot_bf16_pairs; fp32
// accumulation); other dtypes convert to fp32.
//
// Layouts, per layer (head_dim a multiple of 16):
//   values: [num_kv_heads, num_blocks, block_size, head_dim]        (rows, as PyTorch's path)
//   keys:   [num_kv_heads, num_blocks, head_dim / 2, block_size, 2] (pairs of dimensions, by column)
// Keys are stored by column so that one vector load holds dimension pair d of 16 consecutive
// tokens: q . K for 16 tokens is then head_dim / 2 multiply-adds into one vector of 16 scores,
// with no horizontal sums.
#include <ATen/Parallel.h>
#include <ATen/core/Tensor.h>
#include <ATen/ops/empty.h>
#include <c10/util/BFloat16.h>
#include <c10/util/Half.h>
#include <immintrin.h>
#include <ATen/core/dispatch/Dispatcher.h>
#include <torch/library.h>

#include <algorithm>
#include <cstdint>
#include <limits>
#include <type_traits>
#include <vector>

#include "paged_decode.h"
#include "vec_math.h"

namespace {

using namespace tokenmill_attention;

template <typename T>
void qk_kernel(const at::Tensor& q, const at::Tensor& k_cache, const at::Tensor& block_tables,
               const at::Tensor& seq_lens, float scale, at::Tensor& scores) {
  const Geometry g = geometry_of(k_cache, block_tables, q.size(0), q.size(1), scores.size(2));
  const int64_t* lens = seq_lens.data_ptr<int64_t>();
  at::parallel_for(0, g.batch * g.num_kv_heads, items_per_task(g), [&](int64_t begin, int64_t end) {
    for (int64_t item = begin; item < end; ++item) {
      const int64_t b = item / g.num_kv_heads, kv = item % g.num_kv_heads;
      float* out0 = scores.data_ptr<float>() + (b * g.num_heads + kv * g.groups) * g.context;
      qk_item(g, q.data_ptr<T>(), k_cache.data_ptr<T>(), block_tables.data_ptr<int64_t>(), b, kv,
              std::min(lens[b], g.context), scale, out0, g.context);
    }
  });
}

template <typename T>
void pv_kernel(const at::Tensor& probs, const at::Tensor& v_cache, const at::Tensor& block_tables,
               const at::Tensor& seq_lens, at::Tensor& out) {
  const Geometry g = geometry_of(v_cache, block_tables, probs.size(0), probs.size(1), probs.size(2));
  const int64_t* lens = seq_lens.data_ptr<int64_t>();
  at::parallel_for(0, g.batch * g.num_kv_heads, items_per_task(g), [&](int64_t begin, int64_t end) {
    for (int64_t item = begin; item < end; ++item) {
      const int64_t b = item / g.num_kv_heads, kv = item % g.num_kv_heads;
      const float* p0 = probs.data_ptr<float>() + (b * g.num_heads + kv * g.groups) * g.context;
      pv_item(g, p0, g.context, v_cache.data_ptr<T>(), block_tables.data_ptr<int64_t>(), b, kv,
              std::min(lens[b], g.context), out.data_ptr<T>());
    }
  });
}

at::Tensor paged_decode_qk(const at::Tensor& q, const at::Tensor& k_cache, const at::Tensor& block_tables,
                           const at::Tensor& seq_lens, double scale, int64_t context) {
  TORCH_CHECK(q.dim() == 3 && q.is_contiguous() && q.scalar_type() == k_cache.scalar_type(), "q: contiguous [batch, heads, head_dim], cache dtype");
  TORCH_CHECK(seq_lens.scalar_type() == at::kLong && seq_lens.is_contiguous(), "seq_lens must be contiguous int64");
  at::Tensor scores = at::empty({q.size(0), q.size(1), context}, q.options().dtype(at::kFloat));
  switch (q.scalar_type()) {
    case at::kBFloat16: qk_kernel<c10::BFloat16>(q, k_cache, block_tables, seq_lens, scale, scores); break;
    case at::kHalf: qk_kernel<c10::Half>(q, k_cache, block_tables, seq_lens, scale, scores); break;
    case at::kFloat: qk_kernel<float>(q, k_cache, block_tables, seq_lens, scale, scores); break;
    default: TORCH_CHECK(false, "unsupported dtype");
  }
  return scores;
}

at::Tensor paged_decode_pv(const at::Tensor& probs, const at::Tensor& v_cache, const at::Tensor& block_tables,
                           const at::Tensor& seq_lens) {
  TORCH_CHECK(probs.dim() == 3 && probs.is_contiguous() && probs.scalar_type() == at::kFloat, "probs: contiguous float32 [batch, heads, context]");
  TORCH_CHECK(seq_lens.scalar_type() == at::kLong && seq_lens.is_contiguous(), "seq_lens must be contiguous int64");
  at::Tensor out = at::empty({probs.size(0), probs.size(1), v_cache.size(3)}, v_cache.options());
  switch (v_cache.scalar_type()) {
    case at::kBFloat16: pv_kernel<c10::BFloat16>(probs, v_cache, block_tables, seq_lens, out); break;
    case at::kHalf: pv_kernel<c10::Half>(probs, v_cache, block_tables, seq_lens, out); break;
    case at::kFloat: pv_kernel<float>(probs, v_cache, block_tables, seq_lens, out); break;
    default: TORCH_CHECK(false, "unsupported dtype");
  }
  return out;
}

// Scores, softmax and values per (sequence, kv head) item in one parallel region, the scores in
// a buffer of the thread's own: a decode step calls this once per layer.
template <typename T>
void decode_kernel(const at::Tensor& q, const at::Tensor& k_cache, const at::Tensor& v_cache,
                   const at::Tensor& block_tables, const at::Tensor& seq_lens, float scale, int64_t context,
                   at::Tensor& out) {
  const Geometry g = geometry_of(k_cache, block_tables, q.size(0), q.size(1), context);
  TORCH_CHECK(v_cache.sizes() == k_cache.sizes() && v_cache.is_contiguous(), "v_cache must be like k_cache");
  const int64_t* lens = seq_lens.data_ptr<int64_t>();
  at::parallel_for(0, g.batch * g.num_kv_heads, items_per_task(g), [&](int64_t begin, int64_t end) {
    std::vector<float> scores(g.groups * g.context);
    for (int64_t item = begin; item < end; ++item) {
      const int64_t b = item / g.num_kv_heads, kv = item % g.num_kv_heads;
      const int64_t len = std::min(lens[b], g.context);
      qk_item(g, q.data_ptr<T>(), k_cache.data_ptr<T>(), block_tables.data_ptr<int64_t>(), b, kv, len, scale,
              scores.data(), g.context);
      for (int64_t h = 0; h < g.groups; ++h) softmax_row(scores.data() + h * g.context, len, g.context);
      pv_item(g, scores.data(), g.context, v_cache.data_ptr<T>(), block_tables.data_ptr<int64_t>(), b, kv, len,
              out.data_ptr<T>());
    }
  });
}

at::Tensor paged_decode(const at::Tensor& q, const at::Tensor& k_cache, const at::Tensor& v_cache,
                        const at::Tensor& block_tables, const at::Tensor& seq_lens, double scale, int64_t context) {
  TORCH_CHECK(q.dim() == 3 && q.is_contiguous() && q.scalar_type() == k_cache.scalar_type() &&
              v_cache.scalar_type() == k_cache.scalar_type(), "q: contiguous [batch, heads, head_dim], cache dtype");
  TORCH_CHECK(seq_lens.scalar_type() == at::kLong && seq_lens.is_contiguous(), "seq_lens must be contiguous int64");
  at::Tensor out = at::empty({q.size(0), q.size(1), v_cache.size(3)}, v_cache.options());
  switch (q.scalar_type()) {
    case at::kBFloat16: decode_kernel<c10::BFloat16>(q, k_cache, v_cache, block_tables, seq_lens, scale, context, out); break;
    case at::kHalf: decode_kernel<c10::Half>(q, k_cache, v_cache, block_tables, seq_lens, scale, context, out); break;
    case at::kFloat: decode_kernel<float>(q, k_cache, v_cache, block_tables, seq_lens, scale, context, out); break;
    default: TORCH_CHECK(false, "unsupported dtype");
  }
  return out;
}

// A decode step's attention from the fused q/k/v projection [T, (heads + 2 kv_heads) D], one op:
// rotary on q and k in place, the new k and v into the cache, then paged_decode. The steps are
// the same ops (called through the dispatcher from C++), so the result is theirs bit for bit.
at::Tensor decode_attention(const at::Tensor& qkv, int64_t num_heads, int64_t num_kv_heads, const at::Tensor& positions,
                            const at::Tensor& cos, const at::Tensor& sin, const at::Tensor& k_cache,
                            const at::Tensor& v_cache, const at::Tensor& slots, const at::Tensor& block_tables,
                            const at::Tensor& seq_lens, double scale, int64_t context) {
  const int64_t T = qkv.size(0), D = k_cache.size(3);
  TORCH_CHECK(qkv.dim() == 2 && qkv.stride(1) == 1 && qkv.size(1) == (num_heads + 2 * num_kv_heads) * D,
              "decode_attention: qkv must be [T, (heads + 2 kv_heads) head_dim] with unit column stride");
  static const auto rotary = c10::Dispatcher::singleton().findSchemaOrThrow("tokenmill::rotary_", "")
      .typed<void(const at::Tensor&, const at::Tensor&, const at::Tensor&, const at::Tensor&)>();
  static const auto write_kv = c10::Dispatcher::singleton().findSchemaOrThrow("tokenmill::write_kv", "")
      .typed<void(const at::Tensor&, const at::Tensor&, const at::Tensor&, const at::Tensor&, const at::Tensor&)>();
  const at::Tensor qk = qkv.narrow(1, 0, (num_heads + num_kv_heads) * D).view({T, num_heads + num_kv_heads, D});
  rotary.call(qk, positions, cos, sin);
  const at::Tensor v = qkv.narrow(1, (num_heads + num_kv_heads) * D, num_kv_heads * D).view({T, num_kv_heads, D});
  write_kv.call(qk.narrow(1, num_heads, num_kv_heads), v, k_cache, v_cache, slots);
  const at::Tensor q = qk.narrow(1, 0, num_heads).contiguous();
  return paged_decode(q, k_cache, v_cache, block_tables, seq_lens, scale, context).view({T, num_heads * D});
}

}  // namespace

TORCH_LIBRARY(tokenmill, m) {
  m.def("paged_decode_qk(Tensor q, Tensor k_cache, Tensor block_tables, Tensor seq_lens, float scale, int context) -> Tensor");
  m.def("paged_decode_pv(Tensor probs, Tensor v_cache, Tensor block_tables, Tensor seq_lens) -> Tensor");
  m.def("paged_decode(Tensor q, Tensor k_cache, Tensor v_cache, Tensor block_tables, Tensor seq_lens, float scale, "
        "int context) -> Tensor");
  m.def("decode_attention(Tensor(a!) qkv, int num_heads, int num_kv_heads, Tensor positions, Tensor cos, Tensor sin, "
        "Tensor(b!) k_cache, Tensor(c!) v_cache, Tensor slots, Tensor block_tables, Tensor seq_lens, float scale, "
        "int context) -> Tensor");
}

TORCH_LIBRARY_IMPL(tokenmill, CPU, m) {
  m.impl("paged_decode_qk", paged_decode_qk);
  m.impl("paged_decode_pv", paged_decode_pv);
  m.impl("paged_decode", paged_decode);
  m.impl("decode_attention", decode_attention);
}
