// The AMX-INT8 product over Q4_1 weights (amx_int8.cpp), shared with decoder_stack.cpp.
#pragma once

#include "small_gemm.h"

#include <torch/extension.h>

#include <optional>

namespace specserve_amx {

// The CPU has AMX-TILE, AMX-INT8 and AVX-512 (F, BW, VL), and Linux grants this process the tile data.
bool supported();
// Q4_1 blocks (q [N, K] uint8 0..15, d and m [N, K / 32] float32; N a multiple of 64, K of 32) as the tile records.
specserve_small_gemm::Packed pack_q4(const at::Tensor& q, const at::Tensor& d, const at::Tensor& m);
// x [M, K] float32 @ w^T (+ bias) with each row's groups of 32 activations rounded to int8 (llama.cpp's Q8_1): every
// row the same bits whatever else x holds.
at::Tensor linear(const at::Tensor& x, const specserve_small_gemm::Packed& w, const std::optional<at::Tensor>& bias);

}  // namespace specserve_amx
