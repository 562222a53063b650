// Attention of a few new tokens per sequence (decoding, verification, batched decoding) against the KV cache, for
// float32 rows on the CPU. SDPA, which the model otherwise calls, wants the batch padded to [B, Q, K] with a float
// mask, gathers the KV rows of non-consecutive slots into a copy every layer, and its flash kernel parallelises
// over (sequence, head, query block): at batch 32 it took a quarter of a plain decode step on a 2-core EPYC
// (docs/benchmarks.md, "Attention from C++"). Here every (token, KV head) is one task: its slot's keys are read in
// place for the KV head's Hq / Hkv query heads in turn (grouped-query attention without expanding K and V; the
// second and later heads find them in cache), over the keys the mask lets it see and no others. Tasks run KV head
// first, so a thread's run of tasks takes one KV head's tokens in a row: a verify's later tokens find that head's
// keys and values in cache, where a forward's weight reads had evicted them (2-3 row verifies 0.8-1 ms faster a
// forward on a 2-core Zen 4; docs/benchmarks.md, "Q8_0 records for the LM head"). Long prefills run here too: the
// same work as SDPA's, unblocked.
//
// Batch-invariant by construction: a token's output is computed by the same instruction sequence whatever else is
// in the batch (8-lane dot products over the head dim, a fixed lane reduction, the softmax's sums in key order), so
// a token verified among others equals the same token decoded alone, bit for bit. One path (AVX2 + FMA, which every
// AVX-512 CPU also runs), so the same bits on every x86 CPU with the same libm.
#include "attention.h"

#include <ATen/Parallel.h>

#if defined(__x86_64__) || defined(__i386__)
#define SPECSERVE_ATTENTION_X86 1
#include <immintrin.h>

#include "simd.h"
#else
#define SPECSERVE_ATTENTION_X86 0  // other CPUs keep SDPA (supported() is false)
#endif

#include <algorithm>
#include <cmath>
#include <limits>
#include <vector>

