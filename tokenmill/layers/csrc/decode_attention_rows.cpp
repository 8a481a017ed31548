// Decode attention over the PyTorch path's cache layout (rows), for CPUs whose build lacks
// paged_decode.cpp (AVX2; cpu_kernels.py): one query token per sequence, keys and values read in
// place through the block table, in one op instead of the ~10 of TorchPagedAttention._decode.
// The caches hold q's dtype, or a 16-bit one under float32 queries (a float32 model's
// kv_cache_dtype float16 / bfloat16), widened as they are read.
//
//   decode_attention_rows(q [B, H, D] (rows may be strided), k_cache, v_cache [kv_heads, num_blocks, block_size, D],
//                         block_table int64 [B, >= ceil(max seq_len / block_size)], seq_lens int64 [B],
//                         scale) -> [B, H * D]
//
// Work is split over (sequence, kv head); the query heads of a kv head's group (GQA) share each
// key and value row read. Arithmetic is float32 (an exact softmax: max subtracted, std::exp), the
// output rounded once to q's dtype.
#include <ATen/Parallel.h>
#include <ATen/core/Tensor.h>
#include <ATen/ops/empty.h>
#include <c10/util/BFloat16.h>
#include <c10/util/Half.h>
#include <torch/library.h>

#include "vec_math.h"

#include <algorithm>
#include <cmath>
#include <cstdint>
#include <limits>
#include <vector>

