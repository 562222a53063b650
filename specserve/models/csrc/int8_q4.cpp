// Products over Q4_1 weights with int8 activations (ModelSpec.int8_reads; docs/benchmarks.md, "AMX-INT8 products over
// the Q4_1 blocks" and "AVX512-VNNI products over the same records"):
//   y[i, n] = sum_g d[n, g] * sx[i, g] * S[i, n, g] + m[n, g] * sx[i, g] * sq[i, g],
//   S[i, n, g] = sum_{k in g} xq[i, k] * q[n, k]   (exact int32),
// the activations rounded per row and group of 32 to int8 (sx = max |x| / 127, xq = round(x / sx), sq = sum xq: the
// Q8_1 of llama.cpp's Q4_1 dot products) and q the 4-bit values 0..15 as unsigned bytes. Three kernels compute S over
// the same records: the AMX tiles (one tdpbsud per group of 32 k, 16 columns and up to 16 rows), AVX512-VNNI (one
// vpdpbusd per 4 k, 16 columns and row) and AVX2 (vpmaddubsw into exact int16 pair sums, 8 columns and row). S is an
// exact integer on each and the per-group scaling below runs row by row in one order with the same operations, so
// the kernels give the same bits, and a verify of k rows gives each row the bits it gets decoded alone. The int8
// products cost a quarter of the float32 FMAs' instructions per row (VNNI), about half (AVX2 over Q4_1; about as many
// over Q8_0, whose values it splits in two) or about nothing per extra row up to 16 (a tile); the kernel's float32
// FMAs cost in proportion to the rows.
#include "int8_q4.h"

#include <ATen/Parallel.h>

#include <algorithm>
#include <cstring>
#include <limits>
#include <string>
#include <vector>

#if defined(__x86_64__) && (defined(__clang__) ? __clang_major__ >= 12 : __GNUC__ >= 11)
#define SPECSERVE_X86_INT8 1
#include <cpuid.h>
#include <immintrin.h>
#include <sys/syscall.h>
#include <unistd.h>
#else
#define SPECSERVE_X86_INT8 0
#endif

