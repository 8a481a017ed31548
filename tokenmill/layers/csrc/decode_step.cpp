// A few-row decode step through every decoder layer in one call and one parallel region, for models
// whose linears all run the VNNI kernel (quant_gemv_q8.h) and whose attention is the paged kernel
// (paged_decode.h). It computes what models/decode_plan.py computes, with the same row functions
// in the same order, so the result is the plan's bit for bit; what it saves is the plan's ~10 op
// calls per layer (each a few microseconds of dispatch and allocation) and, more, the threads'
// fork and join around every one of them: here the threads stay in one region and meet at a
// barrier between the phases that depend on each other.
//
//   DecodeLayers(weights, linears, num_heads, num_kv_heads, scale, eps, final_norm)   once per model
//   .forward(x [M, H], positions, cos, sin, slots, block_tables, seq_lens, context) -> final norm [M, H]
//
// x: the step's embeddings, used as the residual stream (changed in place). Per layer, weights
// holds 16 tensors: input norm, post-attention norm, then codes, scales and offsets of the fused
// q/k/v, o, fused gate/up and down projections (the interleaved layout), then the key and value
// caches; linears holds 4 ints per projection: bits, group size, output rows, two_parts (16-bit
// activations). Per layer, in phases (`single`: one thread, the others wait):
//   single  h = norm(residual [+= previous down]); h quantized per group of q/k/v's weight
//   all     qkv = h @ Wqkv, each thread a share of the 16-row blocks
//   all     per (sequence, kv head): rotary of its k and q heads, its new k/v into the cache, attention
//   single  attention output quantized         all  o = . @ Wo
//   single  h = norm(residual += o); quantized all  gate_up = h @ Wgu
//   single  silu(gate) * up; quantized         all  down = . @ Wdown
// and after the last layer the final norm (residual += down).
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
#include <vector>

#include "fused_rows.h"
#include "paged_decode.h"
#include "quant_gemv_q8.h"

