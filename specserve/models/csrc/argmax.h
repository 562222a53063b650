// Greedy tokens from float32 logits (argmax.cpp), shared with decoder_stack.cpp's module.
#pragma once

#include <torch/extension.h>

namespace specserve_argmax {

// [R] int64 for logits [R, V] float32 on the CPU: each row's first maximum, or V where the row's maximum is not
// finite (a NaN anywhere in the row, +inf, or a row of -inf): specserve/sampling.py's greedy_draw, row for row.
// portable: the scalar path, which CPUs without AVX2 run (for the tests).
at::Tensor first_max_ids(const at::Tensor& logits, bool portable = false);

}  // namespace specserve_argmax
