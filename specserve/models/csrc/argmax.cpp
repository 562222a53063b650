// Greedy tokens from float32 logits. ATen's max / argmax over the last dimension track an index per element in a
// scalar loop: ~40 us a row of SmolLM2's 49,152 logits on a 2-core Zen 4, where its vectorised amax takes ~3 us.
// Here a row is two vectorised passes: its maximum (and whether it holds a NaN), then the first element equal to
// that maximum. The result is an index, so it is the same on every path (AVX2's or the scalar one).
#include "argmax.h"

#include <ATen/Parallel.h>

#if defined(__x86_64__) || defined(__i386__)
#define SPECSERVE_ARGMAX_X86 1
#include <immintrin.h>
#else
#define SPECSERVE_ARGMAX_X86 0
#endif

#include <cmath>
#include <cstdint>
#include <limits>

namespace specserve_argmax {

namespace {

// The row's first maximum, or n where that maximum is not finite.
int64_t row_scalar(const float* x, int64_t n) {
  float top = -std::numeric_limits<float>::infinity();
  for (int64_t i = 0; i < n; ++i) {
    if (std::isnan(x[i])) return n;
    top = x[i] > top ? x[i] : top;
  }
  if (!std::isfinite(top)) return n;
  for (int64_t i = 0; i < n; ++i) {
    if (x[i] == top) return i;
  }
  return n;  // unreachable: top is one of the row's values
}

#if SPECSERVE_ARGMAX_X86
__attribute__((target("avx2"))) int64_t row_avx2(const float* x, int64_t n) {
  const int64_t n8 = n - n % 8;
  __m256 top8 = _mm256_set1_ps(-std::numeric_limits<float>::infinity());
  __m256 nan8 = _mm256_setzero_ps();
  for (int64_t i = 0; i < n8; i += 8) {
    const __m256 v = _mm256_loadu_ps(x + i);
    nan8 = _mm256_or_ps(nan8, _mm256_cmp_ps(v, v, _CMP_UNORD_Q));
    top8 = _mm256_max_ps(top8, v);
  }
  if (_mm256_movemask_ps(nan8)) return n;
  alignas(32) float lanes[8];
  _mm256_store_ps(lanes, top8);
  float top = lanes[0];
  for (int j = 1; j < 8; ++j) top = lanes[j] > top ? lanes[j] : top;
  for (int64_t i = n8; i < n; ++i) {
    if (std::isnan(x[i])) return n;
    top = x[i] > top ? x[i] : top;
  }
  if (!std::isfinite(top)) return n;
  const __m256 want = _mm256_set1_ps(top);
  for (int64_t i = 0; i < n8; i += 8) {
    const int hit = _mm256_movemask_ps(_mm256_cmp_ps(_mm256_loadu_ps(x + i), want, _CMP_EQ_OQ));
    if (hit) return i + __builtin_ctz(static_cast<unsigned>(hit));
  }
  for (int64_t i = n8; i < n; ++i) {
    if (x[i] == top) return i;
  }
  return n;  // unreachable
}

bool has_avx2() { return __builtin_cpu_supports("avx2"); }
#endif

}  // namespace

at::Tensor first_max_ids(const at::Tensor& logits, bool portable) {
  TORCH_CHECK(logits.device().is_cpu() && logits.dim() == 2 && logits.scalar_type() == at::kFloat,
              "first_max_ids: logits must be an [R, V] float32 CPU tensor");
  const at::Tensor x = logits.contiguous();
  const int64_t rows = x.size(0), n = x.size(1);
  TORCH_CHECK(n > 0, "first_max_ids: an empty vocabulary");
  at::Tensor out = at::empty({rows}, x.options().dtype(at::kLong));
  const float* xp = x.data_ptr<float>();
  int64_t* op = out.data_ptr<int64_t>();
#if SPECSERVE_ARGMAX_X86
  const bool avx2 = !portable && has_avx2();
#else
  const bool avx2 = false;
  (void)portable;
#endif
  // a row is ~10 us: rows in pairs or more per task
  at::parallel_for(0, rows, 2, [&](int64_t r0, int64_t r1) {
    for (int64_t r = r0; r < r1; ++r) {
#if SPECSERVE_ARGMAX_X86
      op[r] = avx2 ? row_avx2(xp + r * n, n) : row_scalar(xp + r * n, n);
#else
      op[r] = row_scalar(xp + r * n, n);
#endif
    }
  });
  return out;
}

}  // namespace specserve_argmax
