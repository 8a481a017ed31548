// A few-row decode step through every decoder layer in one call and one parallel region, for models
// whose linears all run the VNNI kernel (quant_gemv_q8.h) and whose attention is the paged kernel
// (paged_decode.h). It computes what models/decode_plan.py computes, with the same row functions
// in the same order, so the result is the plan's bit for bit; what it saves is the plan's ~10 op
// calls per layer (each a few microseconds of dispatch and allocation) and, more, the threads'
// fork and join around every one of them: here the threads stay in one region and meet at a
// barrier between the phases that depend on each other.
//
//   DecodeLayers(weights, linears, num_heads, num_kv_heads, scale, eps, final_norm, head, head_ints)   once
//   .forward(x [M, H], positions, cos, sin, slots, block_tables, seq_lens, context)
//     -> the final norm [M, H]; with a head, its float32 logits [M, vocab] instead
//
// x: the step's embeddings, used as the residual stream (changed in place). Per layer, weights
// holds 16 tensors: input norm, post-attention norm, then codes, scales and offsets of the fused
// q/k/v, o, fused gate/up and down projections (the interleaved layout), then the key and value
// caches; linears holds 4 ints per projection: bits, group size, output rows, two_parts (16-bit
// activations). head: the model's head the same way (codes, scales, offsets; 4 ints), or empty lists:
// then the step ends with the logits, as the head's quant_gemv_q8 call and .float() give them,
// without the host's ops between the two calls. The phases and what the two builds share:
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
#include "fused_rows.h"
#include "paged_decode.h"
#include "quant_gemv_q8.h"

namespace {

#if defined(__AVX512VNNI__)
using namespace tokenmill_q8;
using tokenmill_attention::Geometry;
using tokenmill_layers::kMaxRows;
using tokenmill_layers::kTensorsPerLayer;
using tokenmill_layers::Shape;

// One projection's weight in the interleaved layout.
struct Linear {
  const uint8_t* codes;
  const void* scales;
  const void* offsets;
  bool half_scales;
  int64_t bits, G, N, K, blocks;
  bool two_parts;

  int64_t groups() const { return K / G; }
  // this thread's share of the 16-row blocks
  std::pair<int64_t, int64_t> share(int thread, int num_threads) const {
    return {blocks * thread / num_threads, blocks * (thread + 1) / num_threads};
  }
  // The first bytes of this thread's share, fetched into L2 while it waits at a barrier: the
  // kernel's own prefetching starts a few blocks into the share (+5-10% on the EPYC's W1).
  void prefetch_share(int thread, int num_threads) const {
    const int64_t begin = share(thread, num_threads).first, block_bytes = groups() * kLanes * G * bits / 8;
    const int64_t scale_bytes = groups() * kLanes * (half_scales ? 2 : 4);
    for (int64_t line = 0; line < kPrefetchBytes; line += 64) prefetch_l2(codes + begin * block_bytes + line);
    for (int64_t line = 0; line < std::min(kPrefetchBytes / 4, scale_bytes); line += 64) {
      prefetch_l2(static_cast<const char*>(scales) + begin * scale_bytes + line);
      prefetch_l2(static_cast<const char*>(offsets) + begin * scale_bytes + line);
    }
  }
  static constexpr int64_t kPrefetchBytes = 4096;
};

Linear linear_of(const at::Tensor* t, const int64_t* ints, int64_t K) {
  const at::Tensor &codes = t[0], &scales = t[1], &offsets = t[2];
  const int64_t bits = ints[0], G = ints[1], N = ints[2];
  TORCH_CHECK(codes.dim() == 3 && codes.scalar_type() == at::kByte && codes.is_contiguous() &&
                  codes.size(2) == kLanes * G * bits / 8 && codes.size(1) * G == K && codes.size(0) * kLanes >= N,
              "DecodeLayers: a projection's codes do not match its input width");
  tokenmill_quant::check_scales(scales, offsets);
  TORCH_CHECK(scales.dim() == 3 && scales.size(0) == codes.size(0) && scales.size(1) == codes.size(1) &&
                  scales.size(2) == kLanes, "DecodeLayers: a projection's scales do not match its codes");
  TORCH_CHECK((bits == 4 || bits == 8) && G % 16 == 0 && K % G == 0, "DecodeLayers: bad bits or group size");
  return {codes.data_ptr<uint8_t>(), scales.data_ptr(), offsets.data_ptr(), scales.scalar_type() == at::kHalf,
          bits, G, N, K, codes.size(0), ints[3] != 0};
}

// The activations a projection multiplies, quantized per group of its weight (each thread its own
// copy).
struct Activations {
  std::vector<int8_t> q, q2;
  std::vector<float> d, sums;
  QuantizedRow rows[kMaxRows];

