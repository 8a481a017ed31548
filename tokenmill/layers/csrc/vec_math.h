// Vector math for our AVX-512 kernels.
#pragma once
#include <c10/util/BFloat16.h>
#include <c10/util/Half.h>
#include <immintrin.h>

#include <cstdint>

namespace tokenmill_vec {

// The first n <= 16 elements at p as float32 (zero past n), and back with round-to-nearest-even.
inline __mmask16 first(int64_t n) { return static_cast<__mmask16>(n >= 16 ? 0xFFFF : (1u << n) - 1); }
inline __m512 load(const float* p, int64_t n) { return _mm512_maskz_loadu_ps(first(n), p); }
inline __m512 load(const c10::Half* p, int64_t n) { return _mm512_cvtph_ps(_mm256_maskz_loadu_epi16(first(n), p)); }
inline __m512 load(const c10::BFloat16* p, int64_t n) {
  return _mm512_castsi512_ps(_mm512_slli_epi32(_mm512_cvtepu16_epi32(_mm256_maskz_loadu_epi16(first(n), p)), 16));
}
inline void store(float* p, __m512 v, int64_t n) { _mm512_mask_storeu_ps(p, first(n), v); }
inline void store(c10::Half* p, __m512 v, int64_t n) {
  _mm256_mask_storeu_epi16(p, first(n), _mm512_cvtps_ph(v, _MM_FROUND_TO_NEAREST_INT | _MM_FROUND_NO_EXC));
}
inline void store(c10::BFloat16* p, __m512 v, int64_t n) {
  const __m512i bits = _mm512_castps_si512(v);  // + 0x7FFF + the lowest kept bit: ties to even
  const __m512i odd = _mm512_and_si512(_mm512_srli_epi32(bits, 16), _mm512_set1_epi32(1));
  const __m512i rounded = _mm512_srli_epi32(_mm512_add_epi32(bits, _mm512_add_epi32(odd, _mm512_set1_epi32(0x7FFF))), 16);
  _mm256_mask_storeu_epi16(p, first(n), _mm512_cvtepi32_epi16(rounded));
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

}  // namespace tokenmill_vec
