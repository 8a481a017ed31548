// Matrix products of many bf16 activation rows (prefill, large decode batches) with
// group-quantized weights in the interleaved layout (layers/quantized.py, csrc/quant_gemv_q8.cpp),
// so that no bf16 copy of the weights has to be kept for them:
//
//   quant_gemm(x [M, K] bf16, codes, scales, offsets, bits, G, N, backend) -> [M, N] bf16
//
// Each thread takes a share of the 16-row output blocks. A few blocks at a time, it dequantizes
// their weights (w = s u + o in float32, rounded to bf16: the dequantized weight exactly) into a
// "panel" in cache, laid out as the matrix units read B: per block, K / 2 rows of 64 bytes, row r
// holding the 16 output rows' bf16 pairs (w[n, 2 r], w[n, 2 r + 1]). Then every activation row
// multiplies against the panel, which is dequantized once per call however many rows there are.
//
// Two backends multiply from the same panel:
// - AMX (Sapphire Rapids and later): 32 x 32 outputs at a time in four float32 tiles, from two
//   16 x 32 activation tiles and two 32 x 16 panel tiles per 32 columns of K (tdpbf16ps);
// - AVX-512 BF16 (vdpbf16ps): 8 rows x 32 outputs in 16 registers, a broadcast activation pair
//   against a panel row.
// backend: 0 = the best this CPU has, 1 = AVX-512 BF16 (tests compare the two), and
// quant_gemm_backends() says which exist (1: AVX-512 BF16, 2: AMX as well).
#include <ATen/Parallel.h>
#include <ATen/core/Tensor.h>
#include <ATen/ops/empty.h>
#include <c10/util/BFloat16.h>
#include <c10/util/Half.h>
#include <immintrin.h>
#include <torch/library.h>

#include "quant_layout.h"
#include "vec_math.h"

#include <algorithm>
#include <cstdint>
#include <cstring>
#include <memory>
#include <vector>

#if defined(__AMX_TILE__) && defined(__AMX_BF16__)
#include <sys/syscall.h>
#include <unistd.h>
#define TOKENMILL_AMX 1
#endif

namespace {

constexpr int64_t kLanes = tokenmill_quant::kInterleavedLanes;  // output rows per block
constexpr int64_t kPanelBytes = 768 << 10;  // blocks dequantized at a time: about this much, in L2
constexpr int64_t kRowBytes = 64;      // one panel row: 16 outputs x a bf16 pair
constexpr int64_t kInterleavedRows = 128;  // up to this many rows, dequantize while multiplying (AMX)

#if defined(__AVX512BF16__)

using tokenmill_vec::load;

// Byte indices that pick code t of outputs 0-7 (part 0) or 8-15 (part 1) of a quad into the low
// byte of 16 dwords, in panel-row order: output n's codes t and t + 1 side by side.
inline __m512i pick_codes(int t, int part) {
  alignas(64) uint8_t index[64] = {};
  for (int lane = 0; lane < 16; ++lane) index[4 * lane] = static_cast<uint8_t>(4 * (8 * part + lane / 2) + t + lane % 2);
  return _mm512_load_si512(index);
}

struct QuadPicks {
  __m512i pick[2][2];  // [pair][part]
  __m512i lanes[2];    // per part: the scale/offset lane of each of its 16 values (outputs 0-7, 8-15, twice each)
  QuadPicks() {
    for (int pair = 0; pair < 2; ++pair)
      for (int part = 0; part < 2; ++part) pick[pair][part] = pick_codes(2 * pair, part);
    lanes[0] = _mm512_set_epi32(7, 7, 6, 6, 5, 5, 4, 4, 3, 3, 2, 2, 1, 1, 0, 0);
    lanes[1] = _mm512_add_epi32(lanes[0], _mm512_set1_epi32(8));
  }
};

// One quad (4 columns x 16 outputs, byte 4 n + t = output n's code at column 4 j + t) as two
// panel rows: columns (0, 1) and (2, 3) of each output, scaled and offset in float32.
inline void quad_to_panel(__m512i quad, const QuadPicks& picks, const __m512 s[2], const __m512 o[2], uint16_t* rows) {
  constexpr __mmask64 kLowBytes = 0x1111111111111111ull;
  for (int pair = 0; pair < 2; ++pair) {
    __m512 half[2];
    for (int part = 0; part < 2; ++part) {
      const __m512i u = _mm512_maskz_permutexvar_epi8(kLowBytes, picks.pick[pair][part], quad);
      half[part] = _mm512_fmadd_ps(_mm512_cvtepi32_ps(u), s[part], o[part]);
    }
    _mm512_storeu_si512(rows + pair * 32, (__m512i)_mm512_cvtne2ps_pbh(half[1], half[0]));
  }
}

// Dequantizes a weight's blocks into panels (K / 2 rows of 32 bf16 per block), a range of
// groups at a time.
template <typename S>
struct Dequantizer {
  const uint8_t* codes;
  const S* scales;
  const S* offsets;
  int64_t groups, G, bits;
  QuadPicks picks;

