// The AVX2 build's few-row decode step through every decoder layer in one call and one parallel
// region (decode_step.cpp's DecodeLayers, for the other layouts): float32 activations, linears in
// the row layout multiplied by quant_gemv_i8's few-row loops (quant_gemv_i8.h), attention over the
// PyTorch backend's cache rows (decode_rows.h). It computes what models/decode_plan.py computes on
// that build, with the same row functions in the same order, so the result is the plan's bit for
// bit; what it saves is the plan's 8 op calls per layer (a few microseconds of dispatch and
// allocation each) and the threads' fork and join around them.
//
//   DecodeLayersRows(weights, linears, num_heads, num_kv_heads, scale, eps, final_norm, head, head_ints)   once
//   .forward(x [M, H], positions, cos, sin, write_index, block_table, seq_lens)
//     -> the final norm [M, H]; with a head, its logits [M, vocab] instead
//
// x: the step's embeddings (float32), used as the residual stream (changed in place). Per layer,
// weights holds 16 tensors: input norm, post-attention norm (float32), then codes, scales and
// offsets of the fused q/k/v, o, fused gate/up and down projections (the row layout), then the key
// and value caches ([kv_heads, blocks, block_size, D], float32, float16 or bfloat16); linears holds
// 4 ints per projection: bits, group size, output rows, two_parts (16-bit activations). head: the
// model's head the same way (3 tensors, 4 ints), or empty lists: then the step ends with the logits,
// as the head's quant_gemv_i8 call gives them. The phases and what the two builds share:
// decode_layers.h.
#include <ATen/Parallel.h>
#include <ATen/core/Tensor.h>
#include <ATen/ops/empty.h>
#include <c10/util/BFloat16.h>
#include <c10/util/Half.h>
#include <omp.h>
#include <torch/custom_class.h>
#include <torch/library.h>

#include <algorithm>
#include <cstdint>
#include <optional>
#include <vector>

#include "decode_layers.h"
#include "decode_rows.h"
#include "fused_rows.h"
#include "quant_gemv_i8.h"

namespace {

using namespace tokenmill_i8;
using tokenmill_layers::kTensorsPerLayer;
using tokenmill_layers::Shape;

// One projection's weight in the row layout.
struct Linear {
  const uint8_t* codes;
  const void* scales;
  const void* offsets;
  bool half_scales;
  int64_t bits, G, N, K;
  bool two_parts;

  std::pair<int64_t, int64_t> share(int thread, int threads) const {
    return {N * thread / threads, N * (thread + 1) / threads};
  }
  // The first bytes of this thread's share, fetched into L2 while it waits at a barrier.
  void prefetch_share(int thread, int threads) const {
    const int64_t row_bytes = K * bits / 8, begin = share(thread, threads).first;
    const char* first = reinterpret_cast<const char*>(codes + begin * row_bytes);
    for (int64_t line = 0; line < kPrefetchBytes; line += 64) _mm_prefetch(first + line, _MM_HINT_T1);
  }
  static constexpr int64_t kPrefetchBytes = 4096;

