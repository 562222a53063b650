// The small-product kernel's interface (small_gemm.cpp), shared with decoder_stack.cpp.
#pragma once

#include <torch/extension.h>

#include <optional>
#include <string>
#include <tuple>
#include <vector>

namespace specserve_small_gemm {

// What the kernel prefetches while it multiplies a block of weight rows (small_gemm.cpp): nothing, the next block
// into L1, or the block after it into L2. Every choice gives the same bits.
enum class Prefetch : int64_t { none = 0, l1 = 1, l2 = 2 };

// A weight [n, k] in the kernel's packed layout (pack()): `data` holds n * (k rounded up to 16) floats (float32 or
// bfloat16), or, from pack_q4(), n * k * 3 / 4 bytes of Q4_1 records (uint8), or, from pack_q8(), n * k * 9 / 8
// bytes of Q8_0 records (int8).
// `reader`: the kernels that read it: pack_q4's records and the int8 kernels' pack_q4's are both uint8 of one size,
// and either read the other's as garbage.
enum class Reader : int64_t { small_gemm = 0, int8 = 1 };
struct Packed {
  at::Tensor data;
  int64_t n = 0, k = 0;
  Reader reader = Reader::small_gemm;
};

// y [M, N] += bias [N] (float32, CPU; checked: a per-row or other-typed bias would broadcast or convert silently)
void add_bias(at::Tensor& y, const std::optional<at::Tensor>& bias);

bool supported();
std::string isa_in_use();  // the path products take: "avx512", "avx2" or "none"
std::vector<std::string> isas();
int64_t parallel_threads();  // threads a product is split over (1 when built without OpenMP)
at::Tensor linear(const at::Tensor& x, const at::Tensor& w, const std::optional<at::Tensor>& bias,
                  std::optional<Prefetch> prefetch = std::nullopt);
at::Tensor linear_isa(const at::Tensor& x, const at::Tensor& w, const std::optional<at::Tensor>& bias,
                      const std::string& name);
at::Tensor linear_bf16(const at::Tensor& x, const at::Tensor& w, const std::optional<at::Tensor>& bias,
                       std::optional<Prefetch> prefetch = std::nullopt);
at::Tensor linear_bf16_isa(const at::Tensor& x, const at::Tensor& w, const std::optional<at::Tensor>& bias,
                           const std::string& name);
Packed pack(const at::Tensor& w);
// Q4_1 blocks (q [N, K] uint8 0..15, d and m [N, K / 32] float32) as records the kernel dequantises exactly.
Packed pack_q4(const at::Tensor& q, const at::Tensor& d, const at::Tensor& m);
// Q8_0 blocks (q [N, K] int8, d [N, K / 32] float32) as records the kernel dequantises exactly.
Packed pack_q8(const at::Tensor& q, const at::Tensor& d);
at::Tensor linear_packed(const at::Tensor& x, const Packed& w, const std::optional<at::Tensor>& bias,
                         std::optional<Prefetch> prefetch = std::nullopt);
at::Tensor linear_packed_isa(const at::Tensor& x, const Packed& w, const std::optional<at::Tensor>& bias,
                             const std::string& name);
// Greedy tokens [M] of x @ w^T from the bfloat16 packed copy `approx` and exact recomputation (small_gemm.cpp).
std::tuple<at::Tensor, bool> bounded_argmax(const at::Tensor& x, const Packed& approx, const at::Tensor& w,
                                            const at::Tensor& row_norms, double bound);

}  // namespace specserve_small_gemm
