// A prototype, measured and not part of the product (docs/benchmarks.md, "Issue 12 on the AMX Xeon again"): a
// batch-invariant AMX-BF16 product over Q4_1 weights, y[M, N] = bf16(x)[M, K] @ bf16(d * q + m)[N, K]^T, each row by
// the same tile instructions whatever M is, in three variants: linear (each group's B tiles expanded from the 4-bit
// records into an L1 buffer just before their tile load), linear_pipelined (expanded one group ahead), linear_tiles
// (the B tiles kept expanded in memory, 2 bytes a weight). All three give the same bits. Built with
// torch.utils.cpp_extension.load (g++ 12, -O3 -fopenmp).
#include <torch/extension.h>
#include <ATen/Parallel.h>
#include <immintrin.h>
#include <sys/syscall.h>
#include <unistd.h>
#include <cstring>

namespace {
constexpr int kG = 32;    // a Q4_1 group: one B tile (16 pairs of k x 16 columns)
constexpr int kRec = 256 + 128;  // a group of 16 columns: 256 nibble bytes, then d[16], m[16] (float32)
bool amx_ready() {
  static const bool ok = syscall(SYS_arch_prctl, 0x1023 /* ARCH_REQ_XCOMP_PERM */, 18 /* XTILEDATA */) == 0;
  return ok;
}
struct alignas(64) TileCfg {
  uint8_t palette = 1, start = 0, res[14] = {};
  uint16_t colsb[16] = {};
  uint8_t rows[16] = {};
};
// tiles 0-3: C (M x 16 float32) of four column blocks; 4: A (M x 32 bf16); 5, 6: B (16 x 32 bf16)
__attribute__((target("amx-tile"))) void config(int M) {
  TileCfg c;
  for (int t = 0; t < 5; ++t) { c.rows[t] = M; c.colsb[t] = 64; }
  c.rows[5] = c.rows[6] = 16;
  c.colsb[5] = c.colsb[6] = 64;
  _tile_loadconfig(&c);
}
// Row p of a B tile is (k = 2p, 2p + 1) of columns 0..15: 32 bf16, c0k0 c0k1 c1k0 ... c15k1. Nibble byte i of row p:
// low = element i, high = element 16 + i; so the low nibbles are columns 0-7, the high ones 8-15.
__attribute__((target("avx512f,avx512bw,avx512bf16"))) inline void expand(const uint8_t* rec, __m512i* b) {
  const __m512 d = _mm512_loadu_ps(reinterpret_cast<const float*>(rec + 256));
  const __m512 m = _mm512_loadu_ps(reinterpret_cast<const float*>(rec + 320));
  const __m512i lo_idx = _mm512_setr_epi32(0, 0, 1, 1, 2, 2, 3, 3, 4, 4, 5, 5, 6, 6, 7, 7);
  const __m512i hi_idx = _mm512_add_epi32(lo_idx, _mm512_set1_epi32(8));
  const __m512 dl = _mm512_permutexvar_ps(lo_idx, d), dh = _mm512_permutexvar_ps(hi_idx, d);
  const __m512 ml = _mm512_permutexvar_ps(lo_idx, m), mh = _mm512_permutexvar_ps(hi_idx, m);
  const __m512i f = _mm512_set1_epi32(15);
  for (int p = 0; p < 16; ++p) {
    const __m512i v = _mm512_cvtepu8_epi32(_mm_loadu_si128(reinterpret_cast<const __m128i*>(rec + p * 16)));
    const __m512 lo = _mm512_fmadd_ps(_mm512_cvtepi32_ps(_mm512_and_si512(v, f)), dl, ml);
    const __m512 hi = _mm512_fmadd_ps(_mm512_cvtepi32_ps(_mm512_srli_epi32(v, 4)), dh, mh);
    _mm512_store_si512(b + p, (__m512i)_mm512_cvtne2ps_pbh(hi, lo));
  }
}
}  // namespace