  // out [M, N] rows of this thread's share = a (rounded [M, K]) times the weight.
  template <typename S>
  void multiply_share(const QuantizedActivations& a, int64_t M, int thread, int threads, float* out) const {
    const auto [begin, end] = share(thread, threads);
    if (begin == end) return;
    for (int64_t m = 0; m < M; m += kMaxRows) {  // as quant_gemv_i8 does for up to 4 rows; more: in fours
      gemv_i8_fn<S>(std::min(kMaxRows, M - m), bits, two_parts)(a, m, codes, static_cast<const S*>(scales),
                                                               static_cast<const S*>(offsets), begin, end, K, G,
                                                               out + m * N, N);
    }
  }
  void multiply(const QuantizedActivations& a, int64_t M, int thread, int threads, float* out) const {
    if (half_scales) {
      multiply_share<c10::Half>(a, M, thread, threads, out);
    } else {
      multiply_share<float>(a, M, thread, threads, out);
    }
  }
  void round(const float* x, int64_t M, QuantizedActivations& a) const {
    size_for(a, M, K, G, two_parts);
    quantize_groups(x, G, two_parts, 0, M * (K / G), a);
  }
};

Linear linear_of(const at::Tensor* t, const int64_t* ints, int64_t K) {
  const at::Tensor &codes = t[0], &scales = t[1], &offsets = t[2];
  const int64_t bits = ints[0], G = ints[1], N = ints[2];
  TORCH_CHECK((bits == 4 || bits == 8) && G % 32 == 0 && K % G == 0, "DecodeLayersRows: bad bits or group size");
  TORCH_CHECK(codes.dim() == 2 && codes.scalar_type() == at::kByte && codes.is_contiguous() && codes.size(0) == N &&
                  codes.size(1) == K * bits / 8, "DecodeLayersRows: a projection's codes do not match its input width");
  TORCH_CHECK(scales.dim() == 2 && scales.is_contiguous() && offsets.is_contiguous() &&
                  scales.sizes() == offsets.sizes() && scales.scalar_type() == offsets.scalar_type() &&
                  (scales.scalar_type() == at::kHalf || scales.scalar_type() == at::kFloat) && scales.size(0) == N &&
                  scales.size(1) == K / G, "DecodeLayersRows: a projection's scales do not match its codes");
  return {codes.data_ptr<uint8_t>(), scales.data_ptr(), offsets.data_ptr(), scales.scalar_type() == at::kHalf,
          bits, G, N, K, ints[3] != 0};
}

// Everything the step reads besides the layers.
struct StepInputs {
  int64_t M, block_size, head_stride, table_stride;
  const int64_t* positions;
  const int64_t* write_index;
  const int64_t* block_table;
  const int64_t* seq_lens;
  const float* cos;
  const float* sin;
  float scale;
};

using Layer = tokenmill_layers::Layer<Linear>;

// The layout's part of a step (tokenmill_layers::run_layers runs the phases): activations rounded
// per group of each weight, quant_gemv_i8's loops over a share of the rows, the PyTorch backend's
// cache rows.
template <typename C>
struct Step {
  const StepInputs& s;
  const Shape& shape;

  struct Scratch {
    tokenmill_rows::AttentionScratch attention;
    QuantizedActivations act;
  };
  Scratch scratch(int) const { return {}; }
  void round(const Linear& w, const float* x, int64_t M, Scratch& scratch) const { w.round(x, M, scratch.act); }
  void multiply(const Linear& w, int64_t M, int thread, int threads, Scratch& scratch, float* out) const {
    w.multiply(scratch.act, M, thread, threads, out);
  }