  Activations(int64_t M, int64_t max_K) : q(M * max_K), q2(M * max_K), d(M * max_K / 16), sums(M * max_K / 16) {}

  template <typename T>
  void quantize(const T* x, int64_t M, const Linear& w) {
    const int64_t groups = w.groups();
    for (int64_t m = 0; m < M; ++m) {
      rows[m] = {q.data() + m * w.K, w.two_parts ? q2.data() + m * w.K : nullptr, d.data() + m * groups,
                 sums.data() + m * groups};
      quantize_row(x + m * w.K, w.K, w.G, rows[m]);
    }
  }
};

// out [M, N] (T) = the activations times this thread's share of w's blocks.
template <typename T, typename S>
void gemv_share(const Linear& w, const Activations& a, int64_t M, int thread, int num_threads, float* local, T* out) {
  const auto [begin, end] = w.share(thread, num_threads);
  if (begin == end) return;
  multiply_blocks(a.rows, M, w.codes, static_cast<const S*>(w.scales), static_cast<const S*>(w.offsets), w.bits, w.G,
                  w.groups(), w.two_parts, begin, end, w.N, local, out);
}

// Everything the step reads besides the layers.
struct StepInputs {
  const int64_t* positions;
  const int64_t* slots;
  const int64_t* block_tables;
  const int64_t* seq_lens;
  const float* cos;
  const float* sin;
  float scale;
  Geometry geometry;
};

using Layer = tokenmill_layers::Layer<Linear>;

// The layout's part of a step (tokenmill_layers::run_layers runs the phases): activations
// quantized per group of each weight, the VNNI kernel's share of blocks, the paged cache.
template <typename T>
struct Step {
  const StepInputs& s;
  const Shape& shape;
  int64_t max_blocks, M, max_K;
  std::vector<T> q_rows;  // each sequence's query heads after rotary, [M, num_heads * D]

  struct Scratch {
    std::vector<float> local, scores;
    Activations act;
  };
  Scratch scratch(int threads) const {
    return {std::vector<float>(kPassRows * (max_blocks / threads + 2) * kLanes),
            std::vector<float>(s.geometry.groups * s.geometry.context), Activations(M, max_K)};
  }
  void round(const Linear& w, const T* x, int64_t rows, Scratch& scratch) const { scratch.act.quantize(x, rows, w); }
  void multiply(const Linear& w, int64_t rows, int thread, int threads, Scratch& scratch, T* out) const {
    if (w.half_scales) {
      gemv_share<T, c10::Half>(w, scratch.act, rows, thread, threads, scratch.local.data(), out);
    } else {
      gemv_share<T, float>(w, scratch.act, rows, thread, threads, scratch.local.data(), out);
    }
  }

