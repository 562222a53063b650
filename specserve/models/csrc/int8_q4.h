// Products over Q4_1 weights with int8 activations (int8_q4.cpp), shared with decoder_stack.cpp.
#pragma once

#include "small_gemm.h"

#include <torch/extension.h>

#include <optional>
#include <string>
#include <vector>

namespace specserve_int8 {

// The kernels this CPU and process run, the default first: "amx" (AMX-TILE, AMX-INT8 and AVX-512 F/BW/VL, and Linux
// grants this process the tile data), "avx512-vnni" (AVX-512 F/BW/VL and VNNI), "avx2" (AVX2 and FMA). Empty: no
// int8 products here.
const std::vector<std::string>& kernels();
// Q4_1 blocks (q [N, K] uint8 0..15, d and m [N, K / 32] float32; N a multiple of 64, K of 32) as the int8 records.
specserve_small_gemm::Packed pack_q4(const at::Tensor& q, const at::Tensor& d, const at::Tensor& m);
// x [M, K] float32 @ w^T (+ bias) with each row's groups of 32 activations rounded to int8 (llama.cpp's Q8_1), on
// `kernel` (default: kernels()[0]): every kernel the same bits, every row the same bits whatever else x holds.
at::Tensor linear(const at::Tensor& x, const specserve_small_gemm::Packed& w, const std::optional<at::Tensor>& bias,
                  const std::optional<std::string>& kernel = std::nullopt);
// Q8_0 blocks (q [N, K] int8, d [N, K / 32] float32; N a multiple of 64, K of 32) as records for linear_q8.
specserve_small_gemm::Packed pack_q8(const at::Tensor& q, const at::Tensor& d);
// The CPU runs linear_q8 (AVX512-VNNI or AVX2; not the AMX tiles).
bool q8_supported();
// x [M, K] float32 @ w^T (+ bias) over Q8_0 records, the activations rounded as linear's: every row the same bits
// whatever else x holds and on either kernel (an LM head: ModelSpec.int8_reads).
at::Tensor linear_q8(const at::Tensor& x, const specserve_small_gemm::Packed& w, const std::optional<at::Tensor>& bias,
                     const std::optional<std::string>& kernel = std::nullopt);

}  // namespace specserve_int8