namespace {

constexpr int64_t kMaxGroups = 8;  // query heads per kv head

template <typename T, typename C>  // T: queries and output, C: the caches
void attend(const T* q, int64_t q_stride, const C* k_cache, const C* v_cache, const int64_t* table, int64_t table_stride,
            const int64_t* seq_lens, T* out, int64_t B, int64_t H, int64_t kv_heads, int64_t num_blocks,
            int64_t block_size, int64_t D, float scale) {
  using namespace tokenmill_vec;
  const int64_t groups = H / kv_heads;
  at::parallel_for(0, B * kv_heads, 1, [&](int64_t begin, int64_t end) {
    std::vector<float> queries(groups * D), acc(groups * D), scores;
    for (int64_t task = begin; task < end; ++task) {
      const int64_t b = task / kv_heads, h = task % kv_heads, L = seq_lens[b];
      const T* qb = q + b * q_stride + h * groups * D;
      for (int64_t i = 0; i < groups * D; ++i) queries[i] = static_cast<float>(qb[i]) * scale;
      scores.assign(groups * L, 0.0f);
      auto row = [&](const C* cache, int64_t t) {
        const int64_t block = table[b * table_stride + t / block_size];
        return cache + ((h * num_blocks + block) * block_size + t % block_size) * D;
      };
      for (int64_t t = 0; t < L; ++t) {  // scores[g, t] = scale q_g . k_t
        const C* key = row(k_cache, t);
        Vec16 dots[kMaxGroups];
        for (int64_t g = 0; g < groups; ++g) dots[g] = zero();
        for (int64_t d = 0; d < D; d += 16) {
          const int64_t n = std::min<int64_t>(16, D - d);
          const Vec16 kv = load(key + d, n);
          for (int64_t g = 0; g < groups; ++g) dots[g] = fmadd(load(queries.data() + g * D + d, n), kv, dots[g]);
        }
        for (int64_t g = 0; g < groups; ++g) scores[g * L + t] = reduce_add(dots[g]);
      }
      for (int64_t g = 0; g < groups; ++g) {  // softmax over t
        float* s = scores.data() + g * L;
        const float top = *std::max_element(s, s + L);
        float total = 0.0f;
        for (int64_t t = 0; t < L; ++t) total += (s[t] = std::exp(s[t] - top));
        const float inverse = 1.0f / total;
        for (int64_t t = 0; t < L; ++t) s[t] *= inverse;
      }
      std::fill(acc.begin(), acc.end(), 0.0f);
      for (int64_t t = 0; t < L; ++t) {  // acc[g] += p[g, t] v_t
        const C* value = row(v_cache, t);
        for (int64_t d = 0; d < D; d += 16) {
          const int64_t n = std::min<int64_t>(16, D - d);
          const Vec16 v = load(value + d, n);
          for (int64_t g = 0; g < groups; ++g) {
            float* a = acc.data() + g * D + d;
            store(a, fmadd(set1(scores[g * L + t]), v, load(a, n)), n);
          }
        }
      }
      T* ob = out + (b * H + h * groups) * D;
      for (int64_t g = 0; g < groups; ++g) {
        for (int64_t d = 0; d < D; d += 16) {
          const int64_t n = std::min<int64_t>(16, D - d);
          store(ob + g * D + d, load(acc.data() + g * D + d, n), n);
        }
      }
    }
  });
}

at::Tensor decode_attention_rows(const at::Tensor& q, const at::Tensor& k_cache, const at::Tensor& v_cache,
                                 const at::Tensor& block_table, const at::Tensor& seq_lens, double scale) {
  TORCH_CHECK(q.dim() == 3 && q.stride(2) == 1 && q.stride(1) == q.size(2),
              "decode_attention_rows: q must be [B, H, D] with each row's heads contiguous");
  TORCH_CHECK(k_cache.dim() == 4 && k_cache.is_contiguous() && v_cache.sizes() == k_cache.sizes() &&
                  v_cache.is_contiguous(), "decode_attention_rows: caches must be contiguous [kv_heads, blocks, block_size, D]");
  TORCH_CHECK(v_cache.scalar_type() == k_cache.scalar_type() &&
                  (q.scalar_type() == k_cache.scalar_type() ||
                   (q.scalar_type() == at::kFloat && (k_cache.scalar_type() == at::kHalf ||
                                                      k_cache.scalar_type() == at::kBFloat16))),
              "decode_attention_rows: the caches must hold q's dtype, or a 16-bit one under float32 q");
  const int64_t B = q.size(0), H = q.size(1), D = q.size(2);
  const int64_t kv_heads = k_cache.size(0), num_blocks = k_cache.size(1), block_size = k_cache.size(2);
  TORCH_CHECK(k_cache.size(3) == D && H % kv_heads == 0 && H / kv_heads <= kMaxGroups,
              "decode_attention_rows: head shapes do not match (or more than 8 query heads per kv head)");
  TORCH_CHECK(block_table.scalar_type() == at::kLong && block_table.dim() == 2 && block_table.size(0) == B &&
                  block_table.stride(1) == 1, "decode_attention_rows: block_table must be int64 [B, max_blocks]");
  TORCH_CHECK(seq_lens.scalar_type() == at::kLong && seq_lens.dim() == 1 && seq_lens.size(0) == B &&
              seq_lens.is_contiguous(), "decode_attention_rows: seq_lens must be int64 [B]");
  const int64_t* lens = seq_lens.data_ptr<int64_t>();
  const int64_t* table = block_table.data_ptr<int64_t>();
  for (int64_t b = 0; b < B; ++b) {
    TORCH_CHECK(lens[b] > 0 && lens[b] <= block_table.size(1) * block_size,
                "decode_attention_rows: a sequence is longer than its block table");
    for (int64_t i = 0; i < (lens[b] + block_size - 1) / block_size; ++i) {
      const int64_t block = table[b * block_table.stride(0) + i];
      TORCH_CHECK(block >= 0 && block < num_blocks, "decode_attention_rows: block ", block, " is past the cache");
    }
  }
  at::Tensor out = at::empty({B, H * D}, q.options());
  const float s = static_cast<float>(scale);
  auto run = [&](auto q_type, auto cache_type) {
    using T = decltype(q_type);
    using C = decltype(cache_type);
    attend<T, C>(q.data_ptr<T>(), q.stride(0), k_cache.data_ptr<C>(), v_cache.data_ptr<C>(), table,
                 block_table.stride(0), lens, out.data_ptr<T>(), B, H, kv_heads, num_blocks, block_size, D, s);
  };
  switch (q.scalar_type()) {
    case at::kFloat:
      if (k_cache.scalar_type() == at::kHalf) run(float{}, c10::Half{});
      else if (k_cache.scalar_type() == at::kBFloat16) run(float{}, c10::BFloat16{});
      else run(float{}, float{});
      break;
    case at::kBFloat16: run(c10::BFloat16{}, c10::BFloat16{}); break;
    case at::kHalf: run(c10::Half{}, c10::Half{}); break;
    default: TORCH_CHECK(false, "decode_attention_rows: expected float32, bfloat16 or float16");
  }
  return out;
}

}  // namespace

TORCH_LIBRARY_FRAGMENT(tokenmill, m) {
  m.def("decode_attention_rows(Tensor q, Tensor k_cache, Tensor v_cache, Tensor block_table, Tensor seq_lens, "
        "float scale) -> Tensor");
}

TORCH_LIBRARY_IMPL(tokenmill, CPU, m) { m.impl("decode_attention_rows", decode_attention_rows); }
