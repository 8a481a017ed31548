// Causal attention of prompt chunks, bf16, on AVX-512 (vdpbf16ps where the CPU has AVX-512 BF16: 16
// lanes, each summing two bf16 products; elsewhere vec_math.h's dot_bf16_pairs, two FMAs):
//
//   prefill_attention_(out [T, H * D] bf16, q [T, H, D], k [T, Hkv, D], v [T, Hkv, D],
//                      starts int64 [C], lengths int64 [C], scale)
//     chunks with nothing cached (a fresh prefill), over their own keys and values;
//   paged_prefill_attention_(out, q, k_cache, v_cache [Hkv, blocks, block_size, D],
//                            block_table int64 [C, max_blocks], context_lens, starts, lengths int64 [C], scale)
//     chunks after context_lens[c] cached tokens, over the paged cache, their own keys and values
//     already written to it (cpu_attention.py's layout: keys by column, [D / 2][block_size][2] a
//     block, values by row).
//
// Both write the rows of the C chunks (rows starts[c] .. starts[c] + lengths[c] - 1) and no others;
// query i of a chunk sees keys 0 .. context + i. q, k and v may have any row stride (slices of the
// fused qkv projection); heads and columns must be contiguous. Query head h reads kv head h / (H / Hkv).
//
// First each (chunk, kv head)'s keys and values are re-laid out as the products want them:
//   keys   [L / 16 blocks][D / 2 column pairs][16 keys][2]: one vector = 16 keys' pair of columns
//   values [L / 2 key pairs][D][2]:                        one vector = 16 columns' pair of keys
// (zero past the chunk). Then each task takes kRows consecutive queries of one head: their
// scores against keys 0 .. last query (scores = vdpbf16ps over column pairs, float32, times
// scale), an exact softmax per row in float32 (max subtracted, masked past the row's own
// position), the probabilities rounded to bf16 in pairs of keys, and out = P V over pairs of
// keys, 64 columns of kRows rows in registers at a time; the output rounded once to bf16.
// Every step of a row is done in the order paged_decode.h does it for one decode query, so a
// prompt's row is the same bits whichever kernel computes it (a last chunk of one token goes
// through the decode path; preemption recomputes decoded tokens as a prompt).
// torch's flash SDPA for CPU ran these shapes (256 keys, 9 heads of 64) at ~45 GFLOP/s on the
// 2-core AMD EPYC here.
#include <ATen/Parallel.h>
#include <ATen/core/Tensor.h>
#include <ATen/ops/zeros_like.h>
#include <c10/util/BFloat16.h>
#include <immintrin.h>
#include <torch/library.h>

#include <algorithm>
#include <cstdint>
#include <cstring>
#include <limits>
#include <vector>

#include "vec_math.h"

