// What the two builds' one-call decode steps share (decode_step.cpp: AVX-512, the interleaved
// layout, bf16/fp16 activations; decode_step_avx2.cpp: AVX2, the row layout, float32 activations):
// the layers' tensors checked and laid out once, and the phases of a step through every layer in
// one OpenMP region, with a barrier between the phases that depend on each other. How a
// projection's activations are rounded and multiplied, and how attention reads its cache, each
// file's Step supplies.
//
// Per layer, in phases, a barrier after each (what every thread does alike, it does itself:
// the norms, silu * up and the rounding are a few microseconds a layer, less than a barrier and the
// wait for one thread to do them alone; the threads compute the same values bit for bit):
//   every thread  h = norm(residual [+= previous down]), rounded per group of q/k/v's weight;
//                 qkv = h @ Wqkv, its share of the output
//   per (sequence, kv head): rotary of its k and q heads, its new k/v into the cache, attention
//   every thread  the attention output rounded; o = . @ Wo, its share
//   every thread  h = norm(residual += o), rounded; gate_up = h @ Wgu, its share
//   every thread  silu(gate) * up, rounded; down = . @ Wdown, its share
// and after the last layer the final norm (residual += down), and, where the model's head is given,
// its input rounded and logits = . @ Whead, as float32. Each thread keeps its own residual stream
// (thread 0's is the caller's), normed rows and rounded activations; the products' outputs are
// shared. Before each barrier a thread asks for the first bytes of its share of the next weight,
// so they arrive while it waits.
#pragma once

#include <ATen/core/Tensor.h>
#include <omp.h>

#include <cstdint>
#include <type_traits>
#include <vector>

#include "fused_rows.h"

