// DSDE's KL signal with the lumped tail (docs/algorithms.md §4.1) as one call. The same maths as kld_sparse's
// lumped branch (specserve/policy/kld.py) took ~20 small tensor operations from Python, each 15-20 us right after
// the target's forward: here p's log-softmax over the vocabulary is one ATen call on the step's scored rows, and the
// rest (K lookups, logs and sums per row) plain loops in double precision.
#include "lumped_kld.h"

#include <algorithm>
#include <cmath>

namespace specserve_kld {

at::Tensor lumped_kld(const at::Tensor& logits, const at::Tensor& rows, const at::Tensor& idx, const at::Tensor& prob,
                      double eps) {
  TORCH_CHECK(logits.device().is_cpu() && logits.dim() == 2 && logits.scalar_type() == at::kFloat,
              "lumped_kld: logits must be a [R, V] float32 CPU tensor");
  TORCH_CHECK(rows.device().is_cpu() && rows.dim() == 1 && rows.scalar_type() == at::kLong,
              "lumped_kld: rows must be a [m] int64 CPU tensor");
  TORCH_CHECK(idx.device().is_cpu() && idx.dim() == 2 && idx.scalar_type() == at::kInt && idx.size(0) == rows.size(0),
              "lumped_kld: idx must be an [m, K] int32 CPU tensor, one row per logits row");
  TORCH_CHECK(prob.device().is_cpu() && prob.sizes() == idx.sizes() && prob.scalar_type() == at::kFloat,
              "lumped_kld: prob must be a float32 CPU tensor shaped as idx");
  TORCH_CHECK(eps > 0.0, "lumped_kld: eps must be positive");
  const int64_t m = idx.size(0), k = idx.size(1), num_rows = logits.size(0), vocab = logits.size(1);
  auto out = at::empty({m}, logits.options());
  if (m == 0) {
    return out;
  }
  const auto rows_c = rows.contiguous();
  const auto idx_c = idx.contiguous();
  const auto prob_c = prob.contiguous();
  const int64_t* row = rows_c.data_ptr<int64_t>();
  const int32_t* ids = idx_c.data_ptr<int32_t>();
  for (int64_t i = 0; i < m; ++i) {
    TORCH_CHECK(row[i] >= 0 && row[i] < num_rows, "lumped_kld: row ", row[i], " outside the ", num_rows, " logits rows");
  }
  for (int64_t j = 0; j < m * k; ++j) {
    TORCH_CHECK(ids[j] >= 0 && ids[j] < vocab, "lumped_kld: token id ", ids[j], " outside the vocabulary of ", vocab);
  }
  const auto log_p = at::log_softmax(logits.index_select(0, rows_c), -1).contiguous();  // [m, V]
  const float* lp = log_p.data_ptr<float>();
  const float* q = prob_c.data_ptr<float>();
  float* res = out.data_ptr<float>();
  const double log_eps = std::log(eps);
  for (int64_t i = 0; i < m; ++i) {
    double p_top = 0.0, q_top = 0.0, head = 0.0;
    for (int64_t j = i * k; j < (i + 1) * k; ++j) {
      const double log_pk = lp[i * vocab + ids[j]], pk = std::exp(log_pk);
      p_top += pk;  // unfloored: P_rest = 1 - the top-K's mass
      q_top += q[j];
      head += std::max(pk, eps) * (std::max(log_pk, log_eps) - std::log(std::max(static_cast<double>(q[j]), eps)));
    }
    const double p_rest = std::max(1.0 - p_top, eps), q_rest = std::max(1.0 - q_top, eps);
    res[i] = static_cast<float>(std::max(head + p_rest * (std::log(p_rest) - std::log(q_rest)), 0.0));
  }
  return out;
}

}  // namespace specserve_kld
