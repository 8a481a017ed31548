// Decode attention over the PyTorch path's cache layout (rows), for CPUs whose build lacks
// paged_decode.cpp (AVX2; cpu_kernels.py): each query token attends to the first seq_lens[b] rows of
// its sequence (block_table[b]), keys and values read in place through the block table, in one op
// instead of the ~10 of TorchPagedAttention._decode. A decode step has one query per sequence; a
// step with prompt chunks passes each of their tokens as a query of its own (its position + 1
// rows), so that a prompt's rows are a decode step's, bit for bit, however it is cut.
// The caches hold q's dtype, or a 16-bit one under float32 queries (a float32 model's
// kv_cache_dtype float16 / bfloat16), widened as they are read.
//
//   decode_attention_rows(q [B, H, D] (rows may be strided), k_cache, v_cache [kv_heads, num_blocks, block_size, D],
//                         block_table int64 [B, >= ceil(max seq_len / block_size)], seq_lens int64 [B],
//                         scale) -> [B, H * D]
//
// write_kv_rows writes a step's new keys and values into those rows (attention.write_kv, as one op),
// and fused_decode_attention_rows does a decode step's rotary, KV write and attention in one.
//
// Work is split over (query, kv head), each one decode_rows.h's attend_item (which the fused AVX2
// decode step, decode_step_avx2.cpp, runs too); a few short sequences stay on the calling thread.
// The output is rounded once to q's dtype.
#include <ATen/Parallel.h>
#include <ATen/core/Tensor.h>
#include <ATen/ops/empty.h>
#include <c10/util/BFloat16.h>
#include <c10/util/Half.h>
#include <torch/library.h>

#include "decode_rows.h"
#include "fused_rows.h"
#include "vec_math.h"

#include <algorithm>
#include <cmath>
#include <cstdint>
#include <limits>
#include <type_traits>
#include <vector>