at::Tensor pack(const at::Tensor& q, const at::Tensor& d, const at::Tensor& m) {
  const int64_t N = q.size(0), K = q.size(1), G = K / kG;
  TORCH_CHECK(N % 64 == 0 && K % kG == 0);
  auto out = at::zeros({N / 16 * G * kRec}, at::kByte);
  uint8_t* o = out.data_ptr<uint8_t>();
  const uint8_t* qp = q.data_ptr<uint8_t>();
  const float* dp = d.data_ptr<float>();
  const float* mp = m.data_ptr<float>();
  for (int64_t nb = 0; nb < N / 16; ++nb)
    for (int64_t g = 0; g < G; ++g, o += kRec) {
      for (int p = 0; p < 16; ++p)
        for (int i = 0; i < 16; ++i) {  // element i: column i / 2, k 2p + i % 2; element 16 + i: column 8 + i / 2
          const int64_t k = g * kG + 2 * p + i % 2, n0 = nb * 16 + i / 2;
          o[p * 16 + i] = qp[n0 * K + k] | (qp[(n0 + 8) * K + k] << 4);
        }
      for (int j = 0; j < 16; ++j) {
        std::memcpy(o + 256 + 4 * j, dp + (nb * 16 + j) * G + g, 4);
        std::memcpy(o + 320 + 4 * j, mp + (nb * 16 + j) * G + g, 4);
      }
    }
  return out;
}

// Column blocks of 64 (four C tiles) [c0, c1) of the product.
__attribute__((target("amx-tile,amx-bf16,avx512f,avx512bw,avx512bf16")))
void run_blocks(int64_t c0, int64_t c1, int64_t M, int64_t K, int64_t N, const uint8_t* wp, const char* xp, float* yp) {
  const int64_t G = K / kG;
  config(static_cast<int>(M));
  alignas(64) __m512i bt[2][16];
  alignas(64) float cbuf[16 * 16];
  for (int64_t cb = c0; cb < c1; ++cb) {
    _tile_zero(0); _tile_zero(1); _tile_zero(2); _tile_zero(3);
    const uint8_t* r = wp + cb * 4 * G * kRec;
    for (int64_t g = 0; g < G; ++g) {
      _tile_loadd(4, xp + g * kG * 2, K * 2);
      expand(r + g * kRec, bt[0]);
      _tile_loadd(5, bt[0], 64);
      _tile_dpbf16ps(0, 4, 5);
      expand(r + (G + g) * kRec, bt[1]);
      _tile_loadd(6, bt[1], 64);
      _tile_dpbf16ps(1, 4, 6);
      expand(r + (2 * G + g) * kRec, bt[0]);
      _tile_loadd(5, bt[0], 64);
      _tile_dpbf16ps(2, 4, 5);
      expand(r + (3 * G + g) * kRec, bt[1]);
      _tile_loadd(6, bt[1], 64);
      _tile_dpbf16ps(3, 4, 6);
    }
    float* y = yp + cb * 64;
#define STORE(t) _tile_stored(t, cbuf, 64); for (int64_t i = 0; i < M; ++i) std::memcpy(y + i * N + 16 * t, cbuf + i * 16, 64);
    STORE(0) STORE(1) STORE(2) STORE(3)
  }
  _tile_release();
}

// Column blocks of 64 (four C tiles) [c0, c1) of the product. Software-pipelined: a group's four B tiles are expanded
// into one half of a ring while the previous group's, expanded one group earlier, are loaded and multiplied, so a tile
// load never waits on the stores that just wrote it.
__attribute__((target("amx-tile,amx-bf16,avx512f,avx512bw,avx512bf16")))
void run_blocks_pipelined(int64_t c0, int64_t c1, int64_t M, int64_t K, int64_t N, const uint8_t* wp, const char* xp, float* yp) {
  const int64_t G = K / kG;
  config(static_cast<int>(M));
  alignas(64) __m512i bt[2][4][16];
  alignas(64) float cbuf[16 * 16];
  for (int64_t cb = c0; cb < c1; ++cb) {
    _tile_zero(0); _tile_zero(1); _tile_zero(2); _tile_zero(3);
    const uint8_t* r = wp + cb * 4 * G * kRec;
    for (int j = 0; j < 4; ++j) expand(r + (j * G) * kRec, bt[0][j]);
    for (int64_t g = 0; g < G; ++g) {
      if (g + 1 < G) {
        for (int j = 0; j < 4; ++j) expand(r + (j * G + g + 1) * kRec, bt[(g + 1) & 1][j]);
      }
      __m512i (*b)[16] = bt[g & 1];
      _tile_loadd(4, xp + g * kG * 2, K * 2);
      _tile_loadd(5, b[0], 64);
      _tile_dpbf16ps(0, 4, 5);
      _tile_loadd(6, b[1], 64);
      _tile_dpbf16ps(1, 4, 6);
      _tile_loadd(5, b[2], 64);
      _tile_dpbf16ps(2, 4, 5);
      _tile_loadd(6, b[3], 64);
      _tile_dpbf16ps(3, 4, 6);
    }
    float* y = yp + cb * 64;
#define STORE_P(t) _tile_stored(t, cbuf, 64); for (int64_t i = 0; i < M; ++i) std::memcpy(y + i * N + 16 * t, cbuf + i * 16, 64);
    STORE_P(0) STORE_P(1) STORE_P(2) STORE_P(3)
  }
  _tile_release();
}