  // Rotary, KV write and attention of sequence b's kv head kv (its group of query heads), as
  // decode_attention in paged_decode.cpp does them for the whole step.
  void attend(const Layer& layer, T* qkv, T* out, int64_t b, int64_t kv, Scratch& scratch) {
    const Geometry& g = s.geometry;
    const int64_t D = shape.D, num_heads = shape.num_heads, num_kv_heads = shape.num_kv_heads;
    T* row = qkv + b * shape.qkv_width();
    const float* cos = s.cos + s.positions[b] * D;
    const float* sin = s.sin + s.positions[b] * D;
    T* key = row + (num_heads + kv) * D;
    tokenmill_rows::rotate_row(key, cos, sin, D);
    tokenmill_rows::write_kv_row(reinterpret_cast<const char*>(key),
                                 reinterpret_cast<const char*>(row + (num_heads + num_kv_heads + kv) * D),
                                 static_cast<char*>(layer.k_cache), static_cast<char*>(layer.v_cache), kv, s.slots[b],
                                 g.num_blocks, g.block_size, D, sizeof(T));
    const int64_t head0 = kv * g.groups;
    for (int64_t h = head0; h < head0 + g.groups; ++h) {
      tokenmill_rows::rotate_row(row + h * D, cos, sin, D);
      std::copy(row + h * D, row + (h + 1) * D, q_rows.data() + (b * num_heads + h) * D);
    }
    const int64_t len = std::min(s.seq_lens[b], g.context);
    float* scores = scratch.scores.data();
    tokenmill_attention::qk_item(g, q_rows.data(), static_cast<const T*>(layer.k_cache), s.block_tables, b, kv, len,
                                 s.scale, scores, g.context);
    for (int64_t h = 0; h < g.groups; ++h) tokenmill_attention::softmax_row(scores + h * g.context, len, g.context);
    tokenmill_attention::pv_item(g, scores, g.context, static_cast<const T*>(layer.v_cache), s.block_tables, b, kv,
                                 len, out);
  }
};

template <typename Fn>
void for_dtype(const at::Tensor& t, const char* what, Fn&& fn) {
  switch (t.scalar_type()) {
    case at::kBFloat16: fn(c10::BFloat16{}); break;
    case at::kHalf: fn(c10::Half{}); break;
    case at::kFloat: fn(float{}); break;
    default: TORCH_CHECK(false, "DecodeLayers: ", what, " must be bfloat16, float16 or float32");
  }
}

// The layers of one model, checked and laid out once; forward() runs a decode step through them.
class DecodeLayers : public torch::CustomClassHolder {
 public:
  DecodeLayers(std::vector<at::Tensor> weights, std::vector<int64_t> linears, int64_t num_heads, int64_t num_kv_heads,
               double scale, double eps, at::Tensor final_norm, std::vector<at::Tensor> head,
               std::vector<int64_t> head_ints)
      : weights_(std::move(weights)), final_norm_(std::move(final_norm)), head_weights_(std::move(head)),
        scale_(static_cast<float>(scale)), eps_(eps) {
    TORCH_CHECK(!weights_.empty() && weights_.size() >= kTensorsPerLayer, "DecodeLayers: 16 tensors and 16 ints per layer");
    const at::ScalarType cache_dtype = weights_[kTensorsPerLayer - 2].scalar_type();
    TORCH_CHECK(cache_dtype == at::kBFloat16 || cache_dtype == at::kHalf, "DecodeLayers: caches must be bfloat16 or float16");
    TORCH_CHECK(final_norm_.scalar_type() != at::kDouble, "DecodeLayers: final_norm must be bfloat16, float16 or float32");
    shape_.num_heads = num_heads;
    shape_.num_kv_heads = num_kv_heads;
    layers_ = tokenmill_layers::layers_of<Linear>(weights_, linears, final_norm_, "DecodeLayers", linear_of, shape_);
    for (const Layer& l : layers_)
      for (const Linear* w : {&l.qkv, &l.o, &l.gate_up, &l.down}) max_blocks_ = std::max(max_blocks_, w->blocks);
    TORCH_CHECK((head_weights_.empty() && head_ints.empty()) || (head_weights_.size() == 3 && head_ints.size() == 4),
                "DecodeLayers: the head is 3 tensors and 4 ints, or none");
    if (!head_weights_.empty()) {
      head_ = linear_of(head_weights_.data(), head_ints.data(), shape_.H);
      max_blocks_ = std::max(max_blocks_, head_->blocks);
    }
  }