  // Rotary, KV write and attention of sequence b's kv head kv (its group of query heads), as
  // fused_decode_attention_rows (decode_attention_rows.cpp) does them for the whole step.
  void attend(const Layer& layer, float* qkv, float* out, int64_t b, int64_t kv, Scratch& scratch) const {
    const int64_t num_heads = shape.num_heads, groups = num_heads / shape.num_kv_heads, D = shape.D;
    float* row = qkv + b * shape.qkv_width();
    const float* cos = s.cos + s.positions[b] * D;
    const float* sin = s.sin + s.positions[b] * D;
    float* key = row + (num_heads + kv) * D;
    tokenmill_rows::rotate_row(key, cos, sin, D);
    for (int64_t h = kv * groups; h < (kv + 1) * groups; ++h) tokenmill_rows::rotate_row(row + h * D, cos, sin, D);
    C* k_cache = static_cast<C*>(layer.k_cache);
    C* v_cache = static_cast<C*>(layer.v_cache);
    const int64_t slot = s.write_index[kv * s.M + b];
    tokenmill_rows::store_row(key, k_cache + slot * D, D);
    tokenmill_rows::store_row(row + (num_heads + shape.num_kv_heads + kv) * D, v_cache + slot * D, D);
    const tokenmill_rows::AttentionItem item{groups, D, s.seq_lens[b], s.block_size, s.block_table + b * s.table_stride,
                                             s.scale};
    tokenmill_rows::attend_item(item, row + kv * groups * D, k_cache + kv * s.head_stride, v_cache + kv * s.head_stride,
                                out + (b * num_heads + kv * groups) * D, scratch.attention);
  }
};

// The layers of one model, checked and laid out once; forward() runs a decode step through them.
class DecodeLayersRows : public torch::CustomClassHolder {
 public:
  DecodeLayersRows(std::vector<at::Tensor> weights, std::vector<int64_t> linears, int64_t num_heads,
                   int64_t num_kv_heads, double scale, double eps, at::Tensor final_norm, std::vector<at::Tensor> head,
                   std::vector<int64_t> head_ints)
      : weights_(std::move(weights)), final_norm_(std::move(final_norm)), head_weights_(std::move(head)),
        scale_(static_cast<float>(scale)), eps_(eps) {
    TORCH_CHECK(weights_.size() >= kTensorsPerLayer, "DecodeLayersRows: 16 tensors and 16 ints per layer");
    const at::ScalarType cache_dtype = weights_[kTensorsPerLayer - 2].scalar_type();
    TORCH_CHECK(cache_dtype == at::kFloat || cache_dtype == at::kHalf || cache_dtype == at::kBFloat16,
                "DecodeLayersRows: caches must be float32, float16 or bfloat16");
    TORCH_CHECK(num_kv_heads > 0 && num_heads % num_kv_heads == 0 && num_heads / num_kv_heads <= tokenmill_rows::kMaxGroups,
                "DecodeLayersRows: at most 8 query heads per kv head");
    TORCH_CHECK(final_norm_.scalar_type() == at::kFloat, "DecodeLayersRows: final_norm must be float32 [H]");
    shape_.num_heads = num_heads;
    shape_.num_kv_heads = num_kv_heads;
    layers_ = tokenmill_layers::layers_of<Linear>(weights_, linears, final_norm_, "DecodeLayersRows", linear_of, shape_);
    TORCH_CHECK(shape_.D % 2 == 0, "DecodeLayersRows: head_dim must be even (rotary)");
    TORCH_CHECK((head_weights_.empty() && head_ints.empty()) || (head_weights_.size() == 3 && head_ints.size() == 4),
                "DecodeLayersRows: the head is 3 tensors and 4 ints, or none");
    if (!head_weights_.empty()) head_ = linear_of(head_weights_.data(), head_ints.data(), shape_.H);
  }

