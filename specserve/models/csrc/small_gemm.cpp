// Float32 products of a few rows with a row-major or packed weight, y[M, N] = x[M, K] @ w[N, K]^T (+ b), for the
// 1-64 rows of decoding, verification and batched decoding. On a 2-core CPU BLAS handles these shapes far from the
// memory bound (an AMD EPYC: a 1-row product of SmolLM2's layers at 18 GB/s against 50 GB/s of read bandwidth, 2
// rows costing 1.45x one): here each weight row is read once for all M rows, as the memory bound wants.
//
// Batch-invariant by construction: every y[m, n] is computed by the same instruction sequence whatever M is and
// wherever n falls in a block (16-lane partial sums over k ascending, a masked last chunk, a fixed lane reduction,
// then the bias), so a token's products verified among other rows equal the same token's decoded alone, bit for bit
// (for a caller whose steps all stay within kMaxRows rows).
//
// The instruction set is detected at run time (AVX-512F, else AVX2 + FMA; SPECSERVE_SMALL_GEMM_ISA=avx2 picks the
// second on a CPU with both); without either the caller falls back to at::linear (small_gemm_supported() says which).
// A weight may be packed once (pack(): each block of 4 rows one sequential stream); the products are the same bits.
// A weight whose values bfloat16 holds exactly (a draft head shipped in bf16) may be read as bfloat16 (linear_bf16):
// each element widened to the same float32 in a register, so the same products, bit for bit, from half the bytes.
#include "small_gemm.h"

#include <torch/extension.h>

#include <ATen/Parallel.h>

#if defined(__x86_64__) || defined(__i386__)
#define SPECSERVE_X86 1
#include <immintrin.h>

#include "simd.h"
#else
#define SPECSERVE_X86 0  // other CPUs keep BLAS (supported() is false)
#endif

#include <algorithm>
#include <cmath>
#include <limits>
#include <tuple>
#include <atomic>
#include <bitset>
#include <cstdlib>
#include <cstdint>
#include <cstring>
#include <type_traits>
#include <string>
#include <vector>