  // groups [g_begin, g_end) of block b into its panel
  void operator()(int64_t b, int64_t g_begin, int64_t g_end, uint16_t* panel) const {
    const __m512i nibble = _mm512_set1_epi8(0x0F);
    const int64_t group_bytes = kLanes * G * bits / 8;
    for (int64_t g = g_begin; g < g_end; ++g) {
      const __m512 scale = load(scales + (b * groups + g) * kLanes, kLanes);
      const __m512 offset = load(offsets + (b * groups + g) * kLanes, kLanes);
      const __m512 s[2] = {_mm512_permutexvar_ps(picks.lanes[0], scale), _mm512_permutexvar_ps(picks.lanes[1], scale)};
      const __m512 o[2] = {_mm512_permutexvar_ps(picks.lanes[0], offset), _mm512_permutexvar_ps(picks.lanes[1], offset)};
      const uint8_t* group_codes = codes + (b * groups + g) * group_bytes;
      uint16_t* group_rows = panel + g * G * kLanes;  // G / 2 rows of 32 bf16
      if (bits == 8) {
        for (int64_t j = 0; j < G / 4; ++j)
          quad_to_panel(_mm512_loadu_si512(group_codes + 64 * j), picks, s, o, group_rows + 64 * j);
      } else {  // vector j: quad j in the low nibbles, quad j + G / 8 in the high ones
        for (int64_t j = 0; j < G / 8; ++j) {
          const __m512i v = _mm512_loadu_si512(group_codes + 64 * j);
          quad_to_panel(_mm512_and_si512(v, nibble), picks, s, o, group_rows + 64 * j);
          quad_to_panel(_mm512_and_si512(_mm512_srli_epi16(v, 4), nibble), picks, s, o,
                        group_rows + 64 * (j + G / 8));
        }
      }
    }
  }
};

// out[m, n] for rows [0, rows) and the panel's 32 outputs, into float32 acc [rows][32].
template <int ROWS>
void avx512_rows(const uint16_t* x, int64_t K, const uint16_t* panel0, const uint16_t* panel1, float* acc) {
  __m512 c[ROWS][2];
  for (int r = 0; r < ROWS; ++r) c[r][0] = c[r][1] = _mm512_setzero_ps();
  for (int64_t k2 = 0; k2 < K / 2; ++k2) {
    const __m512bh b0 = (__m512bh)_mm512_loadu_si512(panel0 + 32 * k2);
    const __m512bh b1 = (__m512bh)_mm512_loadu_si512(panel1 + 32 * k2);
    for (int r = 0; r < ROWS; ++r) {
      int32_t pair;
      std::memcpy(&pair, x + r * K + 2 * k2, sizeof(pair));
      const __m512bh a = (__m512bh)_mm512_set1_epi32(pair);
      c[r][0] = _mm512_dpbf16_ps(c[r][0], a, b0);
      c[r][1] = _mm512_dpbf16_ps(c[r][1], a, b1);
    }
  }
  for (int r = 0; r < ROWS; ++r) {
    _mm512_storeu_ps(acc + r * 32, c[r][0]);
    _mm512_storeu_ps(acc + r * 32 + 16, c[r][1]);
  }
}

using RowsFn = void (*)(const uint16_t*, int64_t, const uint16_t*, const uint16_t*, float*);

RowsFn rows_fn(int64_t rows) {
  switch (rows) {
    case 1: return avx512_rows<1>;
    case 2: return avx512_rows<2>;
    case 3: return avx512_rows<3>;
    case 4: return avx512_rows<4>;
    case 5: return avx512_rows<5>;
    case 6: return avx512_rows<6>;
    case 7: return avx512_rows<7>;
    default: return avx512_rows<8>;
  }
}

// acc [rows][32] (outputs n0 .. n0 + 31) into out (row stride N), the outputs below n_end.
void store_outputs(const float* acc, int64_t rows, c10::BFloat16* out, int64_t N, int64_t n0, int64_t n_end) {
  const int64_t width = std::min<int64_t>(32, n_end - n0);
  const __mmask32 keep = width == 32 ? ~__mmask32{0} : (__mmask32{1} << width) - 1;
  for (int64_t r = 0; r < rows; ++r) {  // vcvtne2ps2bf16 rounds to nearest even
    const __m512bh both = _mm512_cvtne2ps_pbh(_mm512_loadu_ps(acc + r * 32 + 16), _mm512_loadu_ps(acc + r * 32));
    _mm512_mask_storeu_epi16(out + r * N + n0, keep, (__m512i)both);
  }
}

#if defined(TOKENMILL_AMX)

// Linux hands a process the AMX tile state only when asked (arch_prctl ARCH_REQ_XCOMP_PERM).
bool amx_permitted() {
  static const bool permitted = [] {
    constexpr int kReqXcompPerm = 0x1023, kXfeatureTileData = 18;
    return syscall(SYS_arch_prctl, kReqXcompPerm, kXfeatureTileData) == 0;
  }();
  return permitted;
}

// Tiles 0-3: the float32 outputs (rows m and m + 16, outputs 0-15 and 16-31); 4-5: activation
// rows m .. m + 15 and m + 16 .. m + 31 (32 columns of K); 6-7: the two blocks' panel rows.
struct alignas(64) TileConfig {
  uint8_t palette = 1;
  uint8_t start_row = 0;
  uint8_t reserved[14] = {};
  uint16_t bytes_per_row[16] = {};
  uint8_t rows[16] = {};
};

void configure_tiles() {
  TileConfig config;
  for (int t = 0; t < 8; ++t) {
    config.bytes_per_row[t] = 64;
    config.rows[t] = 16;
  }
  _tile_loadconfig(&config);
}

// 16 A_TILES activation rows (x, row stride K) against the panels of two blocks, into float32
// acc [16 A_TILES][32]. With a dequantizer, the panels are dequantized a unit of K (a group, at
// least 32 columns) at a time, each while the tile unit multiplies the one before.
template <int A_TILES, typename S>
void amx_rows(const uint16_t* x, int64_t K, uint16_t* panel0, uint16_t* panel1, float* acc,
              const Dequantizer<S>* dequantize, int64_t b0) {
  _tile_zero(0);
  _tile_zero(1);
  if constexpr (A_TILES == 2) {
    _tile_zero(2);
    _tile_zero(3);
  }
  const int64_t stride = K * 2;
  const int64_t unit = dequantize == nullptr ? K : std::max<int64_t>(32, dequantize->G);
  const auto dequantize_unit = [&](int64_t k0) {  // columns [k0, k0 + unit) of both panels
    const int64_t g0 = k0 / dequantize->G, g1 = (k0 + unit) / dequantize->G;
    (*dequantize)(b0, g0, g1, panel0);
    (*dequantize)(b0 + 1, g0, g1, panel1);
  };
  if (dequantize != nullptr) dequantize_unit(0);
  for (int64_t k0 = 0; k0 < K; k0 += unit) {
    for (int64_t k = k0; k < k0 + unit; k += 32) {
      if (dequantize == nullptr && k + 32 < K) {  // the next panel rows, from L2 (~20% at 2,048 rows)
        for (int line = 0; line < 16; ++line) {
          _mm_prefetch(reinterpret_cast<const char*>(panel0 + 16 * (k + 32) + 32 * line), _MM_HINT_T0);
          _mm_prefetch(reinterpret_cast<const char*>(panel1 + 16 * (k + 32) + 32 * line), _MM_HINT_T0);
        }
      }
      // each tile loads as soon as the multiply before it that reads the same tile is issued
      _tile_loadd(4, x + k, stride);
      _tile_loadd(6, panel0 + 16 * k, kRowBytes);  // panel rows k / 2 .. k / 2 + 15
      _tile_dpbf16ps(0, 4, 6);
      _tile_loadd(7, panel1 + 16 * k, kRowBytes);
      if constexpr (A_TILES == 2) _tile_loadd(5, x + 16 * K + k, stride);
      _tile_dpbf16ps(1, 4, 7);
      if constexpr (A_TILES == 2) {
        _tile_dpbf16ps(2, 5, 6);
        _tile_dpbf16ps(3, 5, 7);
      }
    }
    // the next unit converts while this one multiplies
    if (dequantize != nullptr && k0 + unit < K) dequantize_unit(k0 + unit);
  }
  _tile_stored(0, acc, 128);
  _tile_stored(1, acc + 16, 128);
  if constexpr (A_TILES == 2) {
    _tile_stored(2, acc + 16 * 32, 128);
    _tile_stored(3, acc + 16 * 32 + 16, 128);
  }
}

// Activation rows for the tiles, 32 at a time: tile loads read whole tiles, so the last rows
// (fewer than 32) come from a zero-padded copy made once per call and thread.
struct TileRows {
  const uint16_t* x;
  int64_t M, K;
  std::vector<uint16_t> tail;