  // x [M, H]: the step's embeddings, the residual stream (changed in place); positions, slots,
  // seq_lens int64 [M]; block_tables int64 [M, max_blocks]; cos, sin float32 [max_positions, D].
  at::Tensor forward(at::Tensor x, at::Tensor positions, at::Tensor cos, at::Tensor sin, at::Tensor slots,
                     at::Tensor block_tables, at::Tensor seq_lens, int64_t context) {
    const at::Tensor& k0 = weights_[kTensorsPerLayer - 2];
    const int64_t H = shape_.H, D = shape_.D;
    TORCH_CHECK(x.dim() == 2 && x.is_contiguous() && x.size(0) >= 1 && x.size(0) <= kMaxRows && x.size(1) == H &&
                    x.scalar_type() == k0.scalar_type(), "DecodeLayers: x must be contiguous [M <= 8, H] in the caches' dtype");
    const int64_t M = x.size(0);
    for (const at::Tensor* t : {&positions, &slots, &seq_lens})
      TORCH_CHECK(t->scalar_type() == at::kLong && t->is_contiguous() && t->dim() == 1 && t->size(0) == M,
                  "DecodeLayers: positions, slots and seq_lens must be int64 [M]");
    TORCH_CHECK(cos.scalar_type() == at::kFloat && cos.dim() == 2 && cos.size(1) == D && cos.is_contiguous() &&
                    sin.sizes() == cos.sizes() && sin.is_contiguous() && sin.scalar_type() == at::kFloat,
                "DecodeLayers: cos and sin must be contiguous float32 [max_positions, head_dim]");
    const StepInputs s{positions.data_ptr<int64_t>(), slots.data_ptr<int64_t>(), block_tables.data_ptr<int64_t>(),
                       seq_lens.data_ptr<int64_t>(), cos.data_ptr<float>(), sin.data_ptr<float>(), scale_,
                       tokenmill_attention::geometry_of(k0, block_tables, M, shape_.num_heads, context)};
    for (int64_t m = 0; m < M; ++m) {
      TORCH_CHECK(s.positions[m] >= 0 && s.positions[m] < cos.size(0), "DecodeLayers: position past the rotary table");
      TORCH_CHECK(s.slots[m] >= 0 && s.slots[m] < s.geometry.num_blocks * s.geometry.block_size,
                  "DecodeLayers: slot past the cache");
    }
    at::Tensor y = at::empty({M, H}, x.options());
    at::Tensor logits = head_ ? at::empty({M, head_->N}, x.options().dtype(at::kFloat)) : at::Tensor();
    const int64_t max_K = std::max({H, shape_.num_heads * D, shape_.I});
    const int num_threads = static_cast<int>(std::max<int64_t>(1, std::min<int64_t>(at::get_num_threads(), max_blocks_)));
    for_dtype(x, "x", [&](auto xt) {
      using T = decltype(xt);
      for_dtype(final_norm_, "norm weights", [&](auto wt) {
        using W = decltype(wt);
        if constexpr (!std::is_same_v<T, float>) {
          Step<T> step{s, shape_, max_blocks_, M, max_K, std::vector<T>(M * shape_.num_heads * D)};
          tokenmill_layers::run_layers<T, W>(step, layers_, shape_, M, eps_, final_norm_.data_ptr<W>(),
                                             x.data_ptr<T>(), y.data_ptr<T>(), num_threads, head_ ? &*head_ : nullptr,
                                             head_ ? logits.data_ptr<float>() : nullptr);
        }
      });
    });
    return head_ ? logits : y;
  }

 private:
  std::vector<at::Tensor> weights_;  // what layers_ points into, kept alive
  at::Tensor final_norm_;
  std::vector<at::Tensor> head_weights_;
  std::optional<Linear> head_;
  std::vector<Layer> layers_;
  Shape shape_{};
  int64_t max_blocks_ = 0;
  float scale_;
  double eps_;
};

}  // namespace

TORCH_LIBRARY_FRAGMENT(tokenmill, m) {
  m.class_<DecodeLayers>("DecodeLayers")
      .def(torch::init<std::vector<at::Tensor>, std::vector<int64_t>, int64_t, int64_t, double, double, at::Tensor,
                       std::vector<at::Tensor>, std::vector<int64_t>>())
      .def("forward", &DecodeLayers::forward);
}

#endif  // __AVX512VNNI__
