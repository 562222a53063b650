// Products over Q4_1 weights with int8 activations (ModelSpec.int8_reads; docs/benchmarks.md, "AMX-INT8 products over
// the Q4_1 blocks" and "AVX512-VNNI products over the same records"):
//   y[i, n] = sum_g d[n, g] * sx[i, g] * S[i, n, g] + m[n, g] * sx[i, g] * sq[i, g],
//   S[i, n, g] = sum_{k in g} xq[i, k] * q[n, k]   (exact int32),
// the activations rounded per row and group of 32 to int8 (sx = max |x| / 127, xq = round(x / sx), sq = sum xq: the
// Q8_1 of llama.cpp's Q4_1 dot products) and q the 4-bit values 0..15 as unsigned bytes. Two kernels compute S over
// the same records: the AMX tiles (one tdpbsud per group of 32 k, 16 columns and up to 16 rows) and AVX512-VNNI (one
// vpdpbusd per 4 k, 16 columns and row). S is an exact integer either way and the per-group scaling below runs row by
// row in one order with the same operations, so the two kernels give the same bits, and a verify of k rows gives
// each row the bits it gets decoded alone. The int8 products cost a quarter of float32 FMAs per row (VNNI) or about
// nothing per extra row up to 16 (a tile); the kernel's float32 FMAs cost in proportion to the rows.
#include "int8_q4.h"

#include <ATen/Parallel.h>

#include <algorithm>
#include <cstring>
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
  return Packed{out, N, K};
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

// One row's group of 32: q = round-to-nearest-even(v * (127 / amax)) as int8; returns sx = amax / 127 and sets
// *sxq = sx * sum(q).
__attribute__((target("avx512f,avx512bw,avx512vl"))) inline float quantise_group(const float* v, int8_t* q,
                                                                                float* sxq) {
  const __m512 a = _mm512_loadu_ps(v), b = _mm512_loadu_ps(v + 16);
  const float amax = _mm512_reduce_max_ps(_mm512_max_ps(_mm512_abs_ps(a), _mm512_abs_ps(b)));
  const float sx = amax / 127.f;
  const __m512 inv = _mm512_set1_ps(amax > 0.f ? 127.f / amax : 0.f);
  const __m512i qa = _mm512_cvtps_epi32(_mm512_mul_ps(a, inv)), qb = _mm512_cvtps_epi32(_mm512_mul_ps(b, inv));
  _mm_storeu_si128(reinterpret_cast<__m128i*>(q), _mm512_cvtsepi32_epi8(qa));
  _mm_storeu_si128(reinterpret_cast<__m128i*>(q + 16), _mm512_cvtsepi32_epi8(qb));
  *sxq = sx * static_cast<float>(_mm512_reduce_add_epi32(_mm512_add_epi32(qa, qb)));
  return sx;
}