namespace {

#if defined(__AVX512VNNI__)
using namespace tokenmill_q8;
using tokenmill_attention::Geometry;

constexpr int64_t kTensorsPerLayer = 16;
constexpr int64_t kIntsPerLinear = 4;
constexpr int64_t kMaxRows = 8;  // GEMV_MAX_ROWS in layers/quantized.py

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

struct Layer {
  const void* input_norm;
  const void* post_norm;
  Linear qkv, o, gate_up, down;
  void* k_cache;
  void* v_cache;
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

// The activations a projection multiplies, quantized per group of its weight (one thread writes,
// all read after the barrier).
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

template <typename T>
void gemv(const Linear& w, const Activations& a, int64_t M, int thread, int num_threads, float* local, T* out) {
  if (w.half_scales) {
    gemv_share<T, c10::Half>(w, a, M, thread, num_threads, local, out);
  } else {
    gemv_share<T, float>(w, a, M, thread, num_threads, local, out);
  }
}

// Everything the step reads besides the layers.
struct StepInputs {
  int64_t M, H, I, num_heads, num_kv_heads, D;
  const int64_t* positions;
  const int64_t* slots;
  const int64_t* block_tables;
  const int64_t* seq_lens;
  const float* cos;
  const float* sin;
  float scale;
  double eps;
  Geometry geometry;
};

// Rotary, KV write and attention of sequence b's kv head kv (its group of query heads), as
// decode_attention in paged_decode.cpp does them for the whole step.
template <typename T>
void attention_item(const StepInputs& s, const Layer& layer, T* qkv, T* q_rows, T* out, float* scores, int64_t b,
                    int64_t kv) {
  const Geometry& g = s.geometry;
  const int64_t stride = (s.num_heads + 2 * s.num_kv_heads) * s.D;
  T* row = qkv + b * stride;
  const float* cos = s.cos + s.positions[b] * s.D;
  const float* sin = s.sin + s.positions[b] * s.D;
  T* key = row + (s.num_heads + kv) * s.D;
  tokenmill_rows::rotate_row(key, cos, sin, s.D);
  tokenmill_rows::write_kv_row(reinterpret_cast<const char*>(key),
                               reinterpret_cast<const char*>(row + (s.num_heads + s.num_kv_heads + kv) * s.D),
                               static_cast<char*>(layer.k_cache), static_cast<char*>(layer.v_cache), kv, s.slots[b],
                               g.num_blocks, g.block_size, s.D, sizeof(T));
  const int64_t head0 = kv * g.groups;
  for (int64_t h = head0; h < head0 + g.groups; ++h) {
    tokenmill_rows::rotate_row(row + h * s.D, cos, sin, s.D);
    std::copy(row + h * s.D, row + (h + 1) * s.D, q_rows + (b * s.num_heads + h) * s.D);
  }
  const int64_t len = std::min(s.seq_lens[b], g.context);
  tokenmill_attention::qk_item(g, q_rows, static_cast<const T*>(layer.k_cache), s.block_tables, b, kv, len, s.scale,
                               scores, g.context);
  for (int64_t h = 0; h < g.groups; ++h) tokenmill_attention::softmax_row(scores + h * g.context, len, g.context);
  tokenmill_attention::pv_item(g, scores, g.context, static_cast<const T*>(layer.v_cache), s.block_tables, b, kv, len,
                               out);
}

template <typename T, typename W>
void run_layers(const StepInputs& s, const std::vector<Layer>& layers, const W* final_norm, T* residual, T* y) {
  const int64_t M = s.M, H = s.H, qkv_width = (s.num_heads + 2 * s.num_kv_heads) * s.D;
  const int64_t attn_width = s.num_heads * s.D;
  std::vector<T> h(M * H), qkv(M * qkv_width), q_rows(M * attn_width), attn(M * attn_width), o(M * H);
  std::vector<T> gate_up(M * 2 * s.I), gated(M * s.I), down(M * H);
  int64_t max_K = std::max({H, attn_width, s.I}), max_blocks = 0;
  for (const Layer& l : layers)
    for (const Linear* w : {&l.qkv, &l.o, &l.gate_up, &l.down}) max_blocks = std::max(max_blocks, w->blocks);
  Activations act(M, max_K);
  const int64_t items = M * s.num_kv_heads;
  const int num_threads = static_cast<int>(std::max<int64_t>(1, std::min<int64_t>(at::get_num_threads(), max_blocks)));
  auto norm = [&](const T* x, T* res, const void* w, T* out) {
    for (int64_t m = 0; m < M; ++m)
      tokenmill_rows::norm_row(x + m * H, res == nullptr ? nullptr : res + m * H, static_cast<const W*>(w),
                               out + m * H, H, s.eps);
  };
#pragma omp parallel num_threads(num_threads)
  {
    const int thread = omp_get_thread_num(), threads = omp_get_num_threads();
    std::vector<float> local(kPassRows * (max_blocks / threads + 2) * kLanes);
    std::vector<float> scores(s.geometry.groups * s.geometry.context);
    for (size_t i = 0; i < layers.size(); ++i) {
      const Layer& layer = layers[i];
#pragma omp single
      {
        if (i == 0) {
          norm(residual, nullptr, layer.input_norm, h.data());
        } else {
          norm(down.data(), residual, layer.input_norm, h.data());
        }
        act.quantize(h.data(), M, layer.qkv);
      }
      gemv(layer.qkv, act, M, thread, threads, local.data(), qkv.data());
      layer.o.prefetch_share(thread, threads);
#pragma omp barrier
      for (int64_t item = items * thread / threads; item < items * (thread + 1) / threads; ++item)
        attention_item(s, layer, qkv.data(), q_rows.data(), attn.data(), scores.data(), item / s.num_kv_heads,
                       item % s.num_kv_heads);
#pragma omp barrier
#pragma omp single
      act.quantize(attn.data(), M, layer.o);
      gemv(layer.o, act, M, thread, threads, local.data(), o.data());
      layer.gate_up.prefetch_share(thread, threads);
#pragma omp barrier
#pragma omp single
      {
        norm(o.data(), residual, layer.post_norm, h.data());
        act.quantize(h.data(), M, layer.gate_up);
      }
      gemv(layer.gate_up, act, M, thread, threads, local.data(), gate_up.data());
      layer.down.prefetch_share(thread, threads);
#pragma omp barrier
#pragma omp single
      {
        for (int64_t m = 0; m < M; ++m)
          tokenmill_rows::silu_and_mul_row(gate_up.data() + m * 2 * s.I, gated.data() + m * s.I, s.I);
        act.quantize(gated.data(), M, layer.down);
      }
      gemv(layer.down, act, M, thread, threads, local.data(), down.data());
      if (i + 1 < layers.size()) layers[i + 1].qkv.prefetch_share(thread, threads);
#pragma omp barrier
    }
  }
  norm(down.data(), residual, final_norm, y);
}

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
               double scale, double eps, at::Tensor final_norm)
      : weights_(std::move(weights)), final_norm_(std::move(final_norm)), num_heads_(num_heads),
        num_kv_heads_(num_kv_heads), scale_(static_cast<float>(scale)), eps_(eps) {
    const int64_t num_layers = static_cast<int64_t>(weights_.size()) / kTensorsPerLayer;
    TORCH_CHECK(num_layers > 0 && weights_.size() == static_cast<size_t>(num_layers * kTensorsPerLayer) &&
                    linears.size() == static_cast<size_t>(num_layers * 4 * kIntsPerLinear),
                "DecodeLayers: 16 tensors and 16 ints per layer");
    const at::Tensor& k0 = weights_[kTensorsPerLayer - 2];
    TORCH_CHECK(k0.dim() == 4 && (k0.scalar_type() == at::kBFloat16 || k0.scalar_type() == at::kHalf),
                "DecodeLayers: caches must be bfloat16 or float16 [kv_heads, blocks, block_size, head_dim]");
    TORCH_CHECK(k0.size(0) == num_kv_heads && num_heads % num_kv_heads == 0, "DecodeLayers: heads do not match the caches");
    H_ = final_norm_.size(0), D_ = k0.size(3);
    TORCH_CHECK(final_norm_.dim() == 1 && final_norm_.is_contiguous() && final_norm_.scalar_type() != at::kDouble,
                "DecodeLayers: final_norm must be [H]");
    const int64_t qkv_width = (num_heads + 2 * num_kv_heads) * D_;
    for (int64_t l = 0; l < num_layers; ++l) {
      const at::Tensor* t = weights_.data() + l * kTensorsPerLayer;
      const int64_t* ints = linears.data() + l * 4 * kIntsPerLinear;
      for (int i : {0, 1})
        TORCH_CHECK(t[i].dim() == 1 && t[i].size(0) == H_ && t[i].is_contiguous() &&
                        t[i].scalar_type() == final_norm_.scalar_type(), "DecodeLayers: norm weights must be [H], one dtype");
      for (int i : {14, 15})
        TORCH_CHECK(t[i].sizes() == k0.sizes() && t[i].is_contiguous() && t[i].scalar_type() == k0.scalar_type(),
                    "DecodeLayers: every cache must be like the first layer's");
      Layer layer{t[0].data_ptr(), t[1].data_ptr(), linear_of(t + 2, ints, H_),
                  linear_of(t + 5, ints + 4, num_heads * D_), linear_of(t + 8, ints + 8, H_), {},
                  t[14].data_ptr(), t[15].data_ptr()};
      I_ = layer.gate_up.N / 2;
      layer.down = linear_of(t + 11, ints + 12, I_);
      TORCH_CHECK(layer.qkv.N == qkv_width && layer.o.N == H_ && layer.down.N == H_ && layer.gate_up.N == 2 * I_,
                  "DecodeLayers: projection shapes do not match the model's");
      layers_.push_back(layer);
    }
  }