  TileRows(const uint16_t* x_, int64_t M_, int64_t K_) : x(x_), M(M_), K(K_) {
    const int64_t full = M / 32 * 32;
    if (full < M) {
      tail.assign(tile_rows(full) * K, 0);
      std::memcpy(tail.data(), x + full * K, (M - full) * K * sizeof(uint16_t));
    }
  }
  static int64_t rows_at(int64_t M, int64_t m) { return std::min<int64_t>(32, M - m); }
  int64_t tile_rows(int64_t m) const { return rows_at(M, m) <= 16 ? 16 : 32; }
  const uint16_t* at(int64_t m) const { return rows_at(M, m) == 32 ? x + m * K : tail.data(); }
};

// Rows [m, m + 32) of x against blocks b and b + 1 (panels p0, p1), dequantizing them on the way
// where dequantize is given.
template <typename S>
void amx_block_rows(const TileRows& a, int64_t m, uint16_t* p0, uint16_t* p1, float* acc,
                    const Dequantizer<S>* dequantize, int64_t b) {
  if (a.tile_rows(m) == 16)
    amx_rows<1>(a.at(m), a.K, p0, p1, acc, dequantize, b);
  else
    amx_rows<2>(a.at(m), a.K, p0, p1, acc, dequantize, b);
}

#endif  // TOKENMILL_AMX

template <typename S>
void run(const at::Tensor& x, const at::Tensor& codes, const at::Tensor& scales, const at::Tensor& offsets,
         int64_t bits, int64_t G, bool amx, at::Tensor& out) {
  const int64_t M = x.size(0), K = x.size(1), N = out.size(1);
  const int64_t groups = K / G, blocks = codes.size(0);
  const uint16_t* xs = reinterpret_cast<const uint16_t*>(x.data_ptr<c10::BFloat16>());
  c10::BFloat16* out_ptr = out.data_ptr<c10::BFloat16>();
  const int64_t block_elems = K * kLanes;  // one block's panel, in bf16
  const int64_t panel_blocks = std::max<int64_t>(2, kPanelBytes / (2 * block_elems) / 2 * 2);
  const Dequantizer<S> dequantize{codes.data_ptr<uint8_t>(), scales.data_ptr<S>(), offsets.data_ptr<S>(), groups, G,
                                  bits, QuadPicks()};
  at::parallel_for(0, blocks, 2, [&](int64_t begin, int64_t end) {
    // an even number of panels: a lone last block pairs with zeros (not zero-filled before)
    const std::unique_ptr<uint16_t[]> panel(new uint16_t[(panel_blocks + 1) * block_elems]);
    std::vector<float> acc(32 * 32);
#if defined(TOKENMILL_AMX)
    if (amx) configure_tiles();
    const TileRows a(amx ? xs : nullptr, amx ? M : 0, K);
#endif
    for (int64_t b0 = begin; b0 < end; b0 += panel_blocks) {
      const int64_t count = std::min(panel_blocks, end - b0);
      const int64_t n_end = std::min(N, (b0 + count) * kLanes);
      uint16_t* const p = panel.get();
      if (count % 2) std::fill(p + count * block_elems, p + (count + 1) * block_elems, 0);
      if (amx && M <= kInterleavedRows) {
#if defined(TOKENMILL_AMX)
        // block pairs outside: the first 32 rows dequantize a pair as they go, the others reuse it
        for (int64_t i = 0; i < count; i += 2) {
          uint16_t* p0 = p + i * block_elems;
          uint16_t* p1 = p + (i + 1) * block_elems;
          if (i + 1 == count) dequantize(b0 + i, 0, groups, p0);  // its partner is zeros
          for (int64_t m = 0; m < M; m += 32) {
            const bool first = m == 0 && i + 1 < count;
            amx_block_rows(a, m, p0, p1, acc.data(), first ? &dequantize : nullptr, b0 + i);
            store_outputs(acc.data(), TileRows::rows_at(M, m), out_ptr + m * N, N, (b0 + i) * kLanes, n_end);
          }
        }
#endif
        continue;
      }
      for (int64_t i = 0; i < count; ++i) dequantize(b0 + i, 0, groups, p + i * block_elems);
      if (amx) {
#if defined(TOKENMILL_AMX)
        for (int64_t m = 0; m < M; m += 32) {  // rows outside: each 32 rows' tiles stay in L1
          for (int64_t i = 0; i < count; i += 2) {
            amx_block_rows<S>(a, m, p + i * block_elems, p + (i + 1) * block_elems, acc.data(), nullptr, b0 + i);
            store_outputs(acc.data(), TileRows::rows_at(M, m), out_ptr + m * N, N, (b0 + i) * kLanes, n_end);
          }
        }
#endif
      } else {
        for (int64_t m = 0; m < M; m += 8) {
          const int64_t rows = std::min<int64_t>(8, M - m);
          const RowsFn multiply = rows_fn(rows);
          for (int64_t i = 0; i < count; i += 2) {
            multiply(xs + m * K, K, p + i * block_elems, p + (i + 1) * block_elems, acc.data());
            store_outputs(acc.data(), rows, out_ptr + m * N, N, (b0 + i) * kLanes, n_end);
          }
        }
      }
    }
#if defined(TOKENMILL_AMX)
    if (amx) _tile_release();
#endif
  });
}

#endif  // __AVX512BF16__

int64_t quant_gemm_backends() {
#if defined(TOKENMILL_AMX)
  if (amx_permitted()) return 2;
#endif
#if defined(__AVX512BF16__)
  return 1;
#else
  return 0;
#endif
}

at::Tensor quant_gemm(const at::Tensor& x_in, const at::Tensor& codes, const at::Tensor& scales,
                      const at::Tensor& offsets, int64_t bits, int64_t group_size, int64_t N, int64_t backend) {
  TORCH_CHECK(x_in.dim() == 2 && x_in.scalar_type() == at::kBFloat16, "x must be a bfloat16 [M, K] matrix");
  tokenmill_quant::check_interleaved(x_in, codes, scales, offsets, bits, group_size, N);
  TORCH_CHECK(x_in.size(1) % 32 == 0, "K must be a multiple of 32");
  TORCH_CHECK(backend == 0 || backend == 1, "backend must be 0 (best) or 1 (AVX-512 BF16)");
#if defined(__AVX512BF16__)
  const at::Tensor x = x_in.contiguous();
  at::Tensor out = at::empty({x.size(0), N}, x.options());
  const bool amx = backend == 0 && quant_gemm_backends() == 2;
  if (scales.scalar_type() == at::kHalf)
    run<c10::Half>(x, codes, scales, offsets, bits, group_size, amx, out);
  else
    run<float>(x, codes, scales, offsets, bits, group_size, amx, out);
  return out;
#else
  TORCH_CHECK(false, "quant_gemm needs a CPU with AVX-512 BF16");
#endif
}

}  // namespace

TORCH_LIBRARY_FRAGMENT(tokenmill, m) {
  m.def("quant_gemm(Tensor x, Tensor codes, Tensor scales, Tensor offsets, int bits, int group_size, int rows, "
        "int backend=0) -> Tensor");
  m.def("quant_gemm_backends() -> int", quant_gemm_backends);
}

TORCH_LIBRARY_IMPL(tokenmill, CPU, m) {
  m.impl("quant_gemm", quant_gemm);
}