struct Args {
  int64_t M, K, N;
  const uint8_t* w;
  const uint8_t* w_end;
  const int8_t* xq;    // [M, K]
  const float* sx;     // [M, G]
  const float* sxq;    // [M, G]
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

// Rows [r0, r0 + R) of columns [16 nb, 16 nb + 16) with AVX512-VNNI: per group, the record's 32 x 16 nibbles as the
// eight vectors of 16 columns x 4 k that the AMX kernel loads as B tile rows, one vpdpbusd per row and 4 k into an
// exact int32 sum, scaled into the float32 sums as the AMX kernel scales its C tiles.
template <int R>
__attribute__((target("avx512f,avx512bw,avx512vnni"))) void vnni_block(const Args& a, int64_t nb, int64_t r0) {
  const int64_t G = a.K / kG;
  const uint8_t* rec = a.w + (nb / kColGroup) * G * kColGroup * kRec + (nb % kColGroup) * kRec;
  const __m512i low = _mm512_set1_epi8(15);
  __m512 acc[R];
#pragma GCC unroll 8
  for (int i = 0; i < R; ++i) acc[i] = _mm512_setzero_ps();
  for (int64_t g = 0; g < G; ++g, rec += kColGroup * kRec) {
    __m512i b[8];
    for (int p = 0; p < 4; ++p) {
      const __m512i v = _mm512_loadu_si512(rec + p * 64);
      b[p] = _mm512_and_si512(v, low);                             // k = 4p .. 4p + 3
      b[4 + p] = _mm512_and_si512(_mm512_srli_epi16(v, 4), low);  // k = 16 + 4p .. 16 + 4p + 3
    }
    const __m512 d = _mm512_loadu_ps(reinterpret_cast<const float*>(rec + 256));
    const __m512 m = _mm512_loadu_ps(reinterpret_cast<const float*>(rec + 320));
#pragma GCC unroll 8
    for (int i = 0; i < R; ++i) {  // unrolled: the R sums stay in registers
      const int8_t* xq = a.xq + (r0 + i) * a.K + g * kG;
      __m512i sum = _mm512_setzero_si512();
#pragma GCC unroll 8
      for (int q = 0; q < 8; ++q) {
        int32_t quad;
        std::memcpy(&quad, xq + 4 * q, 4);
        sum = _mm512_dpbusd_epi32(sum, b[q], _mm512_set1_epi32(quad));
      }
      const int64_t s = (r0 + i) * G + g;
      acc[i] = _mm512_fmadd_ps(_mm512_cvtepi32_ps(sum), _mm512_mul_ps(d, _mm512_set1_ps(a.sx[s])), acc[i]);
      acc[i] = _mm512_fmadd_ps(m, _mm512_set1_ps(a.sxq[s]), acc[i]);
    }
  }
#pragma GCC unroll 8
  for (int i = 0; i < R; ++i) _mm512_storeu_ps(a.y + (r0 + i) * a.N + nb * kCols, acc[i]);
}

// Rows [r0, r0 + R) of columns [64 cg, 64 cg + 64) with AVX512-VNNI, the records read in their order (per group, the
// four blocks of 16 columns): the same sums as vnni_block, for few rows, whose reads of one block's records alone
// stride past the other three's and ran at a third of the read bandwidth.
template <int R>
__attribute__((target("avx512f,avx512bw,avx512vnni"))) void vnni_group(const Args& a, int64_t cg, int64_t r0) {
  const int64_t G = a.K / kG;
  const uint8_t* rec = a.w + cg * G * kColGroup * kRec;
  const __m512i low = _mm512_set1_epi8(15);
  __m512 acc[kColGroup][R];
#pragma GCC unroll 16
  for (int t = 0; t < kColGroup * R; ++t) acc[t / R][t % R] = _mm512_setzero_ps();
  for (int64_t g = 0; g < G; ++g) {
#pragma GCC unroll 4
    for (int t = 0; t < kColGroup; ++t, rec += kRec) {
      __m512i b[8];
#pragma GCC unroll 4
      for (int p = 0; p < 4; ++p) {
        const __m512i v = _mm512_loadu_si512(rec + p * 64);
        b[p] = _mm512_and_si512(v, low);
        b[4 + p] = _mm512_and_si512(_mm512_srli_epi16(v, 4), low);
      }
      const __m512 d = _mm512_loadu_ps(reinterpret_cast<const float*>(rec + 256));
      const __m512 m = _mm512_loadu_ps(reinterpret_cast<const float*>(rec + 320));
#pragma GCC unroll 8
      for (int i = 0; i < R; ++i) {
        const int8_t* xq = a.xq + (r0 + i) * a.K + g * kG;
        __m512i sum = _mm512_setzero_si512();
#pragma GCC unroll 8
        for (int q = 0; q < 8; ++q) {
          int32_t quad;
          std::memcpy(&quad, xq + 4 * q, 4);
          sum = _mm512_dpbusd_epi32(sum, b[q], _mm512_set1_epi32(quad));
        }
        const int64_t s = (r0 + i) * G + g;
        acc[t][i] = _mm512_fmadd_ps(_mm512_cvtepi32_ps(sum), _mm512_mul_ps(d, _mm512_set1_ps(a.sx[s])), acc[t][i]);
        acc[t][i] = _mm512_fmadd_ps(m, _mm512_set1_ps(a.sxq[s]), acc[t][i]);
      }
    }
  }
#pragma GCC unroll 16
  for (int t = 0; t < kColGroup * R; ++t) {
    _mm512_storeu_ps(a.y + (r0 + t % R) * a.N + (cg * kColGroup + t / R) * kCols, acc[t / R][t % R]);
  }
}

constexpr int64_t kVnniRows = 8;  // rows a VNNI block keeps in registers; more rows re-read its records from L1
// Products of at most this many rows read the records in their order (vnni_group), more rows a block at a time
// (vnni_blocks): on a Zen 4 EPYC SmolLM2's 120 decoder products took 2.1 / 3.4 / 5.2 ms at 1 / 4 / 8 rows read in
// order against 3.9 / 4.8 / 5.1 a block at a time, and 5.9 ms at 8 rows in order four rows at a time.
constexpr int64_t kVnniGroupRows = 4;

// Column blocks of 16 [c0, c1), every row, kVnniRows rows at a time.
__attribute__((target("avx512f,avx512bw,avx512vnni"))) void vnni_blocks(const Args& a, int64_t c0, int64_t c1) {
  for (int64_t nb = c0; nb < c1; ++nb) {
    for (int64_t r0 = 0; r0 < a.M; r0 += kVnniRows) {
      switch (std::min(kVnniRows, a.M - r0)) {
        case 1: vnni_block<1>(a, nb, r0); break;
        case 2: vnni_block<2>(a, nb, r0); break;
        case 3: vnni_block<3>(a, nb, r0); break;
        case 4: vnni_block<4>(a, nb, r0); break;
        case 5: vnni_block<5>(a, nb, r0); break;
        case 6: vnni_block<6>(a, nb, r0); break;
        case 7: vnni_block<7>(a, nb, r0); break;
        default: vnni_block<8>(a, nb, r0); break;
      }
    }
  }
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
  return found;
}

}  // namespace