  // x [M, H] float32: the step's embeddings, the residual stream (changed in place); positions,
  // seq_lens int64 [M]; write_index int64 [kv_heads * M] (cache row of token m's kv head h at
  // h * M + m); block_table int64 [M, max_blocks]; cos, sin float32 [max_positions, D].
  at::Tensor forward(at::Tensor x, at::Tensor positions, at::Tensor cos, at::Tensor sin, at::Tensor write_index,
                     at::Tensor block_table, at::Tensor seq_lens) {
    const at::Tensor& k0 = weights_[kTensorsPerLayer - 2];
    const int64_t H = shape_.H, D = shape_.D;
    TORCH_CHECK(x.dim() == 2 && x.is_contiguous() && x.size(0) >= 1 && x.size(0) <= tokenmill_layers::kMaxRows &&
                    x.size(1) == H && x.scalar_type() == at::kFloat,
                "DecodeLayersRows: x must be contiguous float32 [M <= 8, H]");
    const int64_t M = x.size(0), kv_heads = shape_.num_kv_heads, num_blocks = k0.size(1), block_size = k0.size(2);
    for (const at::Tensor* t : {&positions, &seq_lens})
      TORCH_CHECK(t->scalar_type() == at::kLong && t->is_contiguous() && t->dim() == 1 && t->size(0) == M,
                  "DecodeLayersRows: positions and seq_lens must be int64 [M]");
    TORCH_CHECK(write_index.scalar_type() == at::kLong && write_index.is_contiguous() && write_index.dim() == 1 &&
                    write_index.size(0) == kv_heads * M, "DecodeLayersRows: write_index must be int64 [kv_heads * M]");
    TORCH_CHECK(block_table.scalar_type() == at::kLong && block_table.dim() == 2 && block_table.size(0) == M &&
                    block_table.stride(1) == 1, "DecodeLayersRows: block_table must be int64 [M, max_blocks]");
    TORCH_CHECK(cos.scalar_type() == at::kFloat && cos.dim() == 2 && cos.size(1) == D && cos.is_contiguous() &&
                    sin.sizes() == cos.sizes() && sin.is_contiguous() && sin.scalar_type() == at::kFloat,
                "DecodeLayersRows: cos and sin must be contiguous float32 [max_positions, head_dim]");
    const int64_t* pos = positions.data_ptr<int64_t>();
    const int64_t* lens = seq_lens.data_ptr<int64_t>();
    const int64_t* table = block_table.data_ptr<int64_t>();
    const int64_t* index = write_index.data_ptr<int64_t>();
    for (int64_t m = 0; m < M; ++m) {
      TORCH_CHECK(pos[m] >= 0 && pos[m] < cos.size(0), "DecodeLayersRows: position past the rotary table");
      TORCH_CHECK(lens[m] > 0 && lens[m] <= block_table.size(1) * block_size,
                  "DecodeLayersRows: a sequence is longer than its block table");
      for (int64_t i = 0; i < (lens[m] + block_size - 1) / block_size; ++i) {
        const int64_t block = table[m * block_table.stride(0) + i];
        TORCH_CHECK(block >= 0 && block < num_blocks, "DecodeLayersRows: block ", block, " is past the cache");
      }
    }
    for (int64_t i = 0; i < kv_heads * M; ++i) {
      TORCH_CHECK(index[i] >= 0 && index[i] < kv_heads * num_blocks * block_size, "DecodeLayersRows: row ", index[i],
                  " is past the cache");
    }
    const StepInputs s{M, block_size, num_blocks * block_size * D, block_table.stride(0), pos, index, table, lens,
                       cos.data_ptr<float>(), sin.data_ptr<float>(), scale_};
    at::Tensor y = at::empty({M, H}, x.options());
    at::Tensor logits = head_ ? at::empty({M, head_->N}, x.options()) : at::Tensor();
    switch (k0.scalar_type()) {
      case at::kHalf: run<c10::Half>(s, x, y, logits); break;
      case at::kBFloat16: run<c10::BFloat16>(s, x, y, logits); break;
      default: run<float>(s, x, y, logits);
    }
    return head_ ? logits : y;
  }

 private:
  template <typename C>  // the caches' dtype
  void run(const StepInputs& s, at::Tensor& x, at::Tensor& y, at::Tensor& logits) const {
    Step<C> step{s, shape_};
    tokenmill_layers::run_layers<float, float>(step, layers_, shape_, s.M, eps_, final_norm_.data_ptr<float>(),
                                               x.data_ptr<float>(), y.data_ptr<float>(),
                                               std::max(1, at::get_num_threads()), head_ ? &*head_ : nullptr,
                                               head_ ? logits.data_ptr<float>() : nullptr);
  }

  std::vector<at::Tensor> weights_;  // what layers_ points into, kept alive
  at::Tensor final_norm_;
  std::vector<at::Tensor> head_weights_;
  std::optional<Linear> head_;
  std::vector<Layer> layers_;
  Shape shape_{};
  float scale_;
  double eps_;
};

}  // namespace

TORCH_LIBRARY_FRAGMENT(tokenmill, m) {
  m.class_<DecodeLayersRows>("DecodeLayersRows")
      .def(torch::init<std::vector<at::Tensor>, std::vector<int64_t>, int64_t, int64_t, double, double, at::Tensor,
                       std::vector<at::Tensor>, std::vector<int64_t>>())
      .def("forward", &DecodeLayersRows::forward);
}
