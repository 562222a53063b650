// DSDE's KL signal with the lumped tail in one call (lumped_kld.cpp), shared with decoder_stack.cpp's module.
#pragma once

#include <torch/extension.h>

namespace specserve_kld {

// KL(p || q) [m] float32 with q's mass outside its top-K lumped into one outcome (specserve/policy/kld.py,
// kld_sparse with tail=lumped): p = softmax(logits[rows[i]]) (temperature 1), q = the shipped top-K ids idx[i] and
// their probabilities prob[i], not renormalised. logits [R, V] float32 on the CPU, rows [m] int64, idx [m, K] int32
// (distinct per row), prob [m, K] float32. Probabilities are floored at eps as there.
at::Tensor lumped_kld(const at::Tensor& logits, const at::Tensor& rows, const at::Tensor& idx, const at::Tensor& prob,
                      double eps);

}  // namespace specserve_kld
