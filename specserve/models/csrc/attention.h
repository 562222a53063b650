// Attention of a few new tokens per sequence against the KV cache, read in place (attention.cpp), shared with
// decoder_stack.cpp.
#pragma once

#include <torch/extension.h>

#include <optional>

namespace specserve_attention {

bool supported(int64_t head_dim);  // float32 rows of head_dim % 8 == 0 on a CPU with AVX2 + FMA

// out [N, Hq, D] for q [N, Hq, D] (the new tokens, packed), caches [S, Hkv, L, D], token n in slot write_slot[n]
// at cache index write_pos[n], flat padded index write_from[n] = b * q_len + i. mask [B, 1, q_len, K] bool (True:
// may attend) where given; otherwise token n sees cache entries 0 .. write_pos[n].
at::Tensor attend(const at::Tensor& q, const at::Tensor& k_cache, const at::Tensor& v_cache,
                  const at::Tensor& write_slot, const at::Tensor& write_pos, const at::Tensor& write_from,
                  const std::optional<at::Tensor>& mask, int64_t q_len);

}  // namespace specserve_attention