// Variant: the B tiles kept expanded in memory (2 bytes a weight), loaded straight from the stream.
at::Tensor pack_tiles(const at::Tensor& packed, int64_t N, int64_t K) {
  const int64_t G = K / kG;
  auto out = at::empty({N / 16 * G * 1024}, at::kByte);
  const uint8_t* r = packed.data_ptr<uint8_t>();
  auto* o = reinterpret_cast<__m512i*>(out.data_ptr<uint8_t>());
  for (int64_t t = 0; t < N / 16 * G; ++t) expand(r + t * kRec, o + t * 16);
  return out;
}

__attribute__((target("amx-tile,amx-bf16,avx512f,avx512bw,avx512bf16")))
void run_tiles(int64_t c0, int64_t c1, int64_t M, int64_t K, int64_t N, const uint8_t* wp, const char* xp, float* yp) {
  const int64_t G = K / kG;
  config(static_cast<int>(M));
  alignas(64) float cbuf[16 * 16];
  for (int64_t cb = c0; cb < c1; ++cb) {
    _tile_zero(0); _tile_zero(1); _tile_zero(2); _tile_zero(3);
    const uint8_t* r = wp + cb * 4 * G * 1024;
    for (int64_t g = 0; g < G; ++g) {
      _tile_loadd(4, xp + g * kG * 2, K * 2);
      _tile_loadd(5, r + (0 * G + g) * 1024, 64);
      _tile_dpbf16ps(0, 4, 5);
      _tile_loadd(6, r + (1 * G + g) * 1024, 64);
      _tile_dpbf16ps(1, 4, 6);
      _tile_loadd(5, r + (2 * G + g) * 1024, 64);
      _tile_dpbf16ps(2, 4, 5);
      _tile_loadd(6, r + (3 * G + g) * 1024, 64);
      _tile_dpbf16ps(3, 4, 6);
    }
    float* y = yp + cb * 64;
    STORE(0) STORE(1) STORE(2) STORE(3)
  }
  _tile_release();
}

using BlocksFn = void (*)(int64_t, int64_t, int64_t, int64_t, int64_t, const uint8_t*, const char*, float*);

// y [M, N] for 1-16 rows x, the column blocks of 64 split over the threads, each run by `blocks`.
at::Tensor product(const at::Tensor& x, const at::Tensor& w, int64_t N, BlocksFn blocks) {
  TORCH_CHECK(amx_ready(), "no AMX permission");
  const int64_t M = x.size(0), K = x.size(1);
  TORCH_CHECK(M >= 1 && M <= 16);
  auto xb = x.to(at::kBFloat16).contiguous();
  auto y = at::empty({M, N}, x.options());
  const uint8_t* wp = w.data_ptr<uint8_t>();
  const char* xp = static_cast<const char*>(xb.data_ptr());
  float* yp = y.data_ptr<float>();
  at::parallel_for(0, N / 64, 1, [&](int64_t c0, int64_t c1) { blocks(c0, c1, M, K, N, wp, xp, yp); });
  return y;
}

at::Tensor linear(const at::Tensor& x, const at::Tensor& w, int64_t N) { return product(x, w, N, &run_blocks); }
at::Tensor linear_pipelined(const at::Tensor& x, const at::Tensor& w, int64_t N) {
  return product(x, w, N, &run_blocks_pipelined);
}
at::Tensor linear_tiles(const at::Tensor& x, const at::Tensor& w, int64_t N) { return product(x, w, N, &run_tiles); }

PYBIND11_MODULE(TORCH_EXTENSION_NAME, m) {
  m.def("pack", &pack);
  m.def("linear", &linear);
  m.def("linear_pipelined", &linear_pipelined);
  m.def("pack_tiles", &pack_tiles);
  m.def("linear_tiles", &linear_tiles);
}
