// Small x86 helpers shared by the CPU kernels (small_gemm.cpp, attention.cpp). Include inside a
// `#if defined(__x86_64__) || defined(__i386__)` block, after <immintrin.h>.
#pragma once

#include <immintrin.h>

namespace specserve_simd {

// The sum of 8 float lanes in one fixed order: (0+4, 1+5, 2+6, 3+7), then pairs, then the last two.
__attribute__((target("avx2,fma"))) inline float hsum256(__m256 v) {
  const __m128 lo = _mm256_castps256_ps128(v), hi = _mm256_extractf128_ps(v, 1);
  __m128 s = _mm_add_ps(lo, hi);
  s = _mm_add_ps(s, _mm_movehl_ps(s, s));
  s = _mm_add_ss(s, _mm_shuffle_ps(s, s, 0x55));
  return _mm_cvtss_f32(s);
}

}  // namespace specserve_simd