namespace specserve_attention {

namespace {

#if SPECSERVE_ATTENTION_X86
// exp(x) for 8 lanes: Cephes' expf (x = n ln2 + r, |r| <= ln2 / 2, a degree-6 polynomial in r, times 2^n), within
// ~2 ulp of the true value over the softmax's range (x <= 0); -inf (a padding lane) gives 0 and NaN stays NaN (a
// NaN score, or an infinite one less the infinite maximum, makes the output NaN, as SDPA's: min/max return their
// second operand when either is NaN, so x goes second in the clamp).
__attribute__((target("avx2,fma"))) inline __m256 exp8(__m256 x) {
  const __m256 pad = _mm256_cmp_ps(x, _mm256_set1_ps(-std::numeric_limits<float>::infinity()), _CMP_EQ_OQ);
  x = _mm256_max_ps(_mm256_set1_ps(-87.3365478515625f), _mm256_min_ps(_mm256_set1_ps(88.3762626647949f), x));
  const __m256 n = _mm256_round_ps(_mm256_mul_ps(x, _mm256_set1_ps(1.44269504088896341f)),
                                   _MM_FROUND_TO_NEAREST_INT | _MM_FROUND_NO_EXC);
  __m256 r = _mm256_fnmadd_ps(n, _mm256_set1_ps(0.693359375f), x);
  r = _mm256_fnmadd_ps(n, _mm256_set1_ps(-2.12194440e-4f), r);
  __m256 p = _mm256_set1_ps(1.9875691500e-4f);
  p = _mm256_fmadd_ps(p, r, _mm256_set1_ps(1.3981999507e-3f));
  p = _mm256_fmadd_ps(p, r, _mm256_set1_ps(8.3334519073e-3f));
  p = _mm256_fmadd_ps(p, r, _mm256_set1_ps(4.1665795894e-2f));
  p = _mm256_fmadd_ps(p, r, _mm256_set1_ps(1.6666665459e-1f));
  p = _mm256_fmadd_ps(p, r, _mm256_set1_ps(5.0000001201e-1f));
  p = _mm256_fmadd_ps(p, _mm256_mul_ps(r, r), _mm256_add_ps(r, _mm256_set1_ps(1.0f)));
  const __m256i scale = _mm256_slli_epi32(_mm256_add_epi32(_mm256_cvtps_epi32(n), _mm256_set1_epi32(127)), 23);
  return _mm256_blendv_ps(_mm256_mul_ps(p, _mm256_castsi256_ps(scale)), _mm256_setzero_ps(), pad);
}

// Scores of GS query heads (q: head g's row at q + g * D) against four keys k0..k3 [D]: GS x 4 independent sums (12
// chains for GS = 3, enough to keep both FMA pipes busy; each key chunk is loaded once for all GS heads), each
// reduced as (0+1)+(2+3) and (4+5)+(6+7), then the halves added, and scaled into s + g * stride.
template <int CH, int GS>
__attribute__((target("avx2,fma"))) inline void scores4(const float* q, const float* k0, const float* k1,
                                                        const float* k2, const float* k3, float scale, float* s,
                                                        int64_t stride) {
  constexpr int64_t D = CH * 8;
  __m256 a[GS][4];
  for (int g = 0; g < GS; ++g)
    for (int j = 0; j < 4; ++j) a[g][j] = _mm256_setzero_ps();
  for (int c = 0; c < CH; ++c) {
    __m256 qv[GS];
    for (int g = 0; g < GS; ++g) qv[g] = _mm256_loadu_ps(q + g * D + 8 * c);
    const float* keys[4] = {k0, k1, k2, k3};
    for (int j = 0; j < 4; ++j) {
      const __m256 kv = _mm256_loadu_ps(keys[j] + 8 * c);
      for (int g = 0; g < GS; ++g) a[g][j] = _mm256_fmadd_ps(qv[g], kv, a[g][j]);
    }
  }
  const __m128 scale4 = _mm_set1_ps(scale);
  for (int g = 0; g < GS; ++g) {
    const __m256 h = _mm256_hadd_ps(_mm256_hadd_ps(a[g][0], a[g][1]), _mm256_hadd_ps(a[g][2], a[g][3]));
    const __m128 sums = _mm_add_ps(_mm256_castps256_ps128(h), _mm256_extractf128_ps(h, 1));
    _mm_storeu_ps(s + g * stride, _mm_mul_ps(sums, scale4));
  }
}

// Lanes 8 * c0 .. 8 * (c0 + 4) of out[g] = inv[g] * (sum over the n keys of p[g][i] * v[key i]) for GS heads (CH a
// multiple of 4): each value chunk loaded once for all GS heads, 4 x GS chains in key order.
template <int CH, int GS>
__attribute__((target("avx2,fma"))) inline void weighted_values4(const float* p, int64_t stride, const float* v,
                                                                 const int32_t* keys, int64_t n, int c0,
                                                                 const float* inv, float* out) {
  constexpr int64_t D = CH * 8;
  __m256 acc[GS][4];
  for (int g = 0; g < GS; ++g)
    for (int c = 0; c < 4; ++c) acc[g][c] = _mm256_setzero_ps();
  for (int64_t i = 0; i < n; ++i) {
    const float* vr = v + static_cast<int64_t>(keys[i]) * D + 8 * c0;
    __m256 pv[GS];
    for (int g = 0; g < GS; ++g) pv[g] = _mm256_broadcast_ss(p + g * stride + i);
    for (int c = 0; c < 4; ++c) {
      const __m256 vv = _mm256_loadu_ps(vr + 8 * c);
      for (int g = 0; g < GS; ++g) acc[g][c] = _mm256_fmadd_ps(pv[g], vv, acc[g][c]);
    }
  }
  for (int g = 0; g < GS; ++g) {
    const __m256 scale = _mm256_set1_ps(inv[g]);
    for (int c = 0; c < 4; ++c) _mm256_storeu_ps(out + g * D + 8 * (c0 + c), _mm256_mul_ps(acc[g][c], scale));
  }
}

// GS query heads q [GS, D] of one token over the n keys listed in `keys` (padded to a multiple of 8 with repeats of a
// listed key); scores [GS, padded] scratch; out [GS, D].
template <int CH, int GS>
__attribute__((target("avx2,fma"))) void attend_heads(const float* q, const float* k, const float* v,
                                                      const int32_t* keys, int64_t n, float scale, float* scores,
                                                      float* out) {
  constexpr int64_t D = CH * 8;
  const int64_t padded = (n + 7) / 8 * 8;
  for (int64_t i = 0; i < padded; i += 4) {
    scores4<CH, GS>(q, k + static_cast<int64_t>(keys[i]) * D, k + static_cast<int64_t>(keys[i + 1]) * D,
                    k + static_cast<int64_t>(keys[i + 2]) * D, k + static_cast<int64_t>(keys[i + 3]) * D, scale,
                    scores + i, padded);
  }
  float inv[GS];
  for (int g = 0; g < GS; ++g) {
    float* s = scores + g * padded;
    for (int64_t i = n; i < padded; ++i) s[i] = -std::numeric_limits<float>::infinity();
    __m256 top8 = _mm256_set1_ps(-std::numeric_limits<float>::infinity());
    for (int64_t i = 0; i < padded; i += 8) top8 = _mm256_max_ps(top8, _mm256_loadu_ps(s + i));
    alignas(32) float lanes[8];
    _mm256_store_ps(lanes, top8);
    float top = lanes[0];
    for (int l = 1; l < 8; ++l) top = std::max(top, lanes[l]);
    const __m256 shift = _mm256_set1_ps(top);
    __m256 sum8 = _mm256_setzero_ps();
    for (int64_t i = 0; i < padded; i += 8) {
      const __m256 e = exp8(_mm256_sub_ps(_mm256_loadu_ps(s + i), shift));
      _mm256_storeu_ps(s + i, e);
      sum8 = _mm256_add_ps(sum8, e);
    }
    inv[g] = 1.0f / specserve_simd::hsum256(sum8);
  }
  for (int c0 = 0; c0 < CH; c0 += 4) weighted_values4<CH, GS>(scores, padded, v, keys, n, c0, inv, out);
}

// One token and one KV head: its G query heads q [G, D] in groups of up to 3 (12 accumulators of 16 registers).
// Each score and each output lane is the same chain of operations whatever heads share its group, so a token's
// output does not depend on the grouping, nor on the other tokens of the batch.
template <int CH>
__attribute__((target("avx2,fma"))) void attend_group(const float* q, const float* k, const float* v,
                                                      const int32_t* keys, int64_t n, int64_t G, float scale,
                                                      float* scores, float* out) {
  constexpr int64_t D = CH * 8;
  const int64_t padded = (n + 7) / 8 * 8;
  for (int64_t g = 0; g < G;) {
    const int64_t gs = std::min<int64_t>(3, G - g);
    float* s = scores + g * padded;
    if (gs == 3) attend_heads<CH, 3>(q + g * D, k, v, keys, n, scale, s, out + g * D);
    else if (gs == 2) attend_heads<CH, 2>(q + g * D, k, v, keys, n, scale, s, out + g * D);
    else attend_heads<CH, 1>(q + g * D, k, v, keys, n, scale, s, out + g * D);
    g += gs;
  }
}
#endif

using GroupFn = void (*)(const float*, const float*, const float*, const int32_t*, int64_t, int64_t, float, float*,
                         float*);

GroupFn group_fn(int64_t head_dim) {
#if SPECSERVE_ATTENTION_X86
  if (head_dim == 64) return &attend_group<8>;
  if (head_dim == 128) return &attend_group<16>;
#endif
  (void)head_dim;
  return nullptr;
}

bool cpu_runs_avx2() {
#if SPECSERVE_ATTENTION_X86
  __builtin_cpu_init();
  return __builtin_cpu_supports("avx2") && __builtin_cpu_supports("fma");
#else
  return false;
#endif
}

}  // namespace

bool supported(int64_t head_dim) {
  static const bool cpu = cpu_runs_avx2();
  return cpu && group_fn(head_dim) != nullptr;
}

at::Tensor attend(const at::Tensor& q_in, const at::Tensor& k_cache, const at::Tensor& v_cache,
                  const at::Tensor& write_slot, const at::Tensor& write_pos, const at::Tensor& write_from,
                  const std::optional<at::Tensor>& mask_in, int64_t q_len) {
  TORCH_CHECK(q_in.dim() == 3 && k_cache.dim() == 4 && v_cache.sizes() == k_cache.sizes(),
              "attend: want q [N, Hq, D] and caches [S, Hkv, L, D]");
  const int64_t n_tok = q_in.size(0), hq = q_in.size(1), d = q_in.size(2);
  const int64_t slots = k_cache.size(0), hkv = k_cache.size(1), len = k_cache.size(2);
  TORCH_CHECK(k_cache.size(3) == d, "attend: q's head dim ", d, " is not the caches' ", k_cache.size(3));
  TORCH_CHECK(supported(d), "attend: head dim ", d, " is not served here");
  TORCH_CHECK(hkv > 0 && hq % hkv == 0, "attend: ", hq, " query heads over ", hkv, " KV heads");
  for (const at::Tensor* t : {&q_in, &k_cache, &v_cache}) {
    TORCH_CHECK(t->scalar_type() == at::kFloat && t->device().is_cpu(), "attend: float32 CPU tensors");
  }
  TORCH_CHECK(k_cache.is_contiguous() && v_cache.is_contiguous(), "attend: contiguous caches");
  for (const at::Tensor* t : {&write_slot, &write_pos, &write_from}) {
    TORCH_CHECK(t->scalar_type() == at::kLong && t->dim() == 1 && t->size(0) == n_tok && t->is_contiguous() &&
                    t->device().is_cpu(),
                "attend: one long CPU index per token");
  }
  TORCH_CHECK(q_len >= 1, "attend: q_len >= 1");
  const at::Tensor q = q_in.contiguous();
  std::optional<at::Tensor> mask;
  int64_t keys_seen = 0;  // the mask's key count K
  if (mask_in.has_value() && mask_in->defined()) {
    TORCH_CHECK(mask_in->scalar_type() == at::kBool && mask_in->device().is_cpu() && mask_in->dim() == 4 &&
                    mask_in->size(1) == 1 && mask_in->size(2) == q_len && mask_in->size(3) <= len,
                "attend: want a bool CPU mask [B, 1, q_len, K <= L]");
    mask = mask_in->contiguous();
    keys_seen = mask->size(3);
  }
  const int64_t* slot = write_slot.data_ptr<int64_t>();
  const int64_t* pos = write_pos.data_ptr<int64_t>();
  const int64_t* from = write_from.data_ptr<int64_t>();
  const int64_t rows = mask.has_value() ? mask->size(0) * q_len : 0;
  for (int64_t n = 0; n < n_tok; ++n) {
    TORCH_CHECK(0 <= slot[n] && slot[n] < slots && 0 <= pos[n] && pos[n] < len, "attend: token ", n,
                " outside the cache");
    TORCH_CHECK(!mask.has_value() || (0 <= from[n] && from[n] < rows), "attend: token ", n, " outside the mask");
  }
  at::Tensor out = at::empty({n_tok, hq, d}, q.options());
  const float* qp = q.data_ptr<float>();
  const float* kp = k_cache.data_ptr<float>();
  const float* vp = v_cache.data_ptr<float>();
  const bool* mp = mask.has_value() ? mask->data_ptr<bool>() : nullptr;
  float* op = out.data_ptr<float>();
  const int64_t group = hq / hkv;
  const float scale = 1.0f / std::sqrt(static_cast<float>(d));
  const GroupFn fn = group_fn(d);
  at::parallel_for(0, n_tok * hkv, 1, [&](int64_t t0, int64_t t1) {
    std::vector<int32_t> keys;
    std::vector<float> scores;
    for (int64_t t = t0; t < t1; ++t) {
      const int64_t h = t / n_tok, n = t % n_tok;  // head-major: a thread takes consecutive tokens of one KV head
      keys.clear();
      if (mask.has_value()) {  // (not mp: an empty mask's data pointer is null too)
        const bool* row = mp + from[n] * keys_seen;
        for (int64_t l = 0; l < keys_seen; ++l) {
          if (row[l]) keys.push_back(static_cast<int32_t>(l));
        }
      } else {
        for (int64_t l = 0; l <= pos[n]; ++l) keys.push_back(static_cast<int32_t>(l));
      }
      TORCH_CHECK(!keys.empty(), "attend: token ", n, " may attend to nothing");
      const auto seen = static_cast<int64_t>(keys.size());
      keys.resize((keys.size() + 7) / 8 * 8, keys.back());  // whole groups of 8 (the repeats' scores are dropped)
      scores.resize(static_cast<size_t>(group) * keys.size());
      const int64_t base = (slot[n] * hkv + h) * len * d;
      fn(qp + (n * hq + h * group) * d, kp + base, vp + base, keys.data(), seen, group, scale, scores.data(),
         op + (n * hq + h * group) * d);
    }
  });
  return out;
}

}  // namespace specserve_attention