namespace specserve_small_gemm {

constexpr int64_t kMaxRows = 64;
// Prefetch (Prefetch in small_gemm.h), while a block of weight rows is multiplied: l1 the same offsets in the next
// block's rows (NB * K floats on; NB * kp packed) into L1, l2 those two blocks on into L2. With the FMAs of several
// activation rows per load the hardware prefetcher alone leaves the loads waiting: a 2-core EPYC over SmolLM2's
// layers, l1: 8 rows 25 -> 13 ms, 16 rows 37 -> 22 ms (a prefetch 1 KB ahead inside the block reached only 22 and
// 31), one row streams faster without; a 2-core AMX Xeon, l2 against l1: 8 rows 31 -> 23 ms packed, 26 -> 24
// row-major. Which one a model's products take is measured at load (native_stack.kernel_plan_for); without a
// choice: none for one row, l1 for more (by_default).
// Past 16 rows the product is compute-bound and still beats MKL here (32 rows 40 against 52 ms, 64 rows 74
// against 83).

enum class Isa { none, avx2, avx512 };

Isa detect() {
#if SPECSERVE_X86
  __builtin_cpu_init();
  // the AVX-512 path also runs AVX2 + FMA code (the records' dequantisation): a CPU model with AVX-512F alone,
  // which a VM may expose, takes neither
  if (__builtin_cpu_supports("avx512f") && __builtin_cpu_supports("avx2") && __builtin_cpu_supports("fma")) {
    return Isa::avx512;
  }
  if (__builtin_cpu_supports("avx2") && __builtin_cpu_supports("fma")) return Isa::avx2;
#endif
  return Isa::none;
}

// The detected path, or the one SPECSERVE_SMALL_GEMM_ISA names ("avx2" on an AVX-512 CPU: benchmarks of the other
// path); a name this CPU lacks, or any other, is an error the first time the kernel is asked for (loading a model
// with the kernel on then fails with it, rather than silently running another path).
Isa chosen() {
  const Isa best = detect();
  const char* name = std::getenv("SPECSERVE_SMALL_GEMM_ISA");
  if (name == nullptr || *name == '\0') return best;
  const std::string want(name);
  TORCH_CHECK(want == "avx512" || want == "avx2", "SPECSERVE_SMALL_GEMM_ISA: avx512 or avx2, not ", want);
  const Isa asked = want == "avx512" ? Isa::avx512 : Isa::avx2;
  TORCH_CHECK(asked <= best, "SPECSERVE_SMALL_GEMM_ISA=", want, ": this CPU does not run it");
  return asked;
}

Isa isa() {
  static const Isa found = chosen();
  return found;
}

// A block's weights start at w (weight row n0); element (i, k) of the block lies at
// w + i * row + (k / 16) * chunk + k % 16, and the same element of the next block NB * kp floats on, kp = K rounded up
// to 16. Row-major [N, K]: row = K, chunk = 16 (and kp = K). PACKED (pack() below): row = 16, chunk = 16 * NB.
// (Everything but w is known at compile time or from K: the strides passed at run time in a struct measured 1.5-2x
// slower for one row on a 2-core EPYC, with the same inner loop.)
constexpr int64_t padded_k(int64_t K) { return (K + 15) / 16 * 16; }  // kp: the packed layout's row length

template <int NB, bool PACKED>
struct Layout {
  static constexpr int64_t row(int64_t K) { return PACKED ? 16 : K; }
  static constexpr int64_t chunk = PACKED ? 16 * NB : 16;
  static constexpr int64_t next(int64_t K) { return PACKED ? NB * padded_k(K) : NB * K; }
};

template <typename W>
using BlockFn = void (*)(const float*, const W*, float*, int64_t, int64_t, int64_t, int64_t, int64_t);
using bf16_t = uint16_t;  // a bfloat16 weight element: the high half of its float32

#if SPECSERVE_X86
// ---- Weight loads: 16 (8) float32 lanes from float32 or bfloat16 elements; `n` < 16 (8) lanes with zeros after.
__attribute__((target("avx512f"))) inline __m512 load16(const float* p) { return _mm512_loadu_ps(p); }
__attribute__((target("avx512f"))) inline __m512 load16(const bf16_t* p) {
  const __m256i h = _mm256_loadu_si256(reinterpret_cast<const __m256i*>(p));
  return _mm512_castsi512_ps(_mm512_slli_epi32(_mm512_cvtepu16_epi32(h), 16));
}
__attribute__((target("avx512f"))) inline __m512 load16_tail(const float* p, int64_t n) {
  return _mm512_maskz_loadu_ps(static_cast<__mmask16>((1u << n) - 1u), p);
}
__attribute__((target("avx512f"))) inline __m512 load16_tail(const bf16_t* p, int64_t n) {
  alignas(32) bf16_t tail[16] = {};
  std::memcpy(tail, p, static_cast<size_t>(n) * sizeof(bf16_t));
  return load16(tail);
}
__attribute__((target("avx2,fma"))) inline __m256 load8(const float* p) { return _mm256_loadu_ps(p); }
__attribute__((target("avx2,fma"))) inline __m256 load8(const bf16_t* p) {
  const __m128i h = _mm_loadu_si128(reinterpret_cast<const __m128i*>(p));
  return _mm256_castsi256_ps(_mm256_slli_epi32(_mm256_cvtepu16_epi32(h), 16));
}
__attribute__((target("avx2,fma"))) inline __m256 load8_tail(const float* p, __m256i mask, int64_t) {
  return _mm256_maskload_ps(p, mask);
}
__attribute__((target("avx2,fma"))) inline __m256 load8_tail(const bf16_t* p, __m256i, int64_t n) {
  alignas(16) bf16_t tail[8] = {};
  std::memcpy(tail, p, static_cast<size_t>(n) * sizeof(bf16_t));
  return load8(tail);
}

// ---- AVX-512: blocks of NB weight rows x MB activation rows, 16 lanes. (The last block's prefetch may point past
// the weights: a prefetch never faults.)
template <int NB, bool PACKED, int PF, typename W>
__attribute__((always_inline)) inline void prefetch_next(const W* row, int64_t K) {
  using L = Layout<NB, PACKED>;
  if constexpr (PF == static_cast<int>(Prefetch::l1)) {
    _mm_prefetch(reinterpret_cast<const char*>(row + L::next(K)), _MM_HINT_T0);
  } else if constexpr (PF == static_cast<int>(Prefetch::l2)) {
    _mm_prefetch(reinterpret_cast<const char*>(row + 2 * L::next(K)), _MM_HINT_T1);
  }
}

template <int NB, int MB, int PF, bool PACKED, typename W>
__attribute__((target("avx512f"))) void block512(const float* x, const W* w, float* y, int64_t K, int64_t N,
                                                 int64_t ldx, int64_t n0, int64_t m0) {
  using L = Layout<NB, PACKED>;
  __m512 acc[NB][MB];
  for (int i = 0; i < NB; ++i)
    for (int j = 0; j < MB; ++j) acc[i][j] = _mm512_setzero_ps();
  const W* wr[NB];  // each row's current 16-element chunk
  for (int i = 0; i < NB; ++i) wr[i] = w + i * L::row(K);
  int64_t k = 0;
  for (; k + 16 <= K; k += 16) {
    __m512 wv[NB];
    for (int i = 0; i < NB; ++i) {
      prefetch_next<NB, PACKED, PF>(wr[i], K);
      wv[i] = load16(wr[i]);
      wr[i] += L::chunk;
    }
    for (int j = 0; j < MB; ++j) {
      const __m512 xv = _mm512_loadu_ps(x + (m0 + j) * ldx + k);
      for (int i = 0; i < NB; ++i) acc[i][j] = _mm512_fmadd_ps(wv[i], xv, acc[i][j]);
    }
  }
  if (k < K) {
    const __mmask16 mask = static_cast<__mmask16>((1u << (K - k)) - 1u);
    __m512 wv[NB];
    for (int i = 0; i < NB; ++i) wv[i] = load16_tail(wr[i], K - k);
    for (int j = 0; j < MB; ++j) {
      const __m512 xv = _mm512_maskz_loadu_ps(mask, x + (m0 + j) * ldx + k);
      for (int i = 0; i < NB; ++i) acc[i][j] = _mm512_fmadd_ps(wv[i], xv, acc[i][j]);
    }
  }
  for (int i = 0; i < NB; ++i)
    for (int j = 0; j < MB; ++j) y[(m0 + j) * N + n0 + i] = _mm512_reduce_add_ps(acc[i][j]);
}

// ---- AVX2 + FMA: the same with 8 lanes (16 registers: blocks of up to 3 activation rows).
using specserve_simd::hsum256;

template <int NB, int MB, int PF, bool PACKED, typename W>
__attribute__((target("avx2,fma"))) void block256(const float* x, const W* w, float* y, int64_t K, int64_t N,
                                                  int64_t ldx, int64_t n0, int64_t m0) {
  using L = Layout<NB, PACKED>;
  __m256 acc[NB][MB];
  for (int i = 0; i < NB; ++i)
    for (int j = 0; j < MB; ++j) acc[i][j] = _mm256_setzero_ps();
  const W* wr[NB];  // each row's current 16-element chunk (two 8-lane halves)
  for (int i = 0; i < NB; ++i) wr[i] = w + i * L::row(K);
  // The MB activation chunks stay in registers and each weight chunk is loaded once and used MB times: with NB = 4,
  // MB = 3 that is 12 accumulators + 3 + 1 = all 16 ymm registers, and 12 independent FMA chains hide the FMA
  // latency (8 chains, MB = 2, leave a Zen 3 core's two FMA pipes idle part of the time).
  int64_t k = 0;
  for (; k + 8 <= K; k += 8) {
    const int64_t half = k & 15;
    __m256 xv[MB];
    for (int j = 0; j < MB; ++j) xv[j] = _mm256_loadu_ps(x + (m0 + j) * ldx + k);
    for (int i = 0; i < NB; ++i) {
      if (half == 0) prefetch_next<NB, PACKED, PF>(wr[i], K);
      const __m256 wv = load8(wr[i] + half);
      if (half == 8) wr[i] += L::chunk;
      for (int j = 0; j < MB; ++j) acc[i][j] = _mm256_fmadd_ps(wv, xv[j], acc[i][j]);
    }
  }
  if (k < K) {
    alignas(32) int32_t lanes[8];
    for (int l = 0; l < 8; ++l) lanes[l] = (k + l < K) ? -1 : 0;
    const __m256i mask = _mm256_load_si256(reinterpret_cast<const __m256i*>(lanes));
    __m256 xv[MB];
    for (int j = 0; j < MB; ++j) xv[j] = _mm256_maskload_ps(x + (m0 + j) * ldx + k, mask);
    for (int i = 0; i < NB; ++i) {
      const __m256 wv = load8_tail(wr[i] + (k & 15), mask, K - k);
      for (int j = 0; j < MB; ++j) acc[i][j] = _mm256_fmadd_ps(wv, xv[j], acc[i][j]);
    }
  }
  for (int i = 0; i < NB; ++i)
    for (int j = 0; j < MB; ++j) y[(m0 + j) * N + n0 + i] = hsum256(acc[i][j]);
}

// ---- Quantised weights as records (pack_q4 / pack_q8 below), each weight formed in a register by the
// dequantisation's own arithmetic, which is exact in float32:
//   Q4_1: w = d * q + m of its 32-element group (q 0..15; d, m the float16 scale and minimum as float32), one FMA:
//         d * q has at most 11 + 4 significant bits, so the product is exact and the FMA rounds once, as the add does;
//   Q8_0: w = d * q (q -128..127; d float16 as float32), one multiply: at most 11 + 8 significant bits, exact.
// Each weight chunk then meets the activations in the same FMA sequence as block256 / block512 over the dequantised
// float32 weight: the same products, bit for bit, from 0.19x (Q4_1) or 0.28x (Q8_0) the bytes.
// A block of NB rows is one record per group: NB x F::qbytes bytes of values (Q4_1: byte b holds element b low and
// element b + 16 high, as ggml stores them; Q8_0: element b in byte b), then NB x F::scales floats (Q4_1: d, m; Q8_0:
// d); records for k ascending, the blocks of 4 rows, then the N % 4 last rows alone.
constexpr int64_t kQ4Group = 32;

struct Q4Fmt {
  static constexpr int64_t qbytes = 16, scales = 2;
  // Weights 8h .. 8h + 7 of one row's group: the nibbles of bytes (h & 1) * 8 .., low ones for h < 2 (elements
  // 0..15), high ones after (16..31).
  __attribute__((target("avx2,fma"), always_inline)) static inline __m256 form8(const uint8_t* row, int h, __m256 d,
                                                                               __m256 m) {
    const __m256i wide = _mm256_cvtepu8_epi32(_mm_loadl_epi64(reinterpret_cast<const __m128i*>(row + (h & 1) * 8)));
    const __m256i q = h < 2 ? _mm256_and_si256(wide, _mm256_set1_epi32(15)) : _mm256_srli_epi32(wide, 4);
    return _mm256_fmadd_ps(_mm256_cvtepi32_ps(q), d, m);
  }
  // Weights 16h .. 16h + 15: every byte, low nibbles for h = 0, high for h = 1.
  __attribute__((target("avx512f"), always_inline)) static inline __m512 form16(const uint8_t* row, int h, float d,
                                                                                float m) {
    const __m512i wide = _mm512_cvtepu8_epi32(_mm_loadu_si128(reinterpret_cast<const __m128i*>(row)));
    const __m512i q = h == 0 ? _mm512_and_si512(wide, _mm512_set1_epi32(15)) : _mm512_srli_epi32(wide, 4);
    return _mm512_fmadd_ps(_mm512_cvtepi32_ps(q), _mm512_set1_ps(d), _mm512_set1_ps(m));
  }
};

struct Q8Fmt {
  static constexpr int64_t qbytes = 32, scales = 1;
  __attribute__((target("avx2,fma"), always_inline)) static inline __m256 form8(const uint8_t* row, int h, __m256 d,
                                                                               __m256) {
    const __m256i q = _mm256_cvtepi8_epi32(_mm_loadl_epi64(reinterpret_cast<const __m128i*>(row + 8 * h)));
    return _mm256_mul_ps(_mm256_cvtepi32_ps(q), d);
  }
  __attribute__((target("avx512f"), always_inline)) static inline __m512 form16(const uint8_t* row, int h, float d,
                                                                                float) {
    const __m512i q = _mm512_cvtepi8_epi32(_mm_loadu_si128(reinterpret_cast<const __m128i*>(row + 16 * h)));
    return _mm512_mul_ps(_mm512_cvtepi32_ps(q), _mm512_set1_ps(d));
  }
};

template <typename F>
constexpr int64_t record_bytes(int64_t nb) {
  return nb * (F::qbytes + F::scales * static_cast<int64_t>(sizeof(float)));
}

// A group's scale and minimum of row i of a record (dm: the record's floats); Q8_0 has no minimum (unused: 0).
template <typename F>
__attribute__((always_inline)) inline float scale_of(const float* dm, int i) {
  return dm[F::scales * i];
}
template <typename F>
__attribute__((always_inline)) inline float min_of(const float* dm, int i) {
  if constexpr (F::scales > 1) return dm[F::scales * i + 1];
  return 0.0f;
}

template <typename F, int NB, int PF>
__attribute__((always_inline)) inline void prefetch_record(const uint8_t* rec, int64_t block_bytes) {
  constexpr int64_t bytes = record_bytes<F>(NB);
  for (int64_t off = 0; off < bytes; off += 64) {
    if constexpr (PF == static_cast<int>(Prefetch::l1)) {
      _mm_prefetch(reinterpret_cast<const char*>(rec + block_bytes + off), _MM_HINT_T0);
    } else if constexpr (PF == static_cast<int>(Prefetch::l2)) {
      _mm_prefetch(reinterpret_cast<const char*>(rec + 2 * block_bytes + off), _MM_HINT_T1);
    }
  }
}

// Weights 8h .. 8h + 7 of row i of a group's record w.
template <typename F>
__attribute__((target("avx2,fma"), always_inline)) inline __m256 form8(const uint8_t* w, const float* dm, int i,
                                                                      int h) {
  __m256 m = _mm256_setzero_ps();
  if constexpr (F::scales > 1) m = _mm256_broadcast_ss(dm + F::scales * i + 1);
  return F::form8(w + F::qbytes * i, h, _mm256_broadcast_ss(dm + F::scales * i), m);
}

// Rows i0 .. i0 + NI - 1 of a group's record formed into wbuf (one float32 row of 32 weights each).
template <typename F, int NI>
__attribute__((target("avx2,fma"), always_inline)) inline void form_group(const uint8_t* w, const float* dm, int i0,
                                                                         float (*wbuf)[kQ4Group]) {
  for (int i = 0; i < NI; ++i) {
    for (int h = 0; h < 4; ++h) _mm256_store_ps(wbuf[i] + 8 * h, form8<F>(w, dm, i0 + i, h));
  }
}

template <typename F, int NB, int MB, int PF>
__attribute__((target("avx2,fma"))) void block256_rec(const float* x, const uint8_t* w, float* y, int64_t K, int64_t N,
                                                      int64_t ldx, int64_t n0, int64_t m0) {
  __m256 acc[NB][MB];
  for (int i = 0; i < NB; ++i)
    for (int j = 0; j < MB; ++j) acc[i][j] = _mm256_setzero_ps();
  const int64_t block_bytes = K / kQ4Group * record_bytes<F>(NB);
  for (int64_t k0 = 0; k0 < K; k0 += kQ4Group, w += record_bytes<F>(NB)) {
    prefetch_record<F, NB, PF>(w, block_bytes);
    const float* dm = reinterpret_cast<const float*>(w + NB * F::qbytes);
    if constexpr (MB > 1) {
      // Several rows: the group's weights formed first into a stack buffer, then the float32 kernel's loop over it
      // (NB x MB accumulators and MB activations fill the 16 registers; forming weights beside them would spill).
      alignas(32) float wbuf[NB][kQ4Group];
      form_group<F, NB>(w, dm, 0, wbuf);
      for (int h = 0; h < 4; ++h) {
        const int64_t k = k0 + 8 * h;
        __m256 xv[MB];
        for (int j = 0; j < MB; ++j) xv[j] = _mm256_loadu_ps(x + (m0 + j) * ldx + k);
        for (int i = 0; i < NB; ++i) {
          const __m256 wv = _mm256_load_ps(wbuf[i] + 8 * h);
          for (int j = 0; j < MB; ++j) acc[i][j] = _mm256_fmadd_ps(wv, xv[j], acc[i][j]);
        }
      }
      continue;
    }
    for (int h = 0; h < 4; ++h) {  // elements 8h .. 8h + 7 of the group
      const int64_t k = k0 + 8 * h;
      __m256 xv[MB];
      for (int j = 0; j < MB; ++j) xv[j] = _mm256_loadu_ps(x + (m0 + j) * ldx + k);
      for (int i = 0; i < NB; ++i) {
        const __m256 wv = form8<F>(w, dm, i, h);
        for (int j = 0; j < MB; ++j) acc[i][j] = _mm256_fmadd_ps(wv, xv[j], acc[i][j]);
      }
    }
  }
  for (int i = 0; i < NB; ++i)
    for (int j = 0; j < MB; ++j) y[(m0 + j) * N + n0 + i] = hsum256(acc[i][j]);
}

// 4-6 activation rows over a block of 4 weight rows: two passes of 2 weight rows each (2 x MB accumulators, the
// two rows' formed weights and one activation chunk at a time: <= 15 registers), each forming its rows' weights of a
// group into a stack buffer once for all MB activation rows. Each y[m, n] keeps block256's FMA sequence.
template <typename F, int MB, int PF, int I0>
__attribute__((target("avx2,fma"))) void block256_rec_pair(const float* x, const uint8_t* w, float* y, int64_t K,
                                                           int64_t N, int64_t ldx, int64_t n0, int64_t m0) {
  constexpr int NB = 4;
  __m256 acc[2][MB];
  for (int i = 0; i < 2; ++i)
    for (int j = 0; j < MB; ++j) acc[i][j] = _mm256_setzero_ps();
  const int64_t block_bytes = K / kQ4Group * record_bytes<F>(NB);
  for (int64_t k0 = 0; k0 < K; k0 += kQ4Group, w += record_bytes<F>(NB)) {
    if constexpr (I0 == 0) prefetch_record<F, NB, PF>(w, block_bytes);
    const float* dm = reinterpret_cast<const float*>(w + NB * F::qbytes);
    alignas(32) float wbuf[2][kQ4Group];
    form_group<F, 2>(w, dm, I0, wbuf);
    for (int h = 0; h < 4; ++h) {
      const int64_t k = k0 + 8 * h;
      const __m256 w0 = _mm256_load_ps(wbuf[0] + 8 * h), w1 = _mm256_load_ps(wbuf[1] + 8 * h);
      for (int j = 0; j < MB; ++j) {
        const __m256 xv = _mm256_loadu_ps(x + (m0 + j) * ldx + k);
        acc[0][j] = _mm256_fmadd_ps(w0, xv, acc[0][j]);
        acc[1][j] = _mm256_fmadd_ps(w1, xv, acc[1][j]);
      }
    }
  }
  for (int i = 0; i < 2; ++i)
    for (int j = 0; j < MB; ++j) y[(m0 + j) * N + n0 + I0 + i] = hsum256(acc[i][j]);
}

template <typename F, int MB, int PF>
__attribute__((target("avx2,fma"))) void block256_rec_pairs(const float* x, const uint8_t* w, float* y, int64_t K,
                                                            int64_t N, int64_t ldx, int64_t n0, int64_t m0) {
  block256_rec_pair<F, MB, PF, 0>(x, w, y, K, N, ldx, n0, m0);
  block256_rec_pair<F, MB, PF, 2>(x, w, y, K, N, ldx, n0, m0);
}

template <typename F, int NB, int MB, int PF>
__attribute__((target("avx512f"))) void block512_rec(const float* x, const uint8_t* w, float* y, int64_t K, int64_t N,
                                                     int64_t ldx, int64_t n0, int64_t m0) {
  __m512 acc[NB][MB];
  for (int i = 0; i < NB; ++i)
    for (int j = 0; j < MB; ++j) acc[i][j] = _mm512_setzero_ps();
  const int64_t block_bytes = K / kQ4Group * record_bytes<F>(NB);
  for (int64_t k0 = 0; k0 < K; k0 += kQ4Group, w += record_bytes<F>(NB)) {
    prefetch_record<F, NB, PF>(w, block_bytes);
    const float* dm = reinterpret_cast<const float*>(w + NB * F::qbytes);
    for (int h = 0; h < 2; ++h) {  // elements 16h .. 16h + 15
      const int64_t k = k0 + 16 * h;
      __m512 xv[MB];
      for (int j = 0; j < MB; ++j) xv[j] = _mm512_loadu_ps(x + (m0 + j) * ldx + k);
      for (int i = 0; i < NB; ++i) {
        const __m512 wv = F::form16(w + F::qbytes * i, h, scale_of<F>(dm, i), min_of<F>(dm, i));
        for (int j = 0; j < MB; ++j) acc[i][j] = _mm512_fmadd_ps(wv, xv[j], acc[i][j]);
      }
    }
  }
  for (int i = 0; i < NB; ++i)
    for (int j = 0; j < MB; ++j) y[(m0 + j) * N + n0 + i] = _mm512_reduce_add_ps(acc[i][j]);
}

// A block of NB rows' records -> their float32 weights in the packed layout (Layout<NB, true>: [K / 16][NB][16]),
// each value by the same operations as block256_rec forms it, so that products of more rows than one call takes run
// the float32 kernel over the block once dequantised, instead of dequantising it again for every MB activation rows.
// PF prefetches the record stream as the in-register kernels do (until 2026-11-30 it went unprefetched here: products
// of 7-16 rows of SmolLM2's layers took 12-27% longer on an AMX Xeon, on its AVX-512 and its AVX2 path alike, and 32
// rows 5-10% longer).
template <typename F, int NB, int PF>
__attribute__((target("avx2,fma"))) void dequant_block(const uint8_t* w, int64_t K, float* out) {
  const int64_t block_bytes = K / kQ4Group * record_bytes<F>(NB);
  for (int64_t k0 = 0; k0 < K; k0 += kQ4Group, w += record_bytes<F>(NB)) {
    prefetch_record<F, NB, PF>(w, block_bytes);
    const float* dm = reinterpret_cast<const float*>(w + NB * F::qbytes);
    float* chunk = out + (k0 / 16) * NB * 16;  // elements 0..15 of the group in this chunk, 16..31 in the next
    for (int i = 0; i < NB; ++i) {
      for (int h = 0; h < 4; ++h) {
        _mm256_storeu_ps(chunk + (h / 2) * NB * 16 + i * 16 + (h & 1) * 8, form8<F>(w, dm, i, h));
      }
    }
  }
}

using RecordFn = void (*)(const float*, const uint8_t*, float*, int64_t, int64_t, int64_t, int64_t, int64_t);
using DequantFn = void (*)(const uint8_t*, int64_t, float*);

// dequant_block for a block of 4 rows (else one) with the record stream prefetched as `prefetch` says.
template <typename F>
DequantFn dequant_with(bool full_block, Prefetch prefetch) {
  constexpr int none = static_cast<int>(Prefetch::none), l1 = static_cast<int>(Prefetch::l1),
                l2 = static_cast<int>(Prefetch::l2);
  switch (prefetch) {
    case Prefetch::l1: return full_block ? &dequant_block<F, 4, l1> : &dequant_block<F, 1, l1>;
    case Prefetch::l2: return full_block ? &dequant_block<F, 4, l2> : &dequant_block<F, 1, l2>;
    default: return full_block ? &dequant_block<F, 4, none> : &dequant_block<F, 1, none>;
  }
}

template <typename F, int NB, int PF>
RecordFn pick_record_rows(bool wide, int64_t mb) {
  if (wide) {
    switch (mb) {
      case 1: return &block512_rec<F, NB, 1, PF>;
      case 2: return &block512_rec<F, NB, 2, PF>;
      case 3: return &block512_rec<F, NB, 3, PF>;
      case 4: return &block512_rec<F, NB, 4, PF>;
      case 5: return &block512_rec<F, NB, 5, PF>;
      default: return &block512_rec<F, NB, 6, PF>;
    }
  }
  if constexpr (NB == 4) {
    switch (mb) {
      case 4: return &block256_rec_pairs<F, 4, PF>;
      case 5: return &block256_rec_pairs<F, 5, PF>;
      case 6: return &block256_rec_pairs<F, 6, PF>;
      default: break;
    }
  }
  switch (mb) {
    case 1: return &block256_rec<F, NB, 1, PF>;
    case 2: return &block256_rec<F, NB, 2, PF>;
    default: return &block256_rec<F, NB, 3, PF>;
  }
}

template <typename F>
RecordFn pick_record(bool wide, bool full_block, int64_t mb, Prefetch prefetch) {
  constexpr int none = static_cast<int>(Prefetch::none), l1 = static_cast<int>(Prefetch::l1),
                l2 = static_cast<int>(Prefetch::l2);
  switch (prefetch) {
    case Prefetch::l1:
      return full_block ? pick_record_rows<F, 4, l1>(wide, mb) : pick_record_rows<F, 1, l1>(wide, mb);
    case Prefetch::l2:
      return full_block ? pick_record_rows<F, 4, l2>(wide, mb) : pick_record_rows<F, 1, l2>(wide, mb);
    default: return full_block ? pick_record_rows<F, 4, none>(wide, mb) : pick_record_rows<F, 1, none>(wide, mb);
  }
}
// The kernel for a block of NB weight rows x mb activation rows (1 <= mb <= 6).
template <int NB, int PF, bool PACKED, typename W>
BlockFn<W> pick512(int64_t mb) {
  switch (mb) {
    case 1: return &block512<NB, 1, PF, PACKED, W>;
    case 2: return &block512<NB, 2, PF, PACKED, W>;
    case 3: return &block512<NB, 3, PF, PACKED, W>;
    case 4: return &block512<NB, 4, PF, PACKED, W>;
    case 5: return &block512<NB, 5, PF, PACKED, W>;
    default: return &block512<NB, 6, PF, PACKED, W>;
  }
}

template <int NB, int PF, bool PACKED, typename W>
BlockFn<W> pick256(int64_t mb) {
  switch (mb) {
    case 1: return &block256<NB, 1, PF, PACKED, W>;
    case 2: return &block256<NB, 2, PF, PACKED, W>;
    default: return &block256<NB, 3, PF, PACKED, W>;
  }
}

template <int NB, bool PACKED, typename W>
BlockFn<W> pick_rows(bool wide, int64_t mb, Prefetch prefetch) {
  constexpr int none = static_cast<int>(Prefetch::none), l1 = static_cast<int>(Prefetch::l1),
                l2 = static_cast<int>(Prefetch::l2);
  switch (prefetch) {
    case Prefetch::l1: return wide ? pick512<NB, l1, PACKED, W>(mb) : pick256<NB, l1, PACKED, W>(mb);
    case Prefetch::l2: return wide ? pick512<NB, l2, PACKED, W>(mb) : pick256<NB, l2, PACKED, W>(mb);
    default: return wide ? pick512<NB, none, PACKED, W>(mb) : pick256<NB, none, PACKED, W>(mb);
  }
}

template <typename W>
BlockFn<W> pick(bool wide, bool packed, bool full_block, int64_t mb, Prefetch prefetch) {
  if (packed) {
    return full_block ? pick_rows<4, true, W>(wide, mb, prefetch) : pick_rows<1, true, W>(wide, mb, prefetch);
  }
  return full_block ? pick_rows<4, false, W>(wide, mb, prefetch) : pick_rows<1, false, W>(wide, mb, prefetch);
}

#else
template <typename W>
BlockFn<W> pick(bool, bool, bool, int64_t, Prefetch) { return nullptr; }  // never called: supported() is false
using RecordFn = void (*)(const float*, const uint8_t*, float*, int64_t, int64_t, int64_t, int64_t, int64_t);
struct Q4Fmt {
  static constexpr int64_t qbytes = 16, scales = 2;
};
struct Q8Fmt {
  static constexpr int64_t qbytes = 32, scales = 1;
};
template <typename F>
RecordFn pick_record(bool, bool, int64_t, Prefetch) { return nullptr; }
using DequantFn = void (*)(const uint8_t*, int64_t, float*);
template <typename F>
DequantFn dequant_with(bool, Prefetch) { return nullptr; }
constexpr int64_t kQ4Group = 32;
template <typename F>
constexpr int64_t record_bytes(int64_t nb) {
  return nb * (F::qbytes + F::scales * static_cast<int64_t>(sizeof(float)));
}
#endif

bool supported() { return isa() != Isa::none; }

std::string isa_in_use() { return isa() == Isa::avx512 ? "avx512" : isa() == Isa::avx2 ? "avx2" : "none"; }

// The instruction sets this CPU runs, best first ("avx512", "avx2"): a test runs each path by name.
std::vector<std::string> isas() {
  std::vector<std::string> out;
#if SPECSERVE_X86
  if (isa() == Isa::avx512) out.emplace_back("avx512");
  if (isa() != Isa::none && __builtin_cpu_supports("avx2") && __builtin_cpu_supports("fma")) out.emplace_back("avx2");
#endif
  return out;
}

// Activation rows for the next call out of `rest`: MB, except where that would leave one row alone (a block of one
// activation row has NB FMA chains, too few to hide the FMA latency): 4 rows run as 2 + 2 on AVX2, 7 as 3 + 2 + 2.
// Which rows share a call changes no bit (each y[m, n] is its own chain).
int64_t rows_at(int64_t MB, int64_t rest) {
  if (rest <= MB) return rest;
  return rest - MB == 1 && MB > 1 ? MB - 1 : MB;
}

// Weight rows per block (both paths and the packed layout); the N % 4 last rows run blocks of one.
constexpr int64_t kBlockRows = 4;

void add_bias(at::Tensor& y, const std::optional<at::Tensor>& bias) {
  if (!bias.has_value() || !bias->defined()) return;
  TORCH_CHECK(bias->dim() == 1 && bias->size(0) == y.size(1) && bias->scalar_type() == at::kFloat &&
                  bias->device().is_cpu(),
              "a bias is float32 [N] = [", y.size(1), "] on the CPU, got ", bias->scalar_type(), " ",
              bias->sizes(), " on ", bias->device());
  y.add_(*bias);
}

Prefetch by_default(int64_t rows) { return rows > 1 ? Prefetch::l1 : Prefetch::none; }

// y = x @ w^T (+ bias) for w [N, K] at wp, row-major or packed (then the block of rows from n starts at wp + n * kp).
template <typename W>
at::Tensor run(const at::Tensor& x_in, const W* wp, bool packed, int64_t N, int64_t K,
               const std::optional<at::Tensor>& bias, Isa use, std::optional<Prefetch> pf) {
  TORCH_CHECK(x_in.dim() == 2 && x_in.size(1) == K, "small_gemm: want x [M, ", K, "]");
  TORCH_CHECK(x_in.scalar_type() == at::kFloat && x_in.device().is_cpu(), "small_gemm: float32 CPU rows");
  const int64_t M = x_in.size(0), kp = packed ? padded_k(K) : K;
  TORCH_CHECK(M >= 1 && M <= kMaxRows, "small_gemm: 1..64 rows, got ", M);
  const at::Tensor x = x_in.contiguous();
  at::Tensor y = at::empty({M, N}, x.options());
  const float* xp = x.data_ptr<float>();
  float* yp = y.data_ptr<float>();
  const bool wide = use == Isa::avx512;
  // accumulators: 24 of 32 zmm registers, 12 of 16 ymm (2 rows, 8 chains, measured 4-9% slower for 6-8 rows on a
  // 2-core Zen 3 EPYC: docs/benchmarks.md, "Three activation rows per AVX2 block")
  const int64_t MB = wide ? 6 : 3;
  const Prefetch prefetch = pf.value_or(by_default(M));
  const int64_t blocks = N / kBlockRows;
  // Both kernels are chosen once per call from (chunk rows); each y[m, n] then follows one fixed sequence.
  auto run_rows = [&](int64_t n0, int64_t n1, int64_t nb_rows) {
    for (int64_t n = n0; n < n1; n += nb_rows) {
      for (int64_t m0 = 0, mb = 0; m0 < M; m0 += mb) {
        mb = rows_at(MB, M - m0);
        pick<W>(wide, packed, nb_rows == kBlockRows, mb, prefetch)(xp, wp + n * kp, yp, K, N, K, n, m0);
      }
    }
  };
  // ~16 KB of weights per grain step: enough work per task to hide at::parallel_for's cost.
  const int64_t grain = std::max<int64_t>(1, 4096 / std::max<int64_t>(1, K));
  at::parallel_for(0, blocks, grain,
                   [&](int64_t b0, int64_t b1) { run_rows(b0 * kBlockRows, b1 * kBlockRows, kBlockRows); });
  if (blocks * kBlockRows < N) run_rows(blocks * kBlockRows, N, 1);
  add_bias(y, bias);
  return y;
}

// The threads the kernel's products are split over: at::parallel_for is a header template that runs serially unless
// this file is compiled with OpenMP (-fopenmp, native_stack.CFLAGS), which until 2026-11-25 it was not: every
// product ran on one core (SmolLM2's layers at 1 row 11.3 ms on one core of a 2-core EPYC, 6.7 ms on both).
int64_t parallel_threads() {
  std::atomic<uint64_t> seen{0};
  at::parallel_for(0, 1024, 1, [&](int64_t, int64_t) {
    seen.fetch_or(uint64_t{1} << std::min<int64_t>(at::get_thread_num(), 63));
  });
  return static_cast<int64_t>(std::bitset<64>(seen.load()).count());
}

Isa named(const std::string& name) {
  const auto ok = isas();
  TORCH_CHECK(std::find(ok.begin(), ok.end(), name) != ok.end(), "small_gemm: this CPU does not run ", name);
  return name == "avx512" ? Isa::avx512 : Isa::avx2;
}

at::Tensor linear_with(const at::Tensor& x, const at::Tensor& w, const std::optional<at::Tensor>& bias, Isa use,
                       std::optional<Prefetch> pf = std::nullopt) {
  TORCH_CHECK(w.dim() == 2, "small_gemm: want w [N, K]");
  TORCH_CHECK(w.scalar_type() == at::kFloat && w.device().is_cpu() && w.is_contiguous(),
              "small_gemm: a contiguous float32 CPU weight");
  return run(x, w.data_ptr<float>(), false, w.size(0), w.size(1), bias, use, pf);
}

// y = x @ w^T (+ bias): x [M, K] (1 <= M <= 64), w [N, K], float32, CPU, contiguous rows; the best detected path.
// prefetch: as chosen for this row count (kernel_plan_for), else by_default.
at::Tensor linear(const at::Tensor& x, const at::Tensor& w, const std::optional<at::Tensor>& bias,
                  std::optional<Prefetch> prefetch) {
  TORCH_CHECK(supported(), "small_gemm: this CPU has neither AVX-512F nor AVX2+FMA");
  return linear_with(x, w, bias, isa(), prefetch);
}

// The same through a named path ("avx512" or "avx2"), which this CPU must run (isas()).
at::Tensor linear_isa(const at::Tensor& x, const at::Tensor& w, const std::optional<at::Tensor>& bias,
                      const std::string& name) {
  return linear_with(x, w, bias, named(name));
}

// ---- bfloat16 weights: y = x @ float32(w)^T (+ bias) for w [N, K] bfloat16, the same bits as over the float32 copy.
at::Tensor linear_bf16_with(const at::Tensor& x, const at::Tensor& w, const std::optional<at::Tensor>& bias, Isa use,
                            std::optional<Prefetch> pf = std::nullopt) {
  TORCH_CHECK(w.dim() == 2, "small_gemm: want w [N, K]");
  TORCH_CHECK(w.scalar_type() == at::kBFloat16 && w.device().is_cpu() && w.is_contiguous(),
              "small_gemm: a contiguous bfloat16 CPU weight");
  const auto* wp = reinterpret_cast<const bf16_t*>(w.data_ptr<at::BFloat16>());
  return run(x, wp, false, w.size(0), w.size(1), bias, use, pf);
}

at::Tensor linear_bf16(const at::Tensor& x, const at::Tensor& w, const std::optional<at::Tensor>& bias,
                       std::optional<Prefetch> prefetch) {
  TORCH_CHECK(supported(), "small_gemm: this CPU has neither AVX-512F nor AVX2+FMA");
  return linear_bf16_with(x, w, bias, isa(), prefetch);
}

at::Tensor linear_bf16_isa(const at::Tensor& x, const at::Tensor& w, const std::optional<at::Tensor>& bias,
                           const std::string& name) {
  return linear_bf16_with(x, w, bias, named(name));
}

// ---- The packed layout. A row-major weight makes a block four interleaved streams, each jumping at the block's
// end (a 2-core EPYC over SmolLM2's weights: one row 16 ms, two 19). Packed, a block of 4 rows is one sequential
// stream of 16-float chunks side by side: [N / 4][kp / 16][4][16], then the N % 4 last rows [kp] each, with kp = K
// rounded up to 16 and zeros after K (a masked load of the last chunk reads the same zeros either way). Every
// product is the same sequence of operations as over the row-major weight, so the same bits.
Packed pack(const at::Tensor& w) {
  TORCH_CHECK(w.dim() == 2 && (w.scalar_type() == at::kFloat || w.scalar_type() == at::kBFloat16) &&
                  w.device().is_cpu(),
              "small_gemm: pack wants a float32 or bfloat16 CPU weight [N, K]");
  const int64_t N = w.size(0), K = w.size(1), kp = padded_k(K), blocks = N / kBlockRows;
  const at::Tensor padded = at::constant_pad_nd(w, {0, kp - K}).contiguous();
  const at::Tensor head = padded.narrow(0, 0, blocks * kBlockRows)
                              .view({blocks, kBlockRows, kp / 16, 16})
                              .permute({0, 2, 1, 3})
                              .reshape({-1});
  const at::Tensor tail = padded.narrow(0, blocks * kBlockRows, N - blocks * kBlockRows).reshape({-1});
  return Packed{at::cat({head, tail}).contiguous(), N, K};
}

// ---- Quantised weights in the kernel's record layout (block256_rec above), written by pack_q4 / pack_q8.
// A record of nb rows from row r0 at each group g: nb x F::qbytes value bytes (values(i, g, bytes) fills row r0 + i's),
// then nb x F::scales floats (scales(i, g, floats)).
template <typename F, typename Values, typename Scales>
at::Tensor write_records(int64_t N, int64_t K, at::ScalarType dtype, Values values, Scales scales) {
  const int64_t groups = K / kQ4Group;
  at::Tensor data = at::zeros({N * groups * record_bytes<F>(1)}, dtype);
  auto* out = static_cast<uint8_t*>(data.data_ptr());
  auto write = [&](int64_t r0, int64_t nb) {
    uint8_t* rec = out + r0 * groups * record_bytes<F>(1);
    for (int64_t g = 0; g < groups; ++g, rec += record_bytes<F>(nb)) {
      float* dm = reinterpret_cast<float*>(rec + nb * F::qbytes);
      for (int64_t i = 0; i < nb; ++i) {
        values(r0 + i, g, rec + F::qbytes * i);
        scales(r0 + i, g, dm + F::scales * i);
      }
    }
  };
  const int64_t blocks = N / kBlockRows;
  for (int64_t b = 0; b < blocks; ++b) write(b * kBlockRows, kBlockRows);
  for (int64_t r = blocks * kBlockRows; r < N; ++r) write(r, 1);
  return data;
}

// The groups' scales (and minima) [N, K / 32] as the records keep them: float32 values that float16 holds (d * q is
// exact in float32 only for such a d: then the kernel's FMA or multiply is the dequantisation's value).
void check_scales(const char* fn, const at::Tensor& t, int64_t N, int64_t groups, bool half_values) {
  TORCH_CHECK(t.dim() == 2 && t.size(0) == N && t.size(1) == groups && t.scalar_type() == at::kFloat &&
                  t.device().is_cpu(),
              "small_gemm: ", fn, " wants its scales [N, K / 32] float32 on the CPU");
  if (half_values) {
    TORCH_CHECK(at::equal(t, t.to(at::kHalf).to(at::kFloat)), "small_gemm: ", fn, " wants float16 values in d");
  }
}

// Q4_1 blocks: q [N, K] uint8 0..15, d and m [N, K / 32] float32 (float16 values): the weight row n is
// d[n, g] * q[n, k] + m[n, g] for k in group g = k / 32. Records of uint8.
Packed pack_q4(const at::Tensor& q_in, const at::Tensor& d_in, const at::Tensor& m_in) {
  TORCH_CHECK(q_in.dim() == 2 && q_in.scalar_type() == at::kByte && q_in.device().is_cpu(),
              "small_gemm: pack_q4 wants q [N, K] uint8 on the CPU");
  const int64_t N = q_in.size(0), K = q_in.size(1), groups = K / kQ4Group;
  TORCH_CHECK(K % kQ4Group == 0 && K > 0 && N > 0, "small_gemm: pack_q4 wants K a multiple of 32, got ", K);
  check_scales("pack_q4", d_in, N, groups, true);
  check_scales("pack_q4", m_in, N, groups, false);
  TORCH_CHECK(q_in.max().item<int64_t>() <= 15, "small_gemm: pack_q4 wants 4-bit values (0..15)");
  const at::Tensor q = q_in.contiguous(), d = d_in.contiguous(), m = m_in.contiguous();
  const uint8_t* qp = q.data_ptr<uint8_t>();
  const float* dp = d.data_ptr<float>();
  const float* mp = m.data_ptr<float>();
  auto values = [&](int64_t r, int64_t g, uint8_t* out) {
    const uint8_t* qr = qp + r * K + g * kQ4Group;
    for (int64_t b = 0; b < 16; ++b) out[b] = static_cast<uint8_t>(qr[b] | (qr[b + 16] << 4));
  };
  auto scales = [&](int64_t r, int64_t g, float* out) {
    out[0] = dp[r * groups + g];
    out[1] = mp[r * groups + g];
  };
  return Packed{write_records<Q4Fmt>(N, K, at::kByte, values, scales), N, K};
}

// Q8_0 blocks: q [N, K] int8, d [N, K / 32] float32 (float16 values): the weight row n is d[n, g] * q[n, k]. Records
// of int8 (the dtype says which format a packed weight holds).
Packed pack_q8(const at::Tensor& q_in, const at::Tensor& d_in) {
  TORCH_CHECK(q_in.dim() == 2 && q_in.scalar_type() == at::kChar && q_in.device().is_cpu(),
              "small_gemm: pack_q8 wants q [N, K] int8 on the CPU");
  const int64_t N = q_in.size(0), K = q_in.size(1), groups = K / kQ4Group;
  TORCH_CHECK(K % kQ4Group == 0 && K > 0 && N > 0, "small_gemm: pack_q8 wants K a multiple of 32, got ", K);
  check_scales("pack_q8", d_in, N, groups, true);
  const at::Tensor q = q_in.contiguous(), d = d_in.contiguous();
  const int8_t* qp = q.data_ptr<int8_t>();
  const float* dp = d.data_ptr<float>();
  auto values = [&](int64_t r, int64_t g, uint8_t* out) { std::memcpy(out, qp + r * K + g * kQ4Group, kQ4Group); };
  auto scales = [&](int64_t r, int64_t g, float* out) { out[0] = dp[r * groups + g]; };
  return Packed{write_records<Q8Fmt>(N, K, at::kChar, values, scales), N, K};
}

template <typename F>
at::Tensor run_records(const at::Tensor& x_in, const Packed& w, const std::optional<at::Tensor>& bias, Isa use,
                       std::optional<Prefetch> pf) {
  const int64_t N = w.n, K = w.k, groups = K / kQ4Group;
  TORCH_CHECK(K % kQ4Group == 0 && w.data.numel() == N * groups * record_bytes<F>(1),
              "small_gemm: not a record weight (pack_q4, pack_q8)");
  TORCH_CHECK(x_in.dim() == 2 && x_in.size(1) == K, "small_gemm: want x [M, ", K, "]");
  TORCH_CHECK(x_in.scalar_type() == at::kFloat && x_in.device().is_cpu(), "small_gemm: float32 CPU rows");
  const int64_t M = x_in.size(0);
  TORCH_CHECK(M >= 1 && M <= kMaxRows, "small_gemm: 1..64 rows, got ", M);
  const at::Tensor x = x_in.contiguous();
  at::Tensor y = at::empty({M, N}, x.options());
  const float* xp = x.data_ptr<float>();
  float* yp = y.data_ptr<float>();
  const auto* wp = static_cast<const uint8_t*>(w.data.data_ptr());
  const bool wide = use == Isa::avx512;
  // Activation rows one call takes: 6 over a block of 4 weight rows (AVX2: block256_rec_pairs for 4-6), MBF over a
  // single weight row and in the float32 kernel (AVX2: 3).
  const int64_t MB = 6, MBF = wide ? 6 : 3;
  const Prefetch prefetch = pf.value_or(by_default(M));
  const int64_t blocks = N / kBlockRows;
  // Rows in one call dequantise in registers; more rows than that dequantise each block once into a buffer the
  // float32 kernel then reads for all of them (the same weights, so the same bits either way), prefetching the
  // records as the plan says (the buffer, 16 K bytes, stays in L1 at SmolLM2's K of 576 and 1536).
  const bool buffered = M > MB;
  auto run_rows = [&](int64_t n0, int64_t n1, int64_t nb_rows) {
    thread_local std::vector<float> buf;  // kept per thread: no allocation per task
    if (buffered && buf.size() < static_cast<size_t>(nb_rows * K)) buf.resize(static_cast<size_t>(nb_rows * K));
    for (int64_t n = n0; n < n1; n += nb_rows) {
      const uint8_t* rec = wp + n * groups * record_bytes<F>(1);  // every row before n takes groups records' share
      if (buffered) {
        dequant_with<F>(nb_rows == kBlockRows, prefetch)(rec, K, buf.data());
      }
      const int64_t cap = buffered || nb_rows != kBlockRows ? MBF : MB;
      for (int64_t m0 = 0, mb = 0; m0 < M; m0 += mb) {
        mb = rows_at(cap, M - m0);
        if (buffered) {
          pick<float>(wide, true, nb_rows == kBlockRows, mb, Prefetch::none)(xp, buf.data(), yp, K, N, K, n, m0);
        } else {
          pick_record<F>(wide, nb_rows == kBlockRows, mb, prefetch)(xp, rec, yp, K, N, K, n, m0);
        }
      }
    }
  };
  const int64_t grain = std::max<int64_t>(1, 4096 / std::max<int64_t>(1, K));
  at::parallel_for(0, blocks, grain,
                   [&](int64_t b0, int64_t b1) { run_rows(b0 * kBlockRows, b1 * kBlockRows, kBlockRows); });
  if (blocks * kBlockRows < N) run_rows(blocks * kBlockRows, N, 1);
  add_bias(y, bias);
  return y;
}

at::Tensor linear_packed_with(const at::Tensor& x, const Packed& w, const std::optional<at::Tensor>& bias, Isa use,
                              std::optional<Prefetch> pf = std::nullopt) {
  TORCH_CHECK(w.reader == Reader::small_gemm, "small_gemm: w is packed for the int8 kernels (int8_pack_q4 / q8)");
  if (w.data.defined() && w.data.scalar_type() == at::kByte) return run_records<Q4Fmt>(x, w, bias, use, pf);
  if (w.data.defined() && w.data.scalar_type() == at::kChar) return run_records<Q8Fmt>(x, w, bias, use, pf);
  const int64_t kp = padded_k(w.k);
  TORCH_CHECK(w.data.defined() && w.data.numel() == w.n * kp &&
                  (w.data.scalar_type() == at::kFloat || w.data.scalar_type() == at::kBFloat16),
              "small_gemm: not a packed weight (small_pack)");
  if (w.data.scalar_type() == at::kBFloat16) {
    return run(x, reinterpret_cast<const bf16_t*>(w.data.data_ptr<at::BFloat16>()), true, w.n, w.k, bias, use, pf);
  }
  return run(x, w.data.data_ptr<float>(), true, w.n, w.k, bias, use, pf);
}

at::Tensor linear_packed(const at::Tensor& x, const Packed& w, const std::optional<at::Tensor>& bias,
                         std::optional<Prefetch> prefetch) {
  TORCH_CHECK(supported(), "small_gemm: this CPU has neither AVX-512F nor AVX2+FMA");
  return linear_packed_with(x, w, bias, isa(), prefetch);
}

at::Tensor linear_packed_isa(const at::Tensor& x, const Packed& w, const std::optional<at::Tensor>& bias,
                             const std::string& name) {
  return linear_packed_with(x, w, bias, named(name));
}

// ---- Greedy tokens through a bfloat16 copy (models/lm_head.py): for each row m of x, the first maximum of the
// float32 product x[m] @ w^T, computed exactly only for the columns whose approximate value (over `approx`, the
// bfloat16 copy packed) lies within bound * ||x[m]|| * row_norms[v] of the best lower bound. Each exact value is the
// same block kernel over the same row as in the full product, so the same bits. ok = false (and no ids) where a row
// of x or an approximate value is not finite: the caller then takes the full product.
std::tuple<at::Tensor, bool> bounded_argmax(const at::Tensor& x_in, const Packed& approx, const at::Tensor& w,
                                            const at::Tensor& row_norms, double bound) {
  TORCH_CHECK(supported(), "small_gemm: this CPU has neither AVX-512F nor AVX2+FMA");
  TORCH_CHECK(approx.reader == Reader::small_gemm && approx.data.defined() && approx.data.scalar_type() == at::kBFloat16,
              "bounded_argmax: a bf16 packed copy");
  TORCH_CHECK(w.dim() == 2 && w.scalar_type() == at::kFloat && w.is_contiguous() && w.size(0) == approx.n &&
                  w.size(1) == approx.k && w.device().is_cpu(),
              "bounded_argmax: the float32 weight [N, K] the copy was made from, on the CPU");
  TORCH_CHECK(row_norms.scalar_type() == at::kFloat && row_norms.dim() == 1 && row_norms.size(0) == approx.n &&
                  row_norms.is_contiguous() && row_norms.device().is_cpu(),
              "bounded_argmax: one float32 norm per weight row");
  const at::Tensor y = linear_packed(x_in, approx, std::nullopt, std::nullopt);  // [M, N] approximate
  const at::Tensor x = x_in.contiguous();
  const int64_t M = x.size(0), N = approx.n, K = approx.k;
  const float* xp = x.data_ptr<float>();
  const float* yp = y.data_ptr<float>();
  const float* wp = w.data_ptr<float>();
  const float* np = row_norms.data_ptr<float>();
  at::Tensor ids = at::empty({M}, at::kLong);
  int64_t* out = ids.data_ptr<int64_t>();
  const BlockFn<float> exact = pick<float>(isa() == Isa::avx512, false, false, 1, Prefetch::none);
  std::atomic<bool> finite{true};
  at::parallel_for(0, M, 1, [&](int64_t m0, int64_t m1) {
    for (int64_t m = m0; m < m1; ++m) {
      const float* xr = xp + m * K;
      const float* a = yp + m * N;
      double sq = 0.0;
      for (int64_t k = 0; k < K; ++k) sq += static_cast<double>(xr[k]) * xr[k];
      if (!std::isfinite(sq)) {  // a NaN or infinite state: the full logits decide, as without the copy
        finite = false;
        return;
      }
      const double slack = bound * std::sqrt(sq);
      double low = -std::numeric_limits<double>::infinity();
      for (int64_t v = 0; v < N; ++v) {
        if (!std::isfinite(a[v])) {
          finite = false;
          return;
        }
        low = std::max(low, a[v] - slack * np[v]);
      }
      int64_t best = -1;
      float best_val = 0.0f;
      for (int64_t v = 0; v < N; ++v) {
        if (a[v] + slack * np[v] < low) continue;
        float val = 0.0f;
        exact(xr, wp + v * K, &val, K, 1, K, 0, 0);  // row v's product: the full product's block sequence
        if (!std::isfinite(val)) {  // the exact product overflowed where its bfloat16 copy did not: full logits
          finite = false;
          return;
        }
        if (best < 0 || val > best_val) best = v, best_val = val;
      }
      out[m] = best;
    }
  });
  if (!finite) return {at::Tensor(), false};
  return {ids, true};
}

}  // namespace specserve_small_gemm