namespace specserve_int8 {

using specserve_small_gemm::Packed;

namespace {
constexpr int64_t kG = 32;           // a Q4_1 group of k
constexpr int64_t kCols = 16;        // a tile's columns
constexpr int64_t kRec = 256 + 128;  // 16 columns x one group: 256 nibble bytes, then d[16] and m[16] float32
constexpr int64_t kRec8 = 512 + 64;  // a Q8_0 record (pack_q8): 512 bytes of q + 128, then d[16] float32
constexpr int64_t kTileRows = 16;    // activation rows per tile product
constexpr int64_t kColGroup = 4;     // column blocks of 16 per pass (four C tiles share one A tile)
constexpr int64_t kAhead = 6144;     // bytes of records prefetched ahead (measured: docs/benchmarks.md)
}  // namespace

Packed pack_q4(const at::Tensor& q, const at::Tensor& d, const at::Tensor& m) {
  TORCH_CHECK(q.dim() == 2 && q.scalar_type() == at::kByte, "int8 pack_q4: q must be [N, K] uint8");
  const int64_t N = q.size(0), K = q.size(1), G = K / kG;
  TORCH_CHECK(N % (kCols * kColGroup) == 0 && K % kG == 0 && K > 0, "int8 pack_q4: N must be a multiple of 64 and K of 32, got [",
              N, ", ", K, "]");
  for (const at::Tensor* t : {&d, &m}) {
    TORCH_CHECK(t->dim() == 2 && t->size(0) == N && t->size(1) == G && t->scalar_type() == at::kFloat,
                "int8 pack_q4: d and m must be [N, K / 32] float32");
  }
  const at::Tensor qc = q.contiguous(), dc = d.contiguous(), mc = m.contiguous();
  at::Tensor out = at::zeros({N / kCols * G * kRec}, at::kByte);
  uint8_t* o = out.data_ptr<uint8_t>();
  const uint8_t* qp = qc.data_ptr<uint8_t>();
  const float* dp = dc.data_ptr<float>();
  const float* mp = mc.data_ptr<float>();
  // Records in the order the kernel reads them: per 64 columns, per group, its four blocks of 16 columns. B tile row
  // p (0..7), byte 4j + r is column j's k = 4p + r; record byte p * 64 + 4j + r holds k = 4p + r (B rows 0-3) in its
  // low nibble and k = 16 + 4p + r (B rows 4-7) in its high one.
  for (int64_t cg = 0; cg < N / (kCols * kColGroup); ++cg) {
    for (int64_t g = 0; g < G; ++g) {
      for (int64_t nb = cg * kColGroup; nb < (cg + 1) * kColGroup; ++nb, o += kRec) {
        for (int64_t p = 0; p < 4; ++p) {
          for (int64_t j = 0; j < kCols; ++j) {
            for (int64_t r = 0; r < 4; ++r) {
              const int64_t at = (nb * kCols + j) * K + g * kG + 4 * p + r;
              TORCH_CHECK(qp[at] < 16 && qp[at + 16] < 16, "int8 pack_q4: q holds a value past 15");
              o[p * 64 + 4 * j + r] = static_cast<uint8_t>(qp[at] | (qp[at + 16] << 4));
            }
          }
        }
        for (int64_t j = 0; j < kCols; ++j) {
          std::memcpy(o + 256 + 4 * j, dp + (nb * kCols + j) * G + g, 4);
          std::memcpy(o + 320 + 4 * j, mp + (nb * kCols + j) * G + g, 4);
        }
      }
    }
  }
  return Packed{out, N, K, specserve_small_gemm::Reader::int8};
}

Packed pack_q8(const at::Tensor& q, const at::Tensor& d) {
  TORCH_CHECK(q.dim() == 2 && q.scalar_type() == at::kChar, "int8 pack_q8: q must be [N, K] int8");
  const int64_t N = q.size(0), K = q.size(1), G = K / kG;
  TORCH_CHECK(N % (kCols * kColGroup) == 0 && K % kG == 0 && K > 0,
              "int8 pack_q8: N must be a multiple of 64 and K of 32, got [", N, ", ", K, "]");
  TORCH_CHECK(d.dim() == 2 && d.size(0) == N && d.size(1) == G && d.scalar_type() == at::kFloat,
              "int8 pack_q8: d must be [N, K / 32] float32");
  const at::Tensor qc = q.contiguous(), dc = d.contiguous();
  at::Tensor out = at::empty({N / kCols * G * kRec8}, at::kByte);
  uint8_t* o = out.data_ptr<uint8_t>();
  const int8_t* qp = qc.data_ptr<int8_t>();
  const float* dp = dc.data_ptr<float>();
  // Per 64 columns, per group, its four blocks of 16 columns: byte 64 p + 4 j + r is column j's k = 4 p + r, as
  // q + 128 (an unsigned byte for vpdpbusd; the kernel takes 128 * sum(x) back off), then the blocks' d.
  for (int64_t cg = 0; cg < N / (kCols * kColGroup); ++cg) {
    for (int64_t g = 0; g < G; ++g) {
      for (int64_t nb = cg * kColGroup; nb < (cg + 1) * kColGroup; ++nb, o += kRec8) {
        for (int64_t p = 0; p < 8; ++p) {
          for (int64_t j = 0; j < kCols; ++j) {
            for (int64_t r = 0; r < 4; ++r) {
              o[p * 64 + 4 * j + r] = static_cast<uint8_t>(qp[(nb * kCols + j) * K + g * kG + 4 * p + r] + 128);
            }
          }
        }
        for (int64_t j = 0; j < kCols; ++j) std::memcpy(o + 512 + 4 * j, dp + (nb * kCols + j) * G + g, 4);
      }
    }
  }
  return Packed{out, N, K, specserve_small_gemm::Reader::int8};
}

#if SPECSERVE_X86_INT8
namespace {

struct alignas(64) TileConfig {
  uint8_t palette = 1, start_row = 0, reserved[14] = {};
  uint16_t colsb[16] = {};
  uint8_t rows[16] = {};
};

// tiles 0-3: C (M x 16 int32) of four column blocks; 4: A (M x 32 int8); 5, 6: B (8 rows x 64 bytes: 32 k x 16 columns)
__attribute__((target("amx-tile"))) void configure(int rows) {
  TileConfig c;
  for (int t = 0; t < 4; ++t) {
    c.rows[t] = static_cast<uint8_t>(rows);
    c.colsb[t] = 64;
  }
  c.rows[4] = static_cast<uint8_t>(rows);
  c.colsb[4] = 32;
  c.rows[5] = c.rows[6] = 8;
  c.colsb[5] = c.colsb[6] = 64;
  _tile_loadconfig(&c);
}

// A record's 256 nibble bytes as one B tile of 512 unsigned bytes (the low nibbles rows 0-3, the high rows 4-7).
__attribute__((target("avx512f,avx512bw"))) inline void expand(const uint8_t* rec, __m512i* b) {
  const __m512i low = _mm512_set1_epi8(15);
  for (int p = 0; p < 4; ++p) {
    const __m512i v = _mm512_loadu_si512(rec + p * 64);
    _mm512_store_si512(b + p, _mm512_and_si512(v, low));
    _mm512_store_si512(b + 4 + p, _mm512_and_si512(_mm512_srli_epi16(v, 4), low));
  }
}

// 127 / amax, or 0 where that is not finite (amax 0, or below 127 / FLT_MAX: a group of such tiny values rounds to
// all zeros, on every kernel alike; an infinite scale would turn every value into the conversion's INT_MIN).
inline float int8_inverse(float amax) {
  const float inv = 127.f / amax;
  return amax > 0.f && inv <= std::numeric_limits<float>::max() ? inv : 0.f;
}

// One row's group of 32: q = round-to-nearest-even(v * (127 / amax)) as int8; returns sx = amax / 127 and sets
// *sq = sum(q) and *sxq = sx * sum(q). A group holding a NaN or an infinity gets q = 0 and sx = sxq = NaN, so that
// its row's products are NaN as the float32 products' are (a greedy row without a finite maximum is then refused,
// sampling.greedy_draw) and no integer overflows.
__attribute__((target("avx512f,avx512bw,avx512vl"))) inline float quantise_group(const float* v, int8_t* q,
                                                                                int32_t* sq, float* sxq) {
  const __m512 a = _mm512_loadu_ps(v), b = _mm512_loadu_ps(v + 16);
  const __m512 inf = _mm512_set1_ps(std::numeric_limits<float>::infinity());
  const __m512 aa = _mm512_abs_ps(a), ab = _mm512_abs_ps(b);
  // not (|x| < inf): a NaN (unordered) or an infinity
  if ((_mm512_cmp_ps_mask(aa, inf, _CMP_NLT_UQ) | _mm512_cmp_ps_mask(ab, inf, _CMP_NLT_UQ)) != 0) {
    std::memset(q, 0, kG);
    *sq = 0;
    *sxq = std::numeric_limits<float>::quiet_NaN();
    return std::numeric_limits<float>::quiet_NaN();
  }
  const float amax = _mm512_reduce_max_ps(_mm512_max_ps(aa, ab));
  const float sx = amax / 127.f;
  const __m512 inv = _mm512_set1_ps(int8_inverse(amax));
  const __m512i qa = _mm512_cvtps_epi32(_mm512_mul_ps(a, inv)), qb = _mm512_cvtps_epi32(_mm512_mul_ps(b, inv));
  _mm_storeu_si128(reinterpret_cast<__m128i*>(q), _mm512_cvtsepi32_epi8(qa));
  _mm_storeu_si128(reinterpret_cast<__m128i*>(q + 16), _mm512_cvtsepi32_epi8(qb));
  *sq = _mm512_reduce_add_epi32(_mm512_add_epi32(qa, qb));  // |v * inv| <= 127: q is qa, qb unsaturated
  *sxq = sx * static_cast<float>(*sq);
  return sx;
}

// quantise_group on 8 lanes (a CPU without AVX-512): the same operations, so the same q, sx, sq and sxq bits.
__attribute__((target("avx2,fma"))) inline float quantise_group_avx2(const float* v, int8_t* q, int32_t* sq,
                                                                    float* sxq) {
  const __m256 sign = _mm256_set1_ps(-0.f), inf = _mm256_set1_ps(std::numeric_limits<float>::infinity());
  __m256 x[4], amax = _mm256_setzero_ps();
  int bad = 0;
  for (int j = 0; j < 4; ++j) {
    x[j] = _mm256_loadu_ps(v + 8 * j);
    const __m256 ax = _mm256_andnot_ps(sign, x[j]);
    bad |= _mm256_movemask_ps(_mm256_cmp_ps(ax, inf, _CMP_NLT_UQ));  // a NaN (unordered) or an infinity
    amax = _mm256_max_ps(amax, ax);
  }
  if (bad != 0) {
    std::memset(q, 0, kG);
    *sq = 0;
    *sxq = std::numeric_limits<float>::quiet_NaN();
    return std::numeric_limits<float>::quiet_NaN();
  }
  alignas(32) float lanes[8];
  _mm256_store_ps(lanes, amax);
  const float m = *std::max_element(lanes, lanes + 8);
  const float sx = m / 127.f;
  const __m256 inv = _mm256_set1_ps(int8_inverse(m));
  __m256i total = _mm256_setzero_si256();
  alignas(32) int32_t qi[kG];
  for (int j = 0; j < 4; ++j) {
    const __m256i r = _mm256_cvtps_epi32(_mm256_mul_ps(x[j], inv));  // |r| <= 127: as quantise_group
    _mm256_store_si256(reinterpret_cast<__m256i*>(qi + 8 * j), r);
    total = _mm256_add_epi32(total, r);
  }
  for (int64_t k = 0; k < kG; ++k) q[k] = static_cast<int8_t>(qi[k]);
  alignas(32) int32_t t[8];
  _mm256_store_si256(reinterpret_cast<__m256i*>(t), total);
  *sq = t[0] + t[1] + t[2] + t[3] + t[4] + t[5] + t[6] + t[7];
  *sxq = sx * static_cast<float>(*sq);
  return sx;
}

struct Args {
  int64_t M, K, N;
  const uint8_t* w;
  const uint8_t* w_end;
  const int8_t* xq;    // [M, K]
  const float* sx;     // [M, G]
  const float* sxq;    // [M, G]
  const int32_t* sq;   // [M, G]
  float* y;            // [M, N]
};

// Columns [64 cb, 64 cb + 64) of rows [r0, r0 + rows): per group, four tile products into C tiles, stored and scaled
// into float32 sums row by row (the next group's B tiles expanded while this group's are multiplied).
__attribute__((target("amx-tile,amx-int8,avx512f,avx512bw"))) void column_group(const Args& a, int64_t cb,
                                                                               int64_t r0, int64_t rows) {
  const int64_t G = a.K / kG;
  alignas(64) __m512i bt[2][kColGroup][8];
  alignas(64) int32_t c[kColGroup][kTileRows][kCols];
  alignas(64) float acc[kTileRows][kCols * kColGroup];
  std::memset(acc, 0, sizeof(acc[0]) * rows);
  const uint8_t* rec = a.w + cb * kColGroup * G * kRec;
  for (int64_t j = 0; j < kColGroup; ++j) expand(rec + j * kRec, bt[0][j]);
  for (int64_t g = 0; g < G; ++g) {
    const uint8_t* here = rec + g * kColGroup * kRec;
    if (a.w_end - here > kAhead + kColGroup * kRec) {
      for (int64_t o = 0; o < kColGroup * kRec; o += 64) {
        _mm_prefetch(reinterpret_cast<const char*>(here + kAhead + o), _MM_HINT_T0);
      }
    }
    _tile_zero(0);
    _tile_zero(1);
    _tile_zero(2);
    _tile_zero(3);
    _tile_loadd(4, a.xq + r0 * a.K + g * kG, a.K);
    if (g + 1 < G) {
      for (int64_t j = 0; j < kColGroup; ++j) expand(here + (kColGroup + j) * kRec, bt[(g + 1) & 1][j]);
    }
    __m512i(*b)[8] = bt[g & 1];
    _tile_loadd(5, b[0], 64);
    _tile_dpbsud(0, 4, 5);
    _tile_loadd(6, b[1], 64);
    _tile_dpbsud(1, 4, 6);
    _tile_loadd(5, b[2], 64);
    _tile_dpbsud(2, 4, 5);
    _tile_loadd(6, b[3], 64);
    _tile_dpbsud(3, 4, 6);
    _tile_stored(0, c[0], 64);
    _tile_stored(1, c[1], 64);
    _tile_stored(2, c[2], 64);
    _tile_stored(3, c[3], 64);
    for (int64_t t = 0; t < kColGroup; ++t) {
      const float* dm = reinterpret_cast<const float*>(here + t * kRec + 256);
      const __m512 d = _mm512_loadu_ps(dm), m = _mm512_loadu_ps(dm + kCols);
      for (int64_t i = 0; i < rows; ++i) {
        const int64_t s = (r0 + i) * G + g;
        const __m512 sum = _mm512_cvtepi32_ps(_mm512_load_si512(c[t][i]));
        __m512 v = _mm512_load_ps(acc[i] + kCols * t);
        v = _mm512_fmadd_ps(sum, _mm512_mul_ps(d, _mm512_set1_ps(a.sx[s])), v);
        v = _mm512_fmadd_ps(m, _mm512_set1_ps(a.sxq[s]), v);
        _mm512_store_ps(acc[i] + kCols * t, v);
      }
    }
  }
  for (int64_t i = 0; i < rows; ++i) {
    std::memcpy(a.y + (r0 + i) * a.N + cb * kCols * kColGroup, acc[i], sizeof(float) * kCols * kColGroup);
  }
}

// Column groups [c0, c1), every row: 16 rows a tile product, the weights of a column group read once for all.
__attribute__((target("amx-tile,amx-int8,avx512f,avx512bw"))) void column_groups(const Args& a, int64_t c0,
                                                                                int64_t c1) {
  int configured = 0;
  for (int64_t cb = c0; cb < c1; ++cb) {
    for (int64_t r0 = 0; r0 < a.M; r0 += kTileRows) {
      const int rows = static_cast<int>(std::min(kTileRows, a.M - r0));
      if (rows != configured) {
        configure(rows);
        configured = rows;
      }
      column_group(a, cb, r0, rows);
    }
  }
  _tile_release();
}

// The record layouts the VNNI kernels read, per 16 columns and group of 32 k: Q4_1 (pack_q4: 256 bytes of nibble
// pairs, then d[16] and m[16] float32) and Q8_0 (pack_q8: 512 bytes of q + 128 as unsigned bytes, 64 bytes per 4 k
// with column j's at 4j, then d[16] float32).
enum class Layout { q4_1, q8_0 };
template <Layout L>
constexpr int64_t kRecOf = L == Layout::q4_1 ? kRec : kRec8;

// A record's 32 x 16 values as eight vectors of 16 columns x 4 unsigned bytes, vector q holding k = 4q .. 4q + 3 (the
// B tile rows of the AMX kernel).
template <Layout L>
__attribute__((target("avx512f,avx512bw"))) inline void unsigned_values(const uint8_t* rec, __m512i* b) {
  if constexpr (L == Layout::q4_1) {
    const __m512i low = _mm512_set1_epi8(15);
#pragma GCC unroll 4
    for (int p = 0; p < 4; ++p) {
      const __m512i v = _mm512_loadu_si512(rec + p * 64);
      b[p] = _mm512_and_si512(v, low);                             // k = 4p .. 4p + 3
      b[4 + p] = _mm512_and_si512(_mm512_srli_epi16(v, 4), low);  // k = 16 + 4p .. 16 + 4p + 3
    }
  } else {
#pragma GCC unroll 8
    for (int q = 0; q < 8; ++q) b[q] = _mm512_loadu_si512(rec + q * 64);
  }
}

// Row s = (row, group)'s exact int32 sum over the record (one vpdpbusd per 4 k), scaled into acc: Q4_1 adds
// d sx S + m sx sq as the AMX kernel does; Q8_0 removes the +128 offset in int32 (S - 128 sq), then adds d sx S.
template <Layout L>
__attribute__((target("avx512f,avx512bw,avx512vnni"))) inline __m512 row_group(const Args& a, const __m512i* b,
                                                                               const uint8_t* rec, int64_t row,
                                                                               int64_t g, __m512 acc) {
  const int64_t G = a.K / kG, s = row * G + g;
  const int8_t* xq = a.xq + row * a.K + g * kG;
  __m512i half[2] = {_mm512_setzero_si512(), _mm512_setzero_si512()};  // two chains of vpdpbusd's latency
#pragma GCC unroll 8
  for (int q = 0; q < 8; ++q) {
    int32_t quad;
    std::memcpy(&quad, xq + 4 * q, 4);
    half[q & 1] = _mm512_dpbusd_epi32(half[q & 1], b[q], _mm512_set1_epi32(quad));
  }
  __m512i sum = _mm512_add_epi32(half[0], half[1]);
  const __m512 d = _mm512_loadu_ps(reinterpret_cast<const float*>(rec + (L == Layout::q4_1 ? 256 : 512)));
  if constexpr (L == Layout::q8_0) sum = _mm512_sub_epi32(sum, _mm512_set1_epi32(128 * a.sq[s]));
  acc = _mm512_fmadd_ps(_mm512_cvtepi32_ps(sum), _mm512_mul_ps(d, _mm512_set1_ps(a.sx[s])), acc);
  if constexpr (L == Layout::q4_1) {
    const __m512 m = _mm512_loadu_ps(reinterpret_cast<const float*>(rec + 320));
    acc = _mm512_fmadd_ps(m, _mm512_set1_ps(a.sxq[s]), acc);
  }
  return acc;
}

// Rows [r0, r0 + R) of columns [16 nb, 16 nb + 16): every group's record of this block, R rows a record.
template <Layout L, int R>
__attribute__((target("avx512f,avx512bw,avx512vnni"))) void vnni_block(const Args& a, int64_t nb, int64_t r0) {
  const int64_t G = a.K / kG;
  const uint8_t* rec = a.w + (nb / kColGroup) * G * kColGroup * kRecOf<L> + (nb % kColGroup) * kRecOf<L>;
  __m512 acc[R];
#pragma GCC unroll 8
  for (int i = 0; i < R; ++i) acc[i] = _mm512_setzero_ps();
  for (int64_t g = 0; g < G; ++g, rec += kColGroup * kRecOf<L>) {
    __m512i b[8];
    unsigned_values<L>(rec, b);
#pragma GCC unroll 8
    for (int i = 0; i < R; ++i) acc[i] = row_group<L>(a, b, rec, r0 + i, g, acc[i]);  // unrolled: sums in registers
  }
#pragma GCC unroll 8
  for (int i = 0; i < R; ++i) _mm512_storeu_ps(a.y + (r0 + i) * a.N + nb * kCols, acc[i]);
}

// Rows [r0, r0 + R) of columns [64 cg, 64 cg + 64), the records read in their order (per group, the four blocks of
// 16 columns): the same sums as vnni_block, for few rows, whose reads of one block's records alone stride past the
// other three's and ran at a third of the read bandwidth.
template <Layout L, int R>
__attribute__((target("avx512f,avx512bw,avx512vnni"))) void vnni_group(const Args& a, int64_t cg, int64_t r0) {
  const int64_t G = a.K / kG;
  const uint8_t* rec = a.w + cg * G * kColGroup * kRecOf<L>;
  __m512 acc[kColGroup][R];
#pragma GCC unroll 16
  for (int t = 0; t < kColGroup * R; ++t) acc[t / R][t % R] = _mm512_setzero_ps();
  for (int64_t g = 0; g < G; ++g) {
#pragma GCC unroll 4
    for (int t = 0; t < kColGroup; ++t, rec += kRecOf<L>) {
      // The Q8_0 records kAhead bytes on: SmolLM2's LM head at 1 row took 0.42-0.77 ms with it, 0.69-0.94 without
      // (three runs with it, four without, a Zen 4 EPYC); the Q4_1 products measured the same or slower with it.
      if constexpr (L == Layout::q8_0) {
        if (a.w_end - rec > kAhead + kRecOf<L>) {
          for (int64_t o = 0; o < kRecOf<L>; o += 64) {
            _mm_prefetch(reinterpret_cast<const char*>(rec + kAhead + o), _MM_HINT_T0);
          }
        }
      }
      __m512i b[8];
      unsigned_values<L>(rec, b);
#pragma GCC unroll 8
      for (int i = 0; i < R; ++i) acc[t][i] = row_group<L>(a, b, rec, r0 + i, g, acc[t][i]);
    }
  }
#pragma GCC unroll 16
  for (int t = 0; t < kColGroup * R; ++t) {
    _mm512_storeu_ps(a.y + (r0 + t % R) * a.N + (cg * kColGroup + t / R) * kCols, acc[t / R][t % R]);
  }
}

constexpr int64_t kVnniRows = 8;  // rows a VNNI block keeps in registers; more rows re-read its records from L1
constexpr int64_t kGroupRows = 4;  // rows a VNNI column group keeps in registers (16 sums)
// Products of at most this many rows read the records in their order (vnni_group, four rows at a time), more rows a
// block at a time (vnni_block), measured on a Zen 4 EPYC: SmolLM2's 120 decoder products (Q4_1) took 2.1 / 3.4 / 5.2
// ms at 1 / 4 / 8 rows in order against 3.9 / 4.8 / 5.1 a block at a time, and 4.5-5.9 ms at 8 rows in order; its
// LM head (Q8_0, 49152 x 576: a block's records stride 2.3 KB apart) 0.9 / 1.2 / 2.2 ms at 6 / 8 / 16 rows in order
// against 1.3 / 2.0 / 2.6 a block at a time.
template <Layout L>
constexpr int64_t kInOrderRows = L == Layout::q4_1 ? 4 : std::numeric_limits<int64_t>::max();

// Every row of x against the records, on the two cores: column groups of 64 for at most kInOrderRows<L> rows, else
// column blocks of 16, kVnniRows rows at a time.
template <Layout L>
__attribute__((target("avx512f,avx512bw,avx512vnni"))) void vnni_product(const Args& a) {
  if (a.M <= kInOrderRows<L>) {
    at::parallel_for(0, a.N / (kCols * kColGroup), 1, [&](int64_t c0, int64_t c1) {
      for (int64_t cg = c0; cg < c1; ++cg) {
        for (int64_t r0 = 0; r0 < a.M; r0 += kGroupRows) {
          switch (std::min(kGroupRows, a.M - r0)) {
            case 1: vnni_group<L, 1>(a, cg, r0); break;
            case 2: vnni_group<L, 2>(a, cg, r0); break;
            case 3: vnni_group<L, 3>(a, cg, r0); break;
            default: vnni_group<L, 4>(a, cg, r0); break;
          }
        }
      }
    });
    return;
  }
  at::parallel_for(0, a.N / kCols, 1, [&](int64_t c0, int64_t c1) {
    for (int64_t nb = c0; nb < c1; ++nb) {
      for (int64_t r0 = 0; r0 < a.M; r0 += kVnniRows) {
        switch (std::min(kVnniRows, a.M - r0)) {
          case 1: vnni_block<L, 1>(a, nb, r0); break;
          case 2: vnni_block<L, 2>(a, nb, r0); break;
          case 3: vnni_block<L, 3>(a, nb, r0); break;
          case 4: vnni_block<L, 4>(a, nb, r0); break;
          case 5: vnni_block<L, 5>(a, nb, r0); break;
          case 6: vnni_block<L, 6>(a, nb, r0); break;
          case 7: vnni_block<L, 7>(a, nb, r0); break;
          default: vnni_block<L, 8>(a, nb, r0); break;
        }
      }
    }
  });
}

// AVX2 (and FMA): the same sums over the same records for CPUs without AVX512-VNNI (AMD before Zen 4, Intel client
// and server cores before Ice Lake). vpmaddubsw multiplies unsigned by signed bytes and adds adjacent pairs into
// int16, saturating; for a Q4_1 value (0..15) and an activation (|xq| <= 127) a pair is at most 3810 and a group's
// eight pairs per column 30480 < 32767, so the int16 sums are exact, and vpmaddwd by ones gives each column's exact
// int32 S. A Q8_0 value (q + 128, 0..255) is split into its nibbles (S = 16 S_hi + S_lo), each within the same bound.
// The scaling is the VNNI kernel's operations on 8 lanes instead of 16: the same bits per column.
constexpr int64_t kAvx2Rows = 16;  // rows whose float32 sums (64 columns each) stay in L1 while a record is reused

// Record (16 columns, group of 32 k) as vectors of 8 columns x 4 unsigned bytes: v[h][q] holds columns 8h .. 8h + 7,
// k = 4q .. 4q + 3. Q4_1: the low nibbles of 64-byte chunk p are k = 4p + r, the high ones k = 16 + 4p + r. Q8_0:
// v[0] the low nibbles, v[1] the high ones, of chunk q's half h, at v[h][q] and v[2 + h][q].
template <Layout L>
__attribute__((target("avx2,fma"))) inline void avx2_values(const uint8_t* rec, __m256i (*v)[8]) {
  const __m256i low = _mm256_set1_epi8(15);
  if constexpr (L == Layout::q4_1) {
    for (int p = 0; p < 4; ++p) {
      for (int h = 0; h < 2; ++h) {
        const __m256i x = _mm256_loadu_si256(reinterpret_cast<const __m256i*>(rec + p * 64 + h * 32));
        v[h][p] = _mm256_and_si256(x, low);
        v[h][4 + p] = _mm256_and_si256(_mm256_srli_epi16(x, 4), low);
      }
    }
  } else {
    for (int q = 0; q < 8; ++q) {
      for (int h = 0; h < 2; ++h) {
        const __m256i x = _mm256_loadu_si256(reinterpret_cast<const __m256i*>(rec + q * 64 + h * 32));
        v[h][q] = _mm256_and_si256(x, low);
        v[2 + h][q] = _mm256_and_si256(_mm256_srli_epi16(x, 4), low);
      }
    }
  }
}

// Eight int16 pair sums per column over the group's 32 k: sum_q maddubs(v[q], xq[4q .. 4q + 3]) (exact, see above).
__attribute__((target("avx2,fma"))) inline __m256i avx2_pairs(const __m256i* v, const __m256i* x4) {
  __m256i s = _mm256_maddubs_epi16(v[0], x4[0]);
  for (int q = 1; q < 8; ++q) s = _mm256_add_epi16(s, _mm256_maddubs_epi16(v[q], x4[q]));
  return s;
}

// Blocks [t0, t1) of column group cg (16 columns each), rows [r0, r0 + rows): each record expanded once for all rows.
template <Layout L>
__attribute__((target("avx2,fma"))) void avx2_blocks(const Args& a, int64_t cg, int64_t t0, int64_t t1, int64_t r0,
                                                     int64_t rows) {
  const int64_t G = a.K / kG;
  alignas(32) float acc[kAvx2Rows][kCols * kColGroup];
  for (int64_t i = 0; i < rows; ++i) std::memset(acc[i] + t0 * kCols, 0, sizeof(float) * kCols * (t1 - t0));
  const __m256i ones16 = _mm256_set1_epi16(1), sixteen16 = _mm256_set1_epi16(16);
  const uint8_t* rec = a.w + cg * G * kColGroup * kRecOf<L>;
  for (int64_t g = 0; g < G; ++g, rec += kColGroup * kRecOf<L>) {
    for (int64_t t = t0; t < t1; ++t) {
      const uint8_t* here = rec + t * kRecOf<L>;
      if constexpr (L == Layout::q8_0) {  // as vnni_group; its measurements on this kernel were too noisy to tell
        if (a.w_end - here > kAhead + kRecOf<L>) {
          for (int64_t o = 0; o < kRecOf<L>; o += 64) {
            _mm_prefetch(reinterpret_cast<const char*>(here + kAhead + o), _MM_HINT_T0);
          }
        }
      }
      __m256i v[L == Layout::q4_1 ? 2 : 4][8];
      avx2_values<L>(here, v);
      const float* dp = reinterpret_cast<const float*>(here + (L == Layout::q4_1 ? 256 : 512));
      for (int64_t i = 0; i < rows; ++i) {
        const int64_t row = r0 + i, s = row * G + g;
        const int8_t* xq = a.xq + row * a.K + g * kG;
        __m256i x4[8];
        for (int q = 0; q < 8; ++q) {
          int32_t quad;
          std::memcpy(&quad, xq + 4 * q, 4);
          x4[q] = _mm256_set1_epi32(quad);
        }
        const __m256 sx = _mm256_set1_ps(a.sx[s]);
        for (int h = 0; h < 2; ++h) {
          __m256i sum = _mm256_madd_epi16(avx2_pairs(v[h], x4), ones16);
          if constexpr (L == Layout::q8_0) {
            sum = _mm256_add_epi32(sum, _mm256_madd_epi16(avx2_pairs(v[2 + h], x4), sixteen16));
            sum = _mm256_sub_epi32(sum, _mm256_set1_epi32(128 * a.sq[s]));
          }
          float* out = acc[i] + t * kCols + h * 8;
          __m256 y = _mm256_load_ps(out);
          y = _mm256_fmadd_ps(_mm256_cvtepi32_ps(sum), _mm256_mul_ps(_mm256_loadu_ps(dp + h * 8), sx), y);
          if constexpr (L == Layout::q4_1) {
            y = _mm256_fmadd_ps(_mm256_loadu_ps(dp + kCols + h * 8), _mm256_set1_ps(a.sxq[s]), y);
          }
          _mm256_store_ps(out, y);
        }
      }
    }
  }
  for (int64_t i = 0; i < rows; ++i) {
    std::memcpy(a.y + (r0 + i) * a.N + (cg * kColGroup + t0) * kCols, acc[i] + t0 * kCols,
                sizeof(float) * kCols * (t1 - t0));
  }
}

// Every row of x against the records, on the two cores: the blocks of 16 columns split between the threads in
// record order (a thread's blocks of one column group read together, group by group), kAvx2Rows rows at a time.
template <Layout L>
void avx2_product(const Args& a) {
  at::parallel_for(0, a.N / kCols, 1, [&](int64_t b0, int64_t b1) {
    for (int64_t cg = b0 / kColGroup; cg * kColGroup < b1; ++cg) {
      const int64_t t0 = std::max(b0, cg * kColGroup) - cg * kColGroup;
      const int64_t t1 = std::min(b1, (cg + 1) * kColGroup) - cg * kColGroup;
      for (int64_t r0 = 0; r0 < a.M; r0 += kAvx2Rows) avx2_blocks<L>(a, cg, t0, t1, r0, std::min(kAvx2Rows, a.M - r0));
    }
  });
}

bool avx512_base() {
  return __builtin_cpu_supports("avx512f") && __builtin_cpu_supports("avx512bw") && __builtin_cpu_supports("avx512vl");
}

bool detect_amx() {
  unsigned eax = 0, ebx = 0, ecx = 0, edx = 0;
  if (!__get_cpuid_count(7, 0, &eax, &ebx, &ecx, &edx)) return false;
  const bool tiles = (edx >> 24 & 1) && (edx >> 25 & 1);  // AMX-TILE, AMX-INT8
  if (!tiles || !avx512_base()) return false;
  constexpr long kReqPerm = 0x1023;  // ARCH_REQ_XCOMP_PERM
  constexpr long kTileData = 18;     // XFEATURE_XTILEDATA
  return syscall(SYS_arch_prctl, kReqPerm, kTileData) == 0;
}

std::vector<std::string> detect() {
  std::vector<std::string> found;
  if (detect_amx()) found.emplace_back("amx");
  if (avx512_base() && __builtin_cpu_supports("avx512vnni")) found.emplace_back("avx512-vnni");
  if (__builtin_cpu_supports("avx2") && __builtin_cpu_supports("fma")) found.emplace_back("avx2");
  return found;
}

}  // namespace

const std::vector<std::string>& kernels() {
  static const std::vector<std::string> found = detect();
  return found;
}

namespace {

// x [M, K] rounded to int8 per row and group of 32 (quantise_group), and the product's arguments over it.
struct Quantised {
  at::Tensor xq, scales, sums;
  Args args;
};

Quantised quantise(const at::Tensor& x, const Packed& w, at::Tensor& y, bool avx512) {
  const at::Tensor xc = x.contiguous();
  const int64_t M = xc.size(0), K = w.k, G = K / kG;
  Quantised out{at::empty({M, K}, x.options().dtype(at::kChar)), at::empty({2, M, G}, x.options()),
                at::empty({M, G}, x.options().dtype(at::kInt)), {}};
  const float* xp = xc.data_ptr<float>();
  int8_t* qp = out.xq.data_ptr<int8_t>();
  float* sx = out.scales.data_ptr<float>();
  float* sxq = sx + M * G;
  int32_t* sq = out.sums.data_ptr<int32_t>();
  for (int64_t i = 0; i < M; ++i) {
    for (int64_t g = 0; g < G; ++g) {
      const int64_t s = i * G + g;
      const float* v = xp + i * K + g * kG;
      int8_t* q = qp + i * K + g * kG;
      sx[s] = avx512 ? quantise_group(v, q, sq + s, sxq + s) : quantise_group_avx2(v, q, sq + s, sxq + s);
    }
  }
  const uint8_t* wp = w.data.data_ptr<uint8_t>();
  out.args = Args{M, K, w.n, wp, wp + w.data.numel(), qp, sx, sxq, sq, y.data_ptr<float>()};
  return out;
}

void check_x(const at::Tensor& x, const Packed& w, const char* what) {
  TORCH_CHECK(x.dim() == 2 && x.scalar_type() == at::kFloat && x.size(1) == w.k, what, ": x must be [M, ", w.k,
              "] float32");
}

// `kernel` (default: the first of `usable` this CPU runs) checked against the kernels here that run this product.
std::string chosen(const std::optional<std::string>& kernel, const std::vector<std::string>& usable, const char* what) {
  std::vector<std::string> here;
  for (const std::string& k : kernels()) {
    if (std::find(usable.begin(), usable.end(), k) != usable.end()) here.push_back(k);
  }
  TORCH_CHECK(!here.empty(), what, ": this CPU or process runs none of its int8 kernels (AMX-INT8, AVX512-VNNI, AVX2)");
  const std::string name = kernel.value_or(here.front());
  if (std::find(here.begin(), here.end(), name) == here.end()) {
    std::string known;
    for (const std::string& k : here) known += (known.empty() ? "" : ", ") + k;
    TORCH_CHECK(false, what, ": kernel '", name, "' is not available here (this CPU and process run: ", known, ")");
  }
  return name;
}

const std::vector<std::string> kQ4Kernels = {"amx", "avx512-vnni", "avx2"};
const std::vector<std::string> kQ8Kernels = {"avx512-vnni", "avx2"};

}  // namespace

at::Tensor linear(const at::Tensor& x, const Packed& w, const std::optional<at::Tensor>& bias,
                  const std::optional<std::string>& kernel) {
  const std::string name = chosen(kernel, kQ4Kernels, "int8 linear");
  check_x(x, w, "int8 linear");
  TORCH_CHECK(w.reader == specserve_small_gemm::Reader::int8 && w.data.scalar_type() == at::kByte &&
                  w.data.numel() == w.n / kCols * (w.k / kG) * kRec,
              "int8 linear: w is not an int8_pack_q4 record set");
  at::Tensor y = at::empty({x.size(0), w.n}, x.options());
  if (x.size(0) == 0) return y;
  const Quantised q = quantise(x, w, y, name != "avx2");
  if (name == "amx") {
    at::parallel_for(0, w.n / (kCols * kColGroup), 1, [&](int64_t c0, int64_t c1) { column_groups(q.args, c0, c1); });
  } else if (name == "avx512-vnni") {
    vnni_product<Layout::q4_1>(q.args);
  } else {
    avx2_product<Layout::q4_1>(q.args);
  }
  specserve_small_gemm::add_bias(y, bias);
  return y;
}

bool q8_supported() {
  for (const std::string& k : kernels()) {
    if (std::find(kQ8Kernels.begin(), kQ8Kernels.end(), k) != kQ8Kernels.end()) return true;
  }
  return false;
}

at::Tensor linear_q8(const at::Tensor& x, const Packed& w, const std::optional<at::Tensor>& bias,
                     const std::optional<std::string>& kernel) {
  const std::string name = chosen(kernel, kQ8Kernels, "int8 linear_q8");
  check_x(x, w, "int8 linear_q8");
  TORCH_CHECK(w.reader == specserve_small_gemm::Reader::int8 && w.data.scalar_type() == at::kByte &&
                  w.data.numel() == w.n / kCols * (w.k / kG) * kRecOf<Layout::q8_0>,
              "int8 linear_q8: w is not an int8_pack_q8 record set");
  at::Tensor y = at::empty({x.size(0), w.n}, x.options());
  if (x.size(0) == 0) return y;
  const Quantised q = quantise(x, w, y, name != "avx2");
  if (name == "avx512-vnni") {
    vnni_product<Layout::q8_0>(q.args);
  } else {
    avx2_product<Layout::q8_0>(q.args);
  }
  specserve_small_gemm::add_bias(y, bias);
  return y;
}

#else

const std::vector<std::string>& kernels() {
  static const std::vector<std::string> none;
  return none;
}

at::Tensor linear(const at::Tensor&, const Packed&, const std::optional<at::Tensor>&, const std::optional<std::string>&) {
  TORCH_CHECK(false, "int8 linear: built without x86 int8 kernels");
}

bool q8_supported() { return false; }

at::Tensor linear_q8(const at::Tensor&, const Packed&, const std::optional<at::Tensor>&, const std::optional<std::string>&) {
  TORCH_CHECK(false, "int8 linear_q8: built without x86 int8 kernels");
}

#endif

}  // namespace specserve_int8