namespace {

using tokenmill_rows::kMaxGroups;
// below this many multiply-adds (sequence rows x query heads x D) a call runs on one thread
constexpr int64_t kInlineWork = 1 << 16;

// Runs fn(X{}, C{}) for rows of dtype x over caches of dtype cache: the same dtype, or a 16-bit
// cache under float32 rows; anything else is an error naming the op.
template <typename Fn>
void for_row_and_cache_types(at::ScalarType x, at::ScalarType cache, const char* op, Fn&& fn) {
  TORCH_CHECK(x == cache || (x == at::kFloat && (cache == at::kHalf || cache == at::kBFloat16)), op,
              ": the caches must hold the rows' dtype, or a 16-bit one under float32 rows");
  switch (x) {
    case at::kFloat:
      if (cache == at::kHalf) fn(float{}, c10::Half{});
      else if (cache == at::kBFloat16) fn(float{}, c10::BFloat16{});
      else fn(float{}, float{});
      break;
    case at::kBFloat16: fn(c10::BFloat16{}, c10::BFloat16{}); break;
    case at::kHalf: fn(c10::Half{}, c10::Half{}); break;
    default: TORCH_CHECK(false, op, ": expected float32, bfloat16 or float16");
  }
}

template <typename T, typename C>  // T: queries and output, C: the caches
void attend(const T* q, int64_t q_stride, const C* k_cache, const C* v_cache, const int64_t* table, int64_t table_stride,
            const int64_t* seq_lens, T* out, int64_t B, int64_t H, int64_t kv_heads, int64_t num_blocks,
            int64_t block_size, int64_t D, float scale) {
  const int64_t groups = H / kv_heads, head_stride = num_blocks * block_size * D;
  // (query, kv head) tasks split into one run of consecutive tasks per thread, each run about the
  // same work (rows read): a prompt's queries attend to 1..L rows each, so equal counts would leave
  // the first of two threads a quarter of the work. A few short sequences stay on the calling
  // thread: a parallel region costs more there.
  const int64_t tasks = B * kv_heads;
  std::vector<int64_t> ends(1, 0);  // ends[i]: one past the last task of run i
  int64_t work = 0;
  for (int64_t b = 0; b < B; ++b) work += seq_lens[b] * kv_heads;
  const int64_t runs = work * groups * D < kInlineWork ? 1 : std::min<int64_t>(at::get_num_threads(), tasks);
  for (int64_t task = 0, done = 0; task < tasks; ++task) {
    done += seq_lens[task / kv_heads];
    if (done * runs >= work * static_cast<int64_t>(ends.size())) ends.push_back(task + 1);
  }
  ends.back() = tasks;
  at::parallel_for(0, static_cast<int64_t>(ends.size()) - 1, 1, [&](int64_t first_run, int64_t last_run) {
    tokenmill_rows::AttentionScratch scratch;
    for (int64_t task = ends[first_run]; task < ends[last_run]; ++task) {
      const int64_t b = task / kv_heads, h = task % kv_heads;
      const tokenmill_rows::AttentionItem item{groups, D, seq_lens[b], block_size, table + b * table_stride, scale};
      tokenmill_rows::attend_item(item, q + b * q_stride + h * groups * D, k_cache + h * head_stride,
                                  v_cache + h * head_stride, out + (b * H + h * groups) * D, scratch);
    }
  });
}

at::Tensor decode_attention_rows(const at::Tensor& q, const at::Tensor& k_cache, const at::Tensor& v_cache,
                                 const at::Tensor& block_table, const at::Tensor& seq_lens, double scale) {
  TORCH_CHECK(q.dim() == 3 && q.stride(2) == 1 && q.stride(1) == q.size(2),
              "decode_attention_rows: q must be [B, H, D] with each row's heads contiguous");
  TORCH_CHECK(k_cache.dim() == 4 && k_cache.is_contiguous() && v_cache.sizes() == k_cache.sizes() &&
                  v_cache.is_contiguous(), "decode_attention_rows: caches must be contiguous [kv_heads, blocks, block_size, D]");
  TORCH_CHECK(v_cache.scalar_type() == k_cache.scalar_type(), "decode_attention_rows: the caches must be alike");
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
  for_row_and_cache_types(q.scalar_type(), k_cache.scalar_type(), "decode_attention_rows", [&](auto q_type, auto cache_type) {
    using T = decltype(q_type);
    using C = decltype(cache_type);
    attend<T, C>(q.data_ptr<T>(), q.stride(0), k_cache.data_ptr<C>(), v_cache.data_ptr<C>(), table,
                 block_table.stride(0), lens, out.data_ptr<T>(), B, H, kv_heads, num_blocks, block_size, D, s);
  });
  return out;
}

// write_kv_rows(k, v [T, kv_heads, D] (rows may be strided), k_cache, v_cache, write_index [kv_heads * T]):
// cache row write_index[h * T + t] (of the cache viewed as [-1, D]) = k[t, h] (v[t, h]), rounded to
// the cache's dtype: attention.write_kv's 8 PyTorch ops as one.
template <typename T, typename C>
void write_rows(const at::Tensor& x, C* cache, const int64_t* index, int64_t T_, int64_t heads, int64_t D) {
  const T* src = x.data_ptr<T>();
  for (int64_t h = 0; h < heads; ++h) {
    for (int64_t t = 0; t < T_; ++t) {
      tokenmill_rows::store_row(src + t * x.stride(0) + h * x.stride(1), cache + index[h * T_ + t] * D, D);
    }
  }
}

void write_kv_rows(const at::Tensor& k, const at::Tensor& v, const at::Tensor& k_cache, const at::Tensor& v_cache,
                   const at::Tensor& write_index) {
  TORCH_CHECK(k.dim() == 3 && v.sizes() == k.sizes() && k.stride(2) == 1 && v.stride(2) == 1,
              "write_kv_rows: k and v must be [T, kv_heads, D] with unit stride last");
  TORCH_CHECK(k_cache.dim() == 4 && k_cache.is_contiguous() && v_cache.sizes() == k_cache.sizes() &&
                  v_cache.is_contiguous() && v_cache.scalar_type() == k_cache.scalar_type(),
              "write_kv_rows: caches must be alike and contiguous [kv_heads, blocks, block_size, D]");
  TORCH_CHECK(k.scalar_type() == v.scalar_type(), "write_kv_rows: k and v must be alike");
  const int64_t T = k.size(0), heads = k.size(1), D = k.size(2);
  TORCH_CHECK(k_cache.size(0) == heads && k_cache.size(3) == D, "write_kv_rows: shapes do not match");
  TORCH_CHECK(write_index.scalar_type() == at::kLong && write_index.dim() == 1 && write_index.is_contiguous() &&
                  write_index.size(0) == heads * T, "write_kv_rows: write_index must be int64 [kv_heads * T]");
  const int64_t* index = write_index.data_ptr<int64_t>();
  const int64_t rows = k_cache.numel() / D;
  for (int64_t i = 0; i < heads * T; ++i) {
    TORCH_CHECK(index[i] >= 0 && index[i] < rows, "write_kv_rows: row ", index[i], " is past the cache");
  }
  for_row_and_cache_types(k.scalar_type(), k_cache.scalar_type(), "write_kv_rows", [&](auto x_type, auto cache_type) {
    using X = decltype(x_type);
    using C = decltype(cache_type);
    write_rows<X, C>(k, k_cache.data_ptr<C>(), index, T, heads, D);
    write_rows<X, C>(v, v_cache.data_ptr<C>(), index, T, heads, D);
  });
}

// fused_decode_attention_rows(qkv [B, (H + 2 kv_heads) D], H, kv_heads, positions [B], cos, sin,
//                             k_cache, v_cache, write_index [kv_heads * B], block_table, seq_lens, scale)
// A decode-only step's attention from the fused q/k/v projection, one token per sequence: rotary_
// on its q and k heads (in place), write_kv_rows, decode_attention_rows, bit for bit, in one op.
at::Tensor fused_decode_attention_rows(const at::Tensor& qkv, int64_t H, int64_t kv_heads, const at::Tensor& positions,
                                       const at::Tensor& cos, const at::Tensor& sin, const at::Tensor& k_cache,
                                       const at::Tensor& v_cache, const at::Tensor& write_index,
                                       const at::Tensor& block_table, const at::Tensor& seq_lens, double scale) {
  const int64_t D = k_cache.size(3), B = qkv.size(0);
  TORCH_CHECK(qkv.dim() == 2 && qkv.stride(1) == 1 && qkv.size(1) == (H + 2 * kv_heads) * D,
              "fused_decode_attention_rows: qkv must be [B, (H + 2 kv_heads) D] with unit column stride");
  TORCH_CHECK(positions.scalar_type() == at::kLong && positions.dim() == 1 && positions.size(0) == B &&
                  positions.is_contiguous(), "fused_decode_attention_rows: positions must be int64 [B]");
  TORCH_CHECK(D % 2 == 0 && cos.scalar_type() == at::kFloat && sin.scalar_type() == at::kFloat && cos.is_contiguous() &&
                  sin.is_contiguous() && cos.dim() == 2 && cos.size(1) == D && sin.sizes() == cos.sizes(),
              "fused_decode_attention_rows: cos and sin must be float32 [max_positions, D]");
  const int64_t* pos = positions.data_ptr<int64_t>();
  for (int64_t b = 0; b < B; ++b) {
    TORCH_CHECK(pos[b] >= 0 && pos[b] < cos.size(0), "fused_decode_attention_rows: position ", pos[b],
                " is past the table");
  }
  const at::Tensor heads = qkv.view({B, H + 2 * kv_heads, D});
  const at::Tensor q = heads.narrow(1, 0, H), k = heads.narrow(1, H, kv_heads), v = heads.narrow(1, H + kv_heads, kv_heads);
  auto rotate = [&](auto type) {
    using T = decltype(type);
    T* base = qkv.data_ptr<T>();
    for (int64_t b = 0; b < B; ++b) {
      for (int64_t h = 0; h < H + kv_heads; ++h) {
        tokenmill_rows::rotate_row(base + b * qkv.stride(0) + h * D, cos.data_ptr<float>() + pos[b] * D,
                                   sin.data_ptr<float>() + pos[b] * D, D);
      }
    }
  };
  switch (qkv.scalar_type()) {
    case at::kFloat: rotate(float{}); break;
    case at::kBFloat16: rotate(c10::BFloat16{}); break;
    case at::kHalf: rotate(c10::Half{}); break;
    default: TORCH_CHECK(false, "fused_decode_attention_rows: expected float32, bfloat16 or float16");
  }
  write_kv_rows(k, v, k_cache, v_cache, write_index);
  return decode_attention_rows(q, k_cache, v_cache, block_table, seq_lens, scale);
}

}  // namespace

TORCH_LIBRARY_FRAGMENT(tokenmill, m) {
  m.def("decode_attention_rows(Tensor q, Tensor k_cache, Tensor v_cache, Tensor block_table, Tensor seq_lens, "
        "float scale) -> Tensor");
  m.def("write_kv_rows(Tensor k, Tensor v, Tensor(a!) k_cache, Tensor(b!) v_cache, Tensor write_index) -> ()");
  m.def("fused_decode_attention_rows(Tensor(a!) qkv, int num_heads, int num_kv_heads, Tensor positions, Tensor cos, "
        "Tensor sin, Tensor(b!) k_cache, Tensor(c!) v_cache, Tensor write_index, Tensor block_table, Tensor seq_lens, "
        "float scale) -> Tensor");
}

TORCH_LIBRARY_IMPL(tokenmill, CPU, m) {
  m.impl("decode_attention_rows", decode_attention_rows);
  m.impl("write_kv_rows", write_kv_rows);
  m.impl("fused_decode_attention_rows", fused_decode_attention_rows);
}