namespace {

constexpr int64_t kRows = 4;     // queries per task, in registers together
constexpr int64_t kKeyBlock = 16;

struct Chunk {
  int64_t index, start, length, context;  // index: its place in the op's arguments (block table row)
  int64_t packed;                          // offset of its kv heads' re-laid keys / values
  int64_t keys() const { return context + length; }
};

inline int64_t padded(int64_t length) { return (length + 2 * kKeyBlock - 1) / (2 * kKeyBlock) * (2 * kKeyBlock); }

// L keys -> [Lp / 16][D / 2][16][2] and their values -> [Lp / 2][D][2], zero past L. key(j): key j's
// column pair 0 (pair p is pair_stride further on); value(j): value j's row.
template <typename Key, typename Value>
void pack(Key key, int64_t pair_stride, Value value, int64_t L, int64_t D, uint16_t* keys, uint16_t* values) {
  const int64_t Lp = padded(L);
  std::memset(keys, 0, Lp * D * sizeof(uint16_t));
  std::memset(values, 0, Lp * D * sizeof(uint16_t));
  for (int64_t j = 0; j < L; ++j) {
    const uint16_t* kr = key(j);
    const uint16_t* vr = value(j);
    uint16_t* kb = keys + (j / kKeyBlock) * kKeyBlock * D + (j % kKeyBlock) * 2;
    for (int64_t p = 0; p < D / 2; ++p) {
      kb[p * 2 * kKeyBlock] = kr[p * pair_stride];
      kb[p * 2 * kKeyBlock + 1] = kr[p * pair_stride + 1];
    }
    uint16_t* vp = values + (j / 2) * 2 * D + (j % 2);
    for (int64_t d = 0; d < D; ++d) vp[2 * d] = vr[d];
  }
}

using tokenmill_vec::dot_bf16_pairs;
using tokenmill_vec::to_bf16;

inline __m512i pair_of(const uint16_t* p) {
  int32_t pair;
  std::memcpy(&pair, p, sizeof(pair));
  return _mm512_set1_epi32(pair);
}

// Scores of R queries (rows q + r * q_stride) against key blocks [0, blocks): S [R][blocks * 16].
// Even and odd column pairs go into two chains added at the end, then times scale: the order
// paged_decode.h's scores16 and qk_item use, so that a row here is bit for bit a decode step's.
template <int R>
void scores(const uint16_t* q, int64_t q_stride, const uint16_t* keys, int64_t blocks, int64_t D, float scale,
            float* S, int64_t s_stride) {
  const __m512 scaled = _mm512_set1_ps(scale);
  int64_t b = 0;
  for (; b + 2 <= blocks; b += 2) {
    __m512 acc[R][2][2];  // [query][key block][even / odd pairs]
    for (int r = 0; r < R; ++r)
      for (int i = 0; i < 2; ++i) acc[r][i][0] = acc[r][i][1] = _mm512_setzero_ps();
    const uint16_t* k0 = keys + b * kKeyBlock * D;
    const uint16_t* k1 = k0 + kKeyBlock * D;
    for (int64_t p = 0; p < D / 2; p += 2) {
      __m512i w[2][2];
      for (int e = 0; e < 2; ++e) {
        w[0][e] = _mm512_loadu_si512(k0 + (p + e) * 2 * kKeyBlock);
        w[1][e] = _mm512_loadu_si512(k1 + (p + e) * 2 * kKeyBlock);
      }
      for (int r = 0; r < R; ++r)
        for (int e = 0; e < 2; ++e) {
          const __m512i x = pair_of(q + r * q_stride + 2 * (p + e));
          acc[r][0][e] = dot_bf16_pairs(acc[r][0][e], w[0][e], x);
          acc[r][1][e] = dot_bf16_pairs(acc[r][1][e], w[1][e], x);
        }
    }
    for (int r = 0; r < R; ++r)
      for (int i = 0; i < 2; ++i)
        _mm512_storeu_ps(S + r * s_stride + (b + i) * kKeyBlock,
                         _mm512_mul_ps(_mm512_add_ps(acc[r][i][0], acc[r][i][1]), scaled));
  }
  if (b < blocks) {
    __m512 acc[R][2];
    for (int r = 0; r < R; ++r) acc[r][0] = acc[r][1] = _mm512_setzero_ps();
    const uint16_t* k0 = keys + b * kKeyBlock * D;
    for (int64_t p = 0; p < D / 2; p += 2)
      for (int e = 0; e < 2; ++e) {
        const __m512i w0 = _mm512_loadu_si512(k0 + (p + e) * 2 * kKeyBlock);
        for (int r = 0; r < R; ++r)
          acc[r][e] = dot_bf16_pairs(acc[r][e], w0, pair_of(q + r * q_stride + 2 * (p + e)));
      }
    for (int r = 0; r < R; ++r)
      _mm512_storeu_ps(S + r * s_stride + b * kKeyBlock, _mm512_mul_ps(_mm512_add_ps(acc[r][0], acc[r][1]), scaled));
  }
}

// Row r's scores over keys [0, n) -> its bf16 probabilities over [0, n_pad), zero past n: as
// paged_decode.h's softmax_row and pv_rows_bf16 make them (the same sum of exp(s - max) in the
// same order, normalized in float32, then rounded), so that a row here is bit for bit a decode step's.
inline void softmax_row(float* s, int64_t n, int64_t n_pad, uint16_t* p) {
  using tokenmill_vec::first;
  __m512 top = _mm512_set1_ps(-std::numeric_limits<float>::infinity());
  for (int64_t j = 0; j < n; j += 16) top = _mm512_mask_max_ps(top, first(n - j), top, _mm512_loadu_ps(s + j));
  const __m512 max = _mm512_set1_ps(_mm512_reduce_max_ps(top));
  __m512 sum = _mm512_setzero_ps();
  for (int64_t j = 0; j < n_pad; j += 16) {
    const __mmask16 keep = j < n ? first(n - j) : __mmask16(0);
    const __m512 e = _mm512_maskz_mov_ps(keep, tokenmill_vec::exp(_mm512_sub_ps(_mm512_loadu_ps(s + j), max)));
    sum = _mm512_add_ps(sum, e);
    _mm512_storeu_ps(s + j, e);
  }
  const __m512 inverse = _mm512_set1_ps(1.0f / _mm512_reduce_add_ps(sum));
  for (int64_t j = 0; j < n_pad; j += 16)
    _mm256_storeu_si256(reinterpret_cast<__m256i*>(p + j),
                        to_bf16(_mm512_mul_ps(_mm512_loadu_ps(s + j), inverse)));
}

// out rows (stride out_stride, columns [0, D)) = P [R][pairs * 2] V.
template <int R>
void weighted_values(const uint16_t* P, int64_t p_stride, const uint16_t* values, int64_t pairs, int64_t D,
                     c10::BFloat16* out, int64_t out_stride) {
  for (int64_t d0 = 0; d0 < D; d0 += 64) {
    const int64_t width = std::min<int64_t>(64, D - d0), vectors = width / 16;
    __m512 acc[R][4];
    for (int r = 0; r < R; ++r)
      for (int i = 0; i < 4; ++i) acc[r][i] = _mm512_setzero_ps();
    for (int64_t j = 0; j < pairs; ++j) {
      const uint16_t* row = values + j * 2 * D + 2 * d0;
      __m512i w[4];
      for (int i = 0; i < 4; ++i) w[i] = i < vectors ? _mm512_loadu_si512(row + 32 * i) : _mm512_setzero_si512();
      for (int r = 0; r < R; ++r) {
        const __m512i x = pair_of(P + r * p_stride + 2 * j);
        for (int i = 0; i < 4; ++i) acc[r][i] = dot_bf16_pairs(acc[r][i], w[i], x);
      }
    }
    for (int r = 0; r < R; ++r)
      for (int i = 0; i < vectors; ++i)
        _mm256_storeu_si256(reinterpret_cast<__m256i*>(out + r * out_stride + d0 + 16 * i),
                            to_bf16(acc[r][i]));
  }
}

// Queries at positions t0 .. t0 + R - 1 of one head's sequence (keys 0 .. t0 + R - 1 packed).
template <int R>
void attend(const uint16_t* q, int64_t q_stride, const uint16_t* keys, const uint16_t* values, int64_t t0, int64_t D,
            float scale, float* S, uint16_t* P, int64_t stride, c10::BFloat16* out, int64_t out_stride) {
  const int64_t n = t0 + R;  // keys the last query sees
  const int64_t blocks = (n + kKeyBlock - 1) / kKeyBlock, n_pad = (n + 1) / 2 * 2;
  scores<R>(q, q_stride, keys, blocks, D, scale, S, stride);
  for (int r = 0; r < R; ++r) softmax_row(S + r * stride, t0 + r + 1, blocks * kKeyBlock, P + r * stride);
  weighted_values<R>(P, stride, values, n_pad / 2, D, out, out_stride);
}

// pack_chunk(chunk, kv head, keys, values): pack() one (chunk, kv head)'s keys 0 .. c.keys() - 1.
template <typename PackChunk>
void run(at::Tensor& out, const at::Tensor& q, int64_t Hkv, const std::vector<Chunk>& chunks, int64_t packed_total,
         double scale, PackChunk pack_chunk) {
  const int64_t H = q.size(1), D = q.size(2), groups = H / Hkv;
  const auto* qp = reinterpret_cast<const uint16_t*>(q.data_ptr<c10::BFloat16>());
  auto* op = out.data_ptr<c10::BFloat16>();
  const int64_t q_stride = q.stride(0), out_stride = out.stride(0);
  std::vector<uint16_t> keys(packed_total * Hkv * D), values(packed_total * Hkv * D);
  const int64_t C = static_cast<int64_t>(chunks.size());
  at::parallel_for(0, C * Hkv, 1, [&](int64_t begin, int64_t end) {
    for (int64_t task = begin; task < end; ++task) {
      const Chunk& c = chunks[task / Hkv];
      const int64_t h = task % Hkv, at = (c.packed * Hkv + h * padded(c.keys())) * D;
      pack_chunk(c, h, keys.data() + at, values.data() + at);
    }
  });
  std::vector<int64_t> task_starts{0};  // per (chunk, head): ceil(length / kRows) tasks
  int64_t longest = 0;
  for (const Chunk& c : chunks) {
    longest = std::max(longest, c.keys());
    for (int64_t h = 0; h < H; ++h) task_starts.push_back(task_starts.back() + (c.length + kRows - 1) / kRows);
  }
  const int64_t stride = padded(longest);
  at::parallel_for(0, task_starts.back(), 1, [&](int64_t begin, int64_t end) {
    std::vector<float> S(kRows * stride);
    std::vector<uint16_t> P(kRows * stride);
    int64_t ch = std::upper_bound(task_starts.begin(), task_starts.end(), begin) - task_starts.begin() - 1;
    for (int64_t task = begin; task < end; ++task) {
      while (task >= task_starts[ch + 1]) ++ch;
      const Chunk& c = chunks[ch / H];
      const int64_t h = ch % H, kvh = h / groups, t0 = (task - task_starts[ch]) * kRows;
      const int64_t at = (c.packed * Hkv + kvh * padded(c.keys())) * D, position = c.context + t0;
      const uint16_t* qr = qp + (c.start + t0) * q_stride + h * D;
      c10::BFloat16* orow = op + (c.start + t0) * out_stride + h * D;
      const float s = static_cast<float>(scale);
      switch (std::min(kRows, c.length - t0)) {
        case 1: attend<1>(qr, q_stride, keys.data() + at, values.data() + at, position, D, s, S.data(), P.data(), stride, orow, out_stride); break;
        case 2: attend<2>(qr, q_stride, keys.data() + at, values.data() + at, position, D, s, S.data(), P.data(), stride, orow, out_stride); break;
        case 3: attend<3>(qr, q_stride, keys.data() + at, values.data() + at, position, D, s, S.data(), P.data(), stride, orow, out_stride); break;
        default: attend<4>(qr, q_stride, keys.data() + at, values.data() + at, position, D, s, S.data(), P.data(), stride, orow, out_stride);
      }
    }
  });
}

void check_queries(const at::Tensor& out, const at::Tensor& q, int64_t Hkv) {
  TORCH_CHECK(q.dim() == 3 && out.dim() == 2, "q: [T, heads, D]; out: [T, H * D]");
  for (const at::Tensor* t : {&out, &q})
    TORCH_CHECK(t->scalar_type() == at::kBFloat16 && t->device().is_cpu(), "prefill attention takes bf16 CPU tensors");
  const int64_t H = q.size(1), D = q.size(2);
  TORCH_CHECK(Hkv > 0 && H % Hkv == 0, "query heads must be a multiple of kv heads");
  TORCH_CHECK(D % 32 == 0, "head_dim must be a multiple of 32");
  TORCH_CHECK(q.stride(2) == 1 && q.stride(1) == D, "heads and columns of q must be contiguous");
  TORCH_CHECK(out.size(0) == q.size(0) && out.size(1) == H * D && out.stride(1) == 1, "out must be [T, H * D]");
}

// The chunks (int64 [C] each; context: nullptr for none), checked against T rows and, if given,
// the most keys a chunk may have; empty ones dropped. packed_total: their padded key counts.
std::vector<Chunk> chunks_of(const at::Tensor& starts, const at::Tensor& lengths, const at::Tensor* context,
                             int64_t T, int64_t max_keys, int64_t& packed_total) {
  for (const at::Tensor* t : {&starts, &lengths, context})
    if (t != nullptr)
      TORCH_CHECK(t->scalar_type() == at::kLong && t->dim() == 1 && t->size(0) == starts.size(0),
                  "starts, lengths (and context_lens): int64 [C]");
  const at::Tensor s = starts.contiguous(), l = lengths.contiguous();
  const at::Tensor cached_lens = context == nullptr ? at::zeros_like(s) : context->contiguous();
  std::vector<Chunk> chunks;
  packed_total = 0;
  for (int64_t c = 0; c < s.size(0); ++c) {
    const int64_t start = s.data_ptr<int64_t>()[c], length = l.data_ptr<int64_t>()[c];
    const int64_t cached = cached_lens.data_ptr<int64_t>()[c];
    TORCH_CHECK(start >= 0 && length >= 0 && start + length <= T, "chunk ", c, " is outside the rows");
    TORCH_CHECK(cached >= 0 && cached + length <= max_keys, "chunk ", c, " has more keys than its block table holds");
    if (length == 0) continue;
    chunks.push_back({c, start, length, cached, packed_total});
    packed_total += padded(cached + length);
  }
  return chunks;
}

void prefill_attention_(at::Tensor& out, const at::Tensor& q, const at::Tensor& k, const at::Tensor& v,
                        const at::Tensor& starts, const at::Tensor& lengths, double scale) {
  TORCH_CHECK(k.dim() == 3 && v.dim() == 3, "k, v: [T, Hkv, D]");
  check_queries(out, q, k.size(1));
  for (const at::Tensor* t : {&k, &v}) TORCH_CHECK(t->scalar_type() == at::kBFloat16, "prefill attention takes bf16 CPU tensors");
  const int64_t T = q.size(0), D = q.size(2), Hkv = k.size(1);
  TORCH_CHECK(k.sizes() == v.sizes() && k.size(0) == T && k.size(2) == D, "k and v must be [T, Hkv, D] alike");
  TORCH_CHECK(k.stride(2) == 1 && k.stride(1) == D && v.stride(2) == 1 && v.stride(1) == D,
              "heads and columns of k and v must be contiguous");
  int64_t packed_total = 0;
  const std::vector<Chunk> chunks = chunks_of(starts, lengths, nullptr, T, T, packed_total);
  const auto* kp = reinterpret_cast<const uint16_t*>(k.data_ptr<c10::BFloat16>());
  const auto* vp = reinterpret_cast<const uint16_t*>(v.data_ptr<c10::BFloat16>());
  const int64_t k_stride = k.stride(0), v_stride = v.stride(0);
  if (!chunks.empty())
    run(out, q, Hkv, chunks, packed_total, scale, [&](const Chunk& c, int64_t h, uint16_t* keys, uint16_t* values) {
      const uint16_t* k0 = kp + c.start * k_stride + h * D;
      const uint16_t* v0 = vp + c.start * v_stride + h * D;
      pack([&](int64_t j) { return k0 + j * k_stride; }, 2, [&](int64_t j) { return v0 + j * v_stride; }, c.length,
           D, keys, values);
    });
}

void paged_prefill_attention_(at::Tensor& out, const at::Tensor& q, const at::Tensor& k_cache,
                              const at::Tensor& v_cache, const at::Tensor& block_table, const at::Tensor& context_lens,
                              const at::Tensor& starts, const at::Tensor& lengths, double scale) {
  TORCH_CHECK(k_cache.dim() == 4 && k_cache.sizes() == v_cache.sizes() && k_cache.is_contiguous() &&
                  v_cache.is_contiguous() && k_cache.scalar_type() == at::kBFloat16 &&
                  v_cache.scalar_type() == at::kBFloat16,
              "caches: contiguous bf16 [Hkv, blocks, block_size, D]");
  check_queries(out, q, k_cache.size(0));
  const int64_t Hkv = k_cache.size(0), num_blocks = k_cache.size(1), bs = k_cache.size(2), D = k_cache.size(3);
  TORCH_CHECK(D == q.size(2), "the caches' head_dim must be q's");
  TORCH_CHECK(block_table.scalar_type() == at::kLong && block_table.dim() == 2 && block_table.is_contiguous() &&
                  block_table.size(0) == starts.size(0),
              "block_table: contiguous int64 [C, max_blocks]");
  int64_t packed_total = 0;
  const int64_t max_blocks = block_table.size(1);
  const std::vector<Chunk> chunks =
      chunks_of(starts, lengths, &context_lens, q.size(0), max_blocks * bs, packed_total);
  const int64_t* table = block_table.data_ptr<int64_t>();
  for (int64_t i = 0; i < block_table.numel(); ++i)
    TORCH_CHECK(table[i] >= 0 && table[i] < num_blocks, "block_table holds a block outside the cache");
  const auto* kp = reinterpret_cast<const uint16_t*>(k_cache.data_ptr<c10::BFloat16>());
  const auto* vp = reinterpret_cast<const uint16_t*>(v_cache.data_ptr<c10::BFloat16>());
  if (!chunks.empty())
    run(out, q, Hkv, chunks, packed_total, scale, [&](const Chunk& c, int64_t h, uint16_t* keys, uint16_t* values) {
      const int64_t* blocks = table + c.index * max_blocks;
      auto block = [&](int64_t j) { return (h * num_blocks + blocks[j / bs]) * bs * D; };
      pack([&](int64_t j) { return kp + block(j) + (j % bs) * 2; }, 2 * bs,
           [&](int64_t j) { return vp + block(j) + (j % bs) * D; }, c.keys(), D, keys, values);
    });
}

}  // namespace

TORCH_LIBRARY_FRAGMENT(tokenmill, m) {
  m.def("prefill_attention_(Tensor(a!) out, Tensor q, Tensor k, Tensor v, Tensor starts, Tensor lengths, "
        "float scale) -> ()");
  m.def("paged_prefill_attention_(Tensor(a!) out, Tensor q, Tensor k_cache, Tensor v_cache, Tensor block_table, "
        "Tensor context_lens, Tensor starts, Tensor lengths, float scale) -> ()");
}

TORCH_LIBRARY_IMPL(tokenmill, CPU, m) {
  m.impl("prefill_attention_", prefill_attention_);
  m.impl("paged_prefill_attention_", paged_prefill_attention_);
}