namespace tokenmill_layers {

constexpr int64_t kTensorsPerLayer = 16;  // 2 norms, 4 projections x (codes, scales, offsets), 2 caches
constexpr int64_t kIntsPerLinear = 4;     // bits, group size, output rows, two_parts
constexpr int64_t kMaxRows = 8;           // GEMV_MAX_ROWS in layers/quantized.py

template <typename Linear>
struct Layer {
  const void* input_norm;  // in final_norm's dtype, which run_layers is told
  const void* post_norm;
  Linear qkv, o, gate_up, down;
  void* k_cache;
  void* v_cache;
};

struct Shape {
  int64_t H, I, num_heads, num_kv_heads, D;
  int64_t qkv_width() const { return (num_heads + 2 * num_kv_heads) * D; }
};

// The layers in weights (kTensorsPerLayer a layer) and linears (kIntsPerLinear a projection),
// checked against each other, the final norm and the first layer's key cache (whose dtype and
// layout the caller has checked); linear_of(tensors, ints, K) checks and lays out one projection.
// Fills shape.H, I and D.
template <typename Linear, typename LinearOf>
std::vector<Layer<Linear>> layers_of(const std::vector<at::Tensor>& weights, const std::vector<int64_t>& linears,
                                        const at::Tensor& final_norm, const char* who, LinearOf linear_of,
                                        Shape& shape) {
  const int64_t num_layers = static_cast<int64_t>(weights.size()) / kTensorsPerLayer;
  TORCH_CHECK(num_layers > 0 && weights.size() == static_cast<size_t>(num_layers * kTensorsPerLayer) &&
                  linears.size() == static_cast<size_t>(num_layers * 4 * kIntsPerLinear),
              who, ": 16 tensors and 16 ints per layer");
  const at::Tensor& k0 = weights[kTensorsPerLayer - 2];
  TORCH_CHECK(k0.dim() == 4 && k0.is_contiguous() && k0.size(0) == shape.num_kv_heads &&
                  shape.num_heads % shape.num_kv_heads == 0,
              who, ": the caches must be contiguous [kv_heads, blocks, block_size, head_dim], heads a multiple of them");
  TORCH_CHECK(final_norm.dim() == 1 && final_norm.is_contiguous(), who, ": final_norm must be [H]");
  shape.H = final_norm.size(0);
  shape.D = k0.size(3);
  std::vector<Layer<Linear>> layers;
  for (int64_t l = 0; l < num_layers; ++l) {
    const at::Tensor* t = weights.data() + l * kTensorsPerLayer;
    const int64_t* ints = linears.data() + l * 4 * kIntsPerLinear;
    for (int i : {0, 1})
      TORCH_CHECK(t[i].dim() == 1 && t[i].size(0) == shape.H && t[i].is_contiguous() &&
                      t[i].scalar_type() == final_norm.scalar_type(),
                  who, ": norm weights must be [H], in final_norm's dtype");
    for (int i : {14, 15})
      TORCH_CHECK(t[i].sizes() == k0.sizes() && t[i].is_contiguous() && t[i].scalar_type() == k0.scalar_type(),
                  who, ": every cache must be like the first layer's");
    Layer<Linear> layer{t[0].data_ptr(), t[1].data_ptr(), linear_of(t + 2, ints, shape.H),
                        linear_of(t + 5, ints + 4, shape.num_heads * shape.D), linear_of(t + 8, ints + 8, shape.H), {},
                        t[14].data_ptr(), t[15].data_ptr()};
    shape.I = layer.gate_up.N / 2;
    layer.down = linear_of(t + 11, ints + 12, shape.I);
    TORCH_CHECK(layer.qkv.N == shape.qkv_width() && layer.o.N == shape.H && layer.down.N == shape.H &&
                    layer.gate_up.N == 2 * shape.I,
                who, ": projection shapes do not match the model's");
    layers.push_back(layer);
  }
  return layers;
}

// One step's products, shared between the threads (each writes its share), [M, width] each.
template <typename T>
struct Buffers {
  std::vector<T> qkv, attn, o, gate_up, down;
  Buffers(int64_t M, const Shape& s)
      : qkv(M * s.qkv_width()), attn(M * s.num_heads * s.D), o(M * s.H), gate_up(M * 2 * s.I), down(M * s.H) {}
};

// What each thread computes for itself between the products, [M, width] each.
template <typename T>
struct ThreadRows {
  std::vector<T> residual, h, gated;
  ThreadRows(int64_t M, const Shape& s) : residual(M * s.H), h(M * s.H), gated(M * s.I) {}
};

// The step through every layer: x [M, H] is the residual stream (changed in place), y [M, H] gets
// the final norm; with a head (else nullptr), logits [M, head->N] get y @ head as the head's own
// call would give them (its output dtype T, then float32). Step supplies (all run on every thread):
//   Scratch scratch(int threads)                     each thread's own buffers
//   void round(const Linear& w, const T* x, M, Scratch&)   x [M, w.K] rounded for w, into the thread's scratch
//   void multiply(const Linear& w, M, thread, threads, Scratch&, T* out)   out [M, w.N], the thread's share
//   void attend(const Layer& layer, T* qkv, T* attn, b, kv, Scratch&)      one (sequence, kv head) item
// and each Linear prefetch_share(thread, threads).
template <typename T, typename W, typename Step, typename Linear>
void run_layers(Step& step, const std::vector<Layer<Linear>>& layers, const Shape& shape, int64_t M, double eps,
                const W* final_norm, T* residual, T* y, int num_threads, const Linear* head = nullptr,
                float* logits = nullptr) {
  Buffers<T> b(M, shape);
  // the head's output in T: float32 logits are T's values (a float32 step writes them straight)
  std::vector<T> head_out(head != nullptr && !std::is_same_v<T, float> ? M * head->N : 0);
  const int64_t H = shape.H, I = shape.I, items = M * shape.num_kv_heads;
  auto norm = [&](const T* x, T* res, const void* w, T* out) {
    for (int64_t m = 0; m < M; ++m)
      tokenmill_rows::norm_row(x + m * H, res == nullptr ? nullptr : res + m * H, static_cast<const W*>(w),
                               out + m * H, H, eps);
  };
#pragma omp parallel num_threads(num_threads)
  {
    const int thread = omp_get_thread_num(), threads = omp_get_num_threads();
    auto scratch = step.scratch(threads);
    ThreadRows<T> mine(M, shape);
    T* res = mine.residual.data();
    if (thread == 0) {
      res = residual;
    } else {
      std::copy(residual, residual + M * H, res);
    }
    for (size_t i = 0; i < layers.size(); ++i) {
      const Layer<Linear>& layer = layers[i];
      if (i == 0) {
        norm(res, nullptr, layer.input_norm, mine.h.data());
      } else {
        norm(b.down.data(), res, layer.input_norm, mine.h.data());
      }
      step.round(layer.qkv, mine.h.data(), M, scratch);
      step.multiply(layer.qkv, M, thread, threads, scratch, b.qkv.data());
      layer.o.prefetch_share(thread, threads);
#pragma omp barrier
      for (int64_t item = items * thread / threads; item < items * (thread + 1) / threads; ++item)
        step.attend(layer, b.qkv.data(), b.attn.data(), item / shape.num_kv_heads, item % shape.num_kv_heads, scratch);
#pragma omp barrier
      step.round(layer.o, b.attn.data(), M, scratch);
      step.multiply(layer.o, M, thread, threads, scratch, b.o.data());
      layer.gate_up.prefetch_share(thread, threads);
#pragma omp barrier
      norm(b.o.data(), res, layer.post_norm, mine.h.data());
      step.round(layer.gate_up, mine.h.data(), M, scratch);
      step.multiply(layer.gate_up, M, thread, threads, scratch, b.gate_up.data());
      layer.down.prefetch_share(thread, threads);
#pragma omp barrier
      for (int64_t m = 0; m < M; ++m)
        tokenmill_rows::silu_and_mul_row(b.gate_up.data() + m * 2 * I, mine.gated.data() + m * I, I);
      step.round(layer.down, mine.gated.data(), M, scratch);
      step.multiply(layer.down, M, thread, threads, scratch, b.down.data());
      if (i + 1 < layers.size()) {
        layers[i + 1].qkv.prefetch_share(thread, threads);
      } else if (head != nullptr) {
        head->prefetch_share(thread, threads);
      }
#pragma omp barrier
    }
    if (head != nullptr) {
      T* normed = thread == 0 ? y : mine.h.data();  // thread 0's final norm is the caller's y
      norm(b.down.data(), res, final_norm, normed);
      step.round(*head, normed, M, scratch);
      if constexpr (std::is_same_v<T, float>) {
        step.multiply(*head, M, thread, threads, scratch, logits);
      } else {
        step.multiply(*head, M, thread, threads, scratch, head_out.data());
#pragma omp barrier
        const int64_t total = M * head->N;
        for (int64_t i = total * thread / threads; i < total * (thread + 1) / threads; ++i)
          logits[i] = static_cast<float>(head_out[i]);
      }
    }
  }
  if (head == nullptr) norm(b.down.data(), residual, final_norm, y);
}

}  // namespace tokenmill_layers
