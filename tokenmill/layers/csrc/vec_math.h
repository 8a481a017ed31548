// Vector math for our kernels: 16 float32 lanes. With AVX-512 a Vec16 is one __m512 and the raw
// intrinsics below serve the AVX-512-only kernels too; on AVX2 (fused_ops.cpp's build there) it is
// two __m256 halves, with the same functions.
#pragma once
#include <c10/util/BFloat16.h>
#include <c10/util/Half.h>
#include <immintrin.h>

#include <algorithm>
#include <cstdint>
#include <type_traits>

namespace tokenmill_vec {

#ifdef __AVX512F__
using Vec16 = __m512;
// The first n <= 16 elements at p as float32 (zero past n), and back with round-to-nearest-even.
inline __mmask16 first(int64_t n) { return static_cast<__mmask16>(n >= 16 ? 0xFFFF : (1u << n) - 1); }
inline __m512 load(const float* p, int64_t n) { return _mm512_maskz_loadu_ps(first(n), p); }
inline __m512 load(const c10::Half* p, int64_t n) { return _mm512_cvtph_ps(_mm256_maskz_loadu_epi16(first(n), p)); }
// Whole vectors of bf16 go through plain loads and stores: on the AMD EPYC (Zen 5) here the masked
// narrowing store (vpmovdw to memory under a mask) made add_rms_norm_ ~1.4x slower.
inline __m512 load(const c10::BFloat16* p, int64_t n) {
  const __m256i bits =
      n >= 16 ? _mm256_loadu_si256(reinterpret_cast<const __m256i*>(p)) : _mm256_maskz_loadu_epi16(first(n), p);
  return _mm512_castsi512_ps(_mm512_slli_epi32(_mm512_cvtepu16_epi32(bits), 16));
}
inline void store(float* p, __m512 v, int64_t n) { _mm512_mask_storeu_ps(p, first(n), v); }
inline void store(c10::Half* p, __m512 v, int64_t n) {
  _mm256_mask_storeu_epi16(p, first(n), _mm512_cvtps_ph(v, _MM_FROUND_TO_NEAREST_INT | _MM_FROUND_NO_EXC));
}
// v's float32 bits rounded to bf16 in the high half (the low half to be dropped): + 0x7FFF + the
// lowest kept bit, ties to even.
inline __m512i bf16_rounded_bits(__m512 v) {
  const __m512i bits = _mm512_castps_si512(v);
  const __m512i odd = _mm512_and_si512(_mm512_srli_epi32(bits, 16), _mm512_set1_epi32(1));
  return _mm512_add_epi32(bits, _mm512_add_epi32(odd, _mm512_set1_epi32(0x7FFF)));
}
// v's 16 lanes as bf16 with that rounding.
inline __m256i bf16_packed(__m512 v) { return _mm512_cvtepi32_epi16(_mm512_srli_epi32(bf16_rounded_bits(v), 16)); }
inline void store(c10::BFloat16* p, __m512 v, int64_t n) {
  const __m256i packed = bf16_packed(v);
  if (n >= 16) {
    _mm256_storeu_si256(reinterpret_cast<__m256i*>(p), packed);
  } else {
    _mm256_mask_storeu_epi16(p, first(n), packed);
  }
}

// v's 16 lanes as bf16 (to nearest even): vcvtneps2bf16 where the CPU has AVX-512 BF16, else
// bf16_packed (Ice Lake, Cascade Lake).
inline __m256i to_bf16(__m512 v) {
#if defined(__AVX512BF16__)
  return (__m256i)_mm512_cvtneps_pbh(v);
#else
  return bf16_packed(v);
#endif
}

// acc + a . b per 32-bit lane, a and b each holding a pair of bf16 values there: vdpbf16ps where
// the CPU has AVX-512 BF16, else the same two products (each exact in float32) added in the order
// Intel's manual gives for it, odd elements first, so that our attention kernels compute a row's
// bits the same way in prefill and decode on every AVX-512 CPU.
inline __m512 dot_bf16_pairs(__m512 acc, __m512i a, __m512i b) {
#if defined(__AVX512BF16__)
  return _mm512_dpbf16_ps(acc, (__m512bh)a, (__m512bh)b);
#else
  const __m512i high = _mm512_set1_epi32(static_cast<int>(0xFFFF0000u));
  acc = _mm512_fmadd_ps(_mm512_castsi512_ps(_mm512_and_si512(a, high)), _mm512_castsi512_ps(_mm512_and_si512(b, high)),
                        acc);
  return _mm512_fmadd_ps(_mm512_castsi512_ps(_mm512_slli_epi32(a, 16)), _mm512_castsi512_ps(_mm512_slli_epi32(b, 16)),
                         acc);
#endif
}

// v as store() then load() would give it back in T, without the round trip through memory (a
// load right after a narrowing store of the same bytes waits for that store to complete).
template <typename T>
inline __m512 as_stored(__m512 v) {
  if constexpr (std::is_same_v<T, float>) {
    return v;
  } else if constexpr (std::is_same_v<T, c10::Half>) {
    return _mm512_cvtph_ps(_mm512_cvtps_ph(v, _MM_FROUND_TO_NEAREST_INT | _MM_FROUND_NO_EXC));
  } else {  // store()'s rounding, the low half cleared
    const __m512i high_half = _mm512_set1_epi32(static_cast<int>(0xFFFF0000u));
    return _mm512_castsi512_ps(_mm512_and_si512(bf16_rounded_bits(v), high_half));
  }
}

// exp(x) for 16 floats, within ~2 ulp: x = n ln2 + r with |r| <= ln2 / 2 (ln2 in two parts, so
// that r is exact), exp(r) by Cephes' degree-6 polynomial, times 2^n (vscalefps: over- and
// underflow go to inf and 0 as they should).
inline __m512 exp(__m512 x) {
  x = _mm512_max_ps(_mm512_min_ps(x, _mm512_set1_ps(88.7f)), _mm512_set1_ps(-104.0f));
  const __m512 n = _mm512_roundscale_ps(_mm512_mul_ps(x, _mm512_set1_ps(1.44269504089f)),
                                        _MM_FROUND_TO_NEAREST_INT | _MM_FROUND_NO_EXC);
  __m512 r = _mm512_fnmadd_ps(n, _mm512_set1_ps(0.693359375f), x);
  r = _mm512_fnmadd_ps(n, _mm512_set1_ps(-2.12194440e-4f), r);
  __m512 p = _mm512_set1_ps(1.9875691500e-4f);
  p = _mm512_fmadd_ps(p, r, _mm512_set1_ps(1.3981999507e-3f));
  p = _mm512_fmadd_ps(p, r, _mm512_set1_ps(8.3334519073e-3f));
  p = _mm512_fmadd_ps(p, r, _mm512_set1_ps(4.1665795894e-2f));
  p = _mm512_fmadd_ps(p, r, _mm512_set1_ps(1.6666665459e-1f));
  p = _mm512_fmadd_ps(p, r, _mm512_set1_ps(5.0000001201e-1f));
  p = _mm512_fmadd_ps(_mm512_mul_ps(p, r), r, _mm512_add_ps(r, _mm512_set1_ps(1.0f)));
  return _mm512_scalef_ps(p, n);
}

inline Vec16 zero() { return _mm512_setzero_ps(); }
inline Vec16 set1(float v) { return _mm512_set1_ps(v); }
inline Vec16 add(Vec16 a, Vec16 b) { return _mm512_add_ps(a, b); }
inline Vec16 sub(Vec16 a, Vec16 b) { return _mm512_sub_ps(a, b); }
inline Vec16 mul(Vec16 a, Vec16 b) { return _mm512_mul_ps(a, b); }
inline Vec16 div(Vec16 a, Vec16 b) { return _mm512_div_ps(a, b); }
inline Vec16 fmadd(Vec16 a, Vec16 b, Vec16 c) { return _mm512_fmadd_ps(a, b, c); }
inline float reduce_add(Vec16 v) { return _mm512_reduce_add_ps(v); }

#else  // AVX2 + FMA + F16C
struct Vec16 {
  __m256 lo, hi;
};

// The first n <= 16 elements at p as float32 (zero past n); tails go through a buffer.
template <typename T>
inline Vec16 load(const T* p, int64_t n) {
  alignas(32) float buf[16];
  if constexpr (std::is_same_v<T, float>) {
    if (n >= 16) return {_mm256_loadu_ps(p), _mm256_loadu_ps(p + 8)};
  } else if constexpr (std::is_same_v<T, c10::Half>) {
    if (n >= 16) {
      return {_mm256_cvtph_ps(_mm_loadu_si128(reinterpret_cast<const __m128i*>(p))),
              _mm256_cvtph_ps(_mm_loadu_si128(reinterpret_cast<const __m128i*>(p + 8)))};
    }
  } else {  // bfloat16: the high half of a float32
    if (n >= 16) {
      auto widen = [](const c10::BFloat16* q) {
        return _mm256_castsi256_ps(_mm256_slli_epi32(
            _mm256_cvtepu16_epi32(_mm_loadu_si128(reinterpret_cast<const __m128i*>(q))), 16));
      };
      return {widen(p), widen(p + 8)};
    }
  }
  for (int64_t i = 0; i < 16; ++i) buf[i] = i < n ? static_cast<float>(p[i]) : 0.0f;
  return {_mm256_load_ps(buf), _mm256_load_ps(buf + 8)};
}

// The first n <= 16 lanes to p, rounded to T (to nearest even).
template <typename T>
inline void store(T* p, Vec16 v, int64_t n) {
  if constexpr (std::is_same_v<T, float>) {
    if (n >= 16) {
      _mm256_storeu_ps(p, v.lo);
      _mm256_storeu_ps(p + 8, v.hi);
      return;
    }
  } else if constexpr (std::is_same_v<T, c10::Half>) {
    if (n >= 16) {
      _mm_storeu_si128(reinterpret_cast<__m128i*>(p), _mm256_cvtps_ph(v.lo, _MM_FROUND_TO_NEAREST_INT));
      _mm_storeu_si128(reinterpret_cast<__m128i*>(p + 8), _mm256_cvtps_ph(v.hi, _MM_FROUND_TO_NEAREST_INT));
      return;
    }
  }
  alignas(32) float buf[16];
  _mm256_store_ps(buf, v.lo);
  _mm256_store_ps(buf + 8, v.hi);
  for (int64_t i = 0; i < std::min<int64_t>(n, 16); ++i) p[i] = static_cast<T>(buf[i]);
}

// v as store() then load() would give it back in T, without the round trip through memory.
inline __m256 as_stored_bf16(__m256 v) {  // c10::BFloat16's rounding (to nearest even; NaN -> 0x7FC0)
  const __m256i bits = _mm256_castps_si256(v);
  const __m256i odd = _mm256_and_si256(_mm256_srli_epi32(bits, 16), _mm256_set1_epi32(1));
  const __m256i rounded = _mm256_and_si256(_mm256_add_epi32(bits, _mm256_add_epi32(odd, _mm256_set1_epi32(0x7FFF))),
                                           _mm256_set1_epi32(static_cast<int>(0xFFFF0000u)));
  return _mm256_blendv_ps(_mm256_castsi256_ps(rounded), _mm256_castsi256_ps(_mm256_set1_epi32(0x7FC00000)),
                          _mm256_cmp_ps(v, v, _CMP_UNORD_Q));
}

template <typename T>
inline Vec16 as_stored(Vec16 v) {
  if constexpr (std::is_same_v<T, float>) {
    return v;
  } else if constexpr (std::is_same_v<T, c10::Half>) {
    return {_mm256_cvtph_ps(_mm256_cvtps_ph(v.lo, _MM_FROUND_TO_NEAREST_INT)),
            _mm256_cvtph_ps(_mm256_cvtps_ph(v.hi, _MM_FROUND_TO_NEAREST_INT))};
  } else {
    return {as_stored_bf16(v.lo), as_stored_bf16(v.hi)};
  }
}

// exp(x) for 8 floats, as the AVX-512 one but for the scaling by 2^n, built in the exponent bits
// (x clamped so that n stays in the normal range).
inline __m256 exp8(__m256 x) {
  x = _mm256_max_ps(_mm256_min_ps(x, _mm256_set1_ps(88.3f)), _mm256_set1_ps(-87.3f));
  const __m256 n = _mm256_round_ps(_mm256_mul_ps(x, _mm256_set1_ps(1.44269504089f)),
                                   _MM_FROUND_TO_NEAREST_INT | _MM_FROUND_NO_EXC);
  __m256 r = _mm256_fnmadd_ps(n, _mm256_set1_ps(0.693359375f), x);
  r = _mm256_fnmadd_ps(n, _mm256_set1_ps(-2.12194440e-4f), r);
  __m256 p = _mm256_set1_ps(1.9875691500e-4f);
  p = _mm256_fmadd_ps(p, r, _mm256_set1_ps(1.3981999507e-3f));
  p = _mm256_fmadd_ps(p, r, _mm256_set1_ps(8.3334519073e-3f));
  p = _mm256_fmadd_ps(p, r, _mm256_set1_ps(4.1665795894e-2f));
  p = _mm256_fmadd_ps(p, r, _mm256_set1_ps(1.6666665459e-1f));
  p = _mm256_fmadd_ps(p, r, _mm256_set1_ps(5.0000001201e-1f));
  p = _mm256_fmadd_ps(_mm256_mul_ps(p, r), r, _mm256_add_ps(r, _mm256_set1_ps(1.0f)));
  const __m256i two_n = _mm256_slli_epi32(_mm256_add_epi32(_mm256_cvtps_epi32(n), _mm256_set1_epi32(127)), 23);
  return _mm256_mul_ps(p, _mm256_castsi256_ps(two_n));
}

inline Vec16 exp(Vec16 x) { return {exp8(x.lo), exp8(x.hi)}; }
inline Vec16 zero() { return {_mm256_setzero_ps(), _mm256_setzero_ps()}; }
inline Vec16 set1(float v) { return {_mm256_set1_ps(v), _mm256_set1_ps(v)}; }
inline Vec16 add(Vec16 a, Vec16 b) { return {_mm256_add_ps(a.lo, b.lo), _mm256_add_ps(a.hi, b.hi)}; }
inline Vec16 sub(Vec16 a, Vec16 b) { return {_mm256_sub_ps(a.lo, b.lo), _mm256_sub_ps(a.hi, b.hi)}; }
inline Vec16 mul(Vec16 a, Vec16 b) { return {_mm256_mul_ps(a.lo, b.lo), _mm256_mul_ps(a.hi, b.hi)}; }
inline Vec16 div(Vec16 a, Vec16 b) { return {_mm256_div_ps(a.lo, b.lo), _mm256_div_ps(a.hi, b.hi)}; }
inline Vec16 fmadd(Vec16 a, Vec16 b, Vec16 c) { return {_mm256_fmadd_ps(a.lo, b.lo, c.lo), _mm256_fmadd_ps(a.hi, b.hi, c.hi)}; }
inline float reduce_add(Vec16 v) {
  const __m256 sum = _mm256_add_ps(v.lo, v.hi);
  const __m128 pair = _mm_add_ps(_mm256_castps256_ps128(sum), _mm256_extractf128_ps(sum, 1));
  const __m128 two = _mm_add_ps(pair, _mm_movehl_ps(pair, pair));
  return _mm_cvtss_f32(_mm_add_ss(two, _mm_shuffle_ps(two, two, 1)));
}
#endif

}  // namespace tokenmill_vec