  // x [M, H]: the step's embeddings, the residual stream (changed in place); positions, slots,
  // seq_lens int64 [M]; block_tables int64 [M, max_blocks]; cos, sin float32 [max_positions, D].
  at::Tensor forward(at::Tensor x, at::Tensor positions, at::Tensor cos, at::Tensor sin, at::Tensor slots,
                     at::Tensor block_tables, at::Tensor seq_lens, int64_t context) {
    const at::Tensor& k0 = weights_[kTensorsPerLayer - 2];
    TORCH_CHECK(x.dim() == 2 && x.is_contiguous() && x.size(0) >= 1 && x.size(0) <= kMaxRows && x.size(1) == H_ &&
                    x.scalar_type() == k0.scalar_type(), "DecodeLayers: x must be contiguous [M <= 8, H] in the caches' dtype");
    const int64_t M = x.size(0);
    for (const at::Tensor* t : {&positions, &slots, &seq_lens})
      TORCH_CHECK(t->scalar_type() == at::kLong && t->is_contiguous() && t->dim() == 1 && t->size(0) == M,
                  "DecodeLayers: positions, slots and seq_lens must be int64 [M]");
    TORCH_CHECK(cos.scalar_type() == at::kFloat && cos.dim() == 2 && cos.size(1) == D_ && cos.is_contiguous() &&
                    sin.sizes() == cos.sizes() && sin.is_contiguous() && sin.scalar_type() == at::kFloat,
                "DecodeLayers: cos and sin must be contiguous float32 [max_positions, head_dim]");
    StepInputs s{M, H_, I_, num_heads_, num_kv_heads_, D_, positions.data_ptr<int64_t>(), slots.data_ptr<int64_t>(),
                 block_tables.data_ptr<int64_t>(), seq_lens.data_ptr<int64_t>(), cos.data_ptr<float>(),
                 sin.data_ptr<float>(), scale_, eps_, tokenmill_attention::geometry_of(k0, block_tables, M, num_heads_, context)};
    for (int64_t m = 0; m < M; ++m) {
      TORCH_CHECK(s.positions[m] >= 0 && s.positions[m] < cos.size(0), "DecodeLayers: position past the rotary table");
      TORCH_CHECK(s.slots[m] >= 0 && s.slots[m] < s.geometry.num_blocks * s.geometry.block_size,
                  "DecodeLayers: slot past the cache");
    }
    at::Tensor y = at::empty({M, H_}, x.options());
    for_dtype(x, "x", [&](auto xt) {
      using T = decltype(xt);
      for_dtype(final_norm_, "norm weights", [&](auto wt) {
        using W = decltype(wt);
        if constexpr (!std::is_same_v<T, float>)
          run_layers<T, W>(s, layers_, final_norm_.data_ptr<W>(), x.data_ptr<T>(), y.data_ptr<T>());
      });
    });
    return y;
  }

 private:
  std::vector<at::Tensor> weights_;  // what layers_ points into, kept alive
  at::Tensor final_norm_;
  std::vector<Layer> layers_;
  int64_t num_heads_, num_kv_heads_, H_ = 0, I_ = 0, D_ = 0;
  float scale_;
  double eps_;
};

}  // namespace

TORCH_LIBRARY_FRAGMENT(tokenmill, m) {
  m.class_<DecodeLayers>("DecodeLayers")
      .def(torch::init<std::vector<at::Tensor>, std::vector<int64_t>, int64_t, int64_t, double, double, at::Tensor>())
      .def("forward", &DecodeLayers::forward);
}

#endif  // __AVX512VNNI__