const std::vector<std::string>& kernels() {
  static const std::vector<std::string> found = detect();
  return found;
}

at::Tensor linear(const at::Tensor& x, const Packed& w, const std::optional<at::Tensor>& bias,
                  const std::optional<std::string>& kernel) {
  const std::vector<std::string>& here = kernels();
  TORCH_CHECK(!here.empty(), "int8 linear: this CPU or process has neither AMX-INT8 tiles nor AVX512-VNNI");
  const std::string name = kernel.value_or(here.front());
  if (std::find(here.begin(), here.end(), name) == here.end()) {
    std::string known;
    for (const std::string& k : here) known += (known.empty() ? "" : ", ") + k;
    TORCH_CHECK(false, "int8 linear: kernel '", name, "' is not available here (this CPU and process run: ", known, ")");
  }
  TORCH_CHECK(x.dim() == 2 && x.scalar_type() == at::kFloat && x.size(1) == w.k,
              "int8 linear: x must be [M, ", w.k, "] float32");
  TORCH_CHECK(w.data.scalar_type() == at::kByte && w.data.numel() == w.n / kCols * (w.k / kG) * kRec,
              "int8 linear: w is not a pack_q4 record set");
  const at::Tensor xc = x.contiguous();
  const int64_t M = xc.size(0), K = w.k, N = w.n, G = K / kG;
  at::Tensor y = at::empty({M, N}, x.options());
  if (M == 0) return y;
  at::Tensor xq = at::empty({M, K}, x.options().dtype(at::kChar));
  at::Tensor scales = at::empty({2, M, G}, x.options());
  const float* xp = xc.data_ptr<float>();
  int8_t* qp = xq.data_ptr<int8_t>();
  float* sx = scales.data_ptr<float>();
  float* sxq = sx + M * G;
  for (int64_t i = 0; i < M; ++i) {
    for (int64_t g = 0; g < G; ++g) {
      sx[i * G + g] = quantise_group(xp + i * K + g * kG, qp + i * K + g * kG, sxq + i * G + g);
    }
  }
  const uint8_t* wp = w.data.data_ptr<uint8_t>();
  const Args a{M, K, N, wp, wp + w.data.numel(), qp, sx, sxq, y.data_ptr<float>()};
  if (name == "amx") {
    at::parallel_for(0, N / (kCols * kColGroup), 1, [&](int64_t c0, int64_t c1) { column_groups(a, c0, c1); });
  } else if (M <= kVnniGroupRows) {
    at::parallel_for(0, N / (kCols * kColGroup), 1, [&](int64_t c0, int64_t c1) {
      for (int64_t cg = c0; cg < c1; ++cg) {
        switch (M) {
          case 1: vnni_group<1>(a, cg, 0); break;
          case 2: vnni_group<2>(a, cg, 0); break;
          case 3: vnni_group<3>(a, cg, 0); break;
          default: vnni_group<4>(a, cg, 0); break;
        }
      }
    });
  } else {
    at::parallel_for(0, N / kCols, 1, [&](int64_t c0, int64_t c1) { vnni_blocks(a, c0, c1); });
  }
  if (bias.has_value()) y.add_(*bias);
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

#endif

}  // namespace specserve_int8
