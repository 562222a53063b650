// The decoder layers of specserve.models.llama run from C++: the same ATen ops in the same order as
// DecoderLayer.forward / linear() / attention() (so the same values, bit for bit), without the Python
// interpreter between them. Built once per machine by specserve/models/native_stack.py.
#include "int8_q4.h"
#include "argmax.h"
#include "attention.h"
#include "lumped_kld.h"
#include "small_gemm.h"

#include <torch/extension.h>

#include <algorithm>
#include <cmath>
#include <cstring>
#include <optional>
#include <string>
#include <tuple>
#include <utility>
#include <vector>

namespace {

using at::Tensor;
using at::indexing::Slice;

constexpr int64_t kQ4Group = 32;

// [R, K] -> [width, K]: zero rows after x's (x itself when it has width rows), as llama.pad_rows.
Tensor pad(const Tensor& x, int64_t width) {
  const int64_t rows = x.size(0);
  return rows == width ? x : at::cat({x, x.new_zeros({width - rows, x.size(1)})});
}

using MklLinear = Tensor(const Tensor&, const Tensor&, const Tensor&, const std::optional<Tensor>&, int64_t);

// torch.ops.mkl._mkl_linear (registered only in torch builds with MKL; looked up on first use).
c10::TypedOperatorHandle<MklLinear> mkl_linear() {
  static const auto op = c10::Dispatcher::singleton().findSchemaOrThrow("mkl::_mkl_linear", "").typed<MklLinear>();
  return op;
}

// One projection: a float nn.Linear (with the CPU paths llama.linear() takes) or a packed Q4Linear.
struct Proj {
  Tensor weight;                 // float [N, K]; undefined for q4
  std::optional<Tensor> bias;
  std::optional<Tensor> weight_t;  // [K, N] copy for GEMVs of up to gemv_rows rows
  int64_t gemv_rows = 0;
  // MKL-packed copies (low, width, packed weight): products of low .. width rows, zero-padded to width
  std::vector<std::tuple<int64_t, int64_t, Tensor>> mkl_packed;
  int64_t pad_from = 0;          // products of pad_from .. pad_width-1 rows padded to pad_width
  int64_t pad_width = 16;
  int64_t small_rows = 0;        // products of up to small_rows rows through small_gemm.cpp (batch-invariant)
  int64_t small_chunks = 0;      // products of small_rows+1 .. small_chunks rows: small_rows at a time through it
  std::optional<specserve_small_gemm::Packed> small_packed;  // the weight in its packed layout, where attached
  uint64_t small_packed_rows = 0;  // products of r rows read small_packed where bit r - 1 is set (measured at load)
  std::vector<specserve_small_gemm::Prefetch> small_prefetch;  // [r - 1]: the prefetch for r rows (measured at load)
  std::optional<specserve_small_gemm::Packed> small_records;  // the weight as Q4_1 / Q8_0 records, if attached
  uint64_t small_record_rows = 0;  // products of r rows read small_records where bit r - 1 is set (first)
  std::optional<specserve_small_gemm::Packed> int8_records;  // records for int8 products: every row count, first
  bool int8_q8 = false;  // int8_records hold Q8_0 blocks (int8_pack_q8: a draft head's), else Q4_1 (int8_pack_q4)
  bool q4 = false;
  Tensor packed, scales_and_zeros;
  std::optional<Tensor> dense;   // bf16 copy for products of at least dense_from rows
  int64_t dense_from = 0;
  int64_t out_features = 0, in_features = 0;

  Tensor operator()(const Tensor& x) const {
    const int64_t rows = x.size(0);
    if (int8_records.has_value() && x.scalar_type() == at::kFloat) {
      std::vector<int64_t> shape(x.sizes().begin(), x.sizes().end() - 1);
      shape.push_back(int8_records->n);
      const Tensor flat = x.reshape({-1, int8_records->k});
      return (int8_q8 ? specserve_int8::linear_q8(flat, *int8_records, bias)
                      : specserve_int8::linear(flat, *int8_records, bias))
          .reshape(shape);
    }
    if (q4) {
      Tensor flat = x.reshape({-1, in_features}).to(at::kBFloat16).contiguous();  // (the int4 kernel's need)
      Tensor y = (dense.has_value() && dense_from > 0 && flat.size(0) >= dense_from)
                     ? at::linear(flat, *dense)
                     : at::_weight_int4pack_mm_for_cpu(flat, packed, kQ4Group, scales_and_zeros);
      std::vector<int64_t> shape(x.sizes().begin(), x.sizes().end() - 1);
      shape.push_back(out_features);
      return y.to(x.scalar_type()).reshape(shape);
    }
    if (small_rows > 0 && rows > small_rows && rows <= small_chunks && x.dim() == 2 &&
        x.scalar_type() == at::kFloat && weight.scalar_type() == at::kFloat && weight.is_contiguous()) {
      // more rows than one product takes (a prefill, a large verify): products of small_rows rows, so that every
      // row gets the bits it gets decoded alone, whatever else the forward holds
      std::vector<Tensor> parts;
      for (int64_t r = 0; r < rows; r += small_rows) {
        parts.push_back((*this)(x.narrow(0, r, std::min(small_rows, rows - r))));
      }
      return at::cat(parts);
    }
    if (small_rows > 0 && x.dim() == 2 && rows >= 1 && rows <= small_rows && x.scalar_type() == at::kFloat &&
        weight.scalar_type() == at::kFloat && weight.is_contiguous()) {
      std::optional<specserve_small_gemm::Prefetch> pf;
      if (static_cast<int64_t>(small_prefetch.size()) >= rows) pf = small_prefetch[rows - 1];
      if (small_records.has_value() && (small_record_rows >> (rows - 1) & 1)) {
        return specserve_small_gemm::linear_packed(x, *small_records, bias, pf);
      }
      return small_packed.has_value() && (small_packed_rows >> (rows - 1) & 1)
                 ? specserve_small_gemm::linear_packed(x, *small_packed, bias, pf)
                 : specserve_small_gemm::linear(x, weight, bias, pf);
    }
    if (weight_t.has_value() && x.numel() <= gemv_rows * weight_t->size(0)) {
      Tensor y = at::matmul(x, *weight_t);
      return bias.has_value() ? y + *bias : y;
    }
    for (const auto& [low, width, packed_w] : mkl_packed) {
      if (low <= rows && rows <= width) {
        return mkl_linear().call(pad(x, width), packed_w, weight, bias, width).index({Slice(0, rows)});
      }
    }
    if (pad_from > 0 && pad_from <= rows && rows < pad_width) {
      return at::linear(pad(x, pad_width), weight, bias).index({Slice(0, rows)});
    }
    return at::linear(x, weight, bias);
  }
};

struct Layer {
  Tensor input_norm, post_norm;
  Proj qkv, o_proj, gate_up, down;
};

// llama.silu_mul: SiLU(gate) * up with every row's values whatever rows share the forward (ATen splits an
// elementwise op of GRAIN_SIZE elements or more between threads at element counts, and a split inside a row moved
// some of its elements between its vectorised exp and its scalar one), rows in groups below the grain, the same ops
constexpr int64_t kElementwiseGrain = 32768;  // llama.ELEMENTWISE_GRAIN, ATen's at::internal::GRAIN_SIZE

Tensor silu_mul(const Tensor& gate, const Tensor& up) {
  if (gate.numel() < kElementwiseGrain) return at::silu(gate) * up;
  const int64_t rows = std::max<int64_t>(1, (kElementwiseGrain - 1) / gate.size(-1));
  auto gates = gate.split(rows);
  auto ups = up.split(rows);
  std::vector<Tensor> parts;
  parts.reserve(gates.size());
  for (size_t i = 0; i < gates.size(); ++i) parts.push_back(at::silu(gates[i]) * ups[i]);
  return at::cat(parts);
}

Tensor rms_norm(const Tensor& x, const Tensor& weight, double eps) {
  const int64_t h = x.size(-1);
  if (x.scalar_type() == at::kFloat && weight.scalar_type() == at::kFloat) {
    return at::rms_norm(x, {h}, weight, eps);
  }
  return weight * at::rms_norm(x.to(at::kFloat), {h}, std::nullopt, eps).to(x.scalar_type());
}

Tensor apply_rope(const Tensor& x, const Tensor& cos, const Tensor& sin) {
  const int64_t half = x.size(-1) / 2;
  Tensor rotated = at::cat({-x.index({"...", Slice(half, at::indexing::None)}), x.index({"...", Slice(0, half)})}, -1);
  return x * cos + rotated * sin;
}

// ---- fused kernels (the `fused` stack), float32 or bfloat16: one pass where the ATen path takes 2-7 dispatched ops.
// Arithmetic in float; a bfloat16 result is rounded wherever the ATen op sequence rounds it.

template <typename T>
float round_as(float v) {
  return static_cast<float>(static_cast<T>(v));  // float: no-op; bfloat16: the rounding an ATen op's output gets
}

bool fusable(const Tensor& t, at::ScalarType dtype) {
  return t.scalar_type() == dtype && t.is_contiguous() && t.device().is_cpu();
}

// (x + delta, rms_norm(x + delta) * weight) for x, delta [N, H] (delta undefined: x itself, then the norm). The sum
// is the same add as at::add; the norm's sum of squares is accumulated in double (ATen: float lanes), so normed rows
// agree with llama.rms_norm to rounding, not bit for bit.
template <typename T>
std::pair<Tensor, Tensor> add_rms_norm(const Tensor& x, const Tensor& delta, const Tensor& weight, double eps) {
  TORCH_CHECK(x.dim() == 2 && weight.numel() == x.size(1) && (!delta.defined() || delta.sizes() == x.sizes()),
              "rms norm of x [N, H] (+ delta alike) with a weight of H: x ", x.sizes(), ", weight ", weight.sizes());
  const int64_t rows = x.size(0), h = x.size(1);
  Tensor sum = delta.defined() ? at::empty_like(x) : x;
  Tensor normed = at::empty_like(x);
  const T* xp = x.data_ptr<T>();
  const T* dp = delta.defined() ? delta.data_ptr<T>() : nullptr;
  const T* wp = weight.data_ptr<T>();
  T* sp = sum.data_ptr<T>();
  T* np = normed.data_ptr<T>();
  for (int64_t r = 0; r < rows; ++r) {
    T* sr = sp + r * h;
    double squares = 0.0;
    for (int64_t j = 0; j < h; ++j) {
      if (dp) sr[j] = static_cast<T>(static_cast<float>(xp[r * h + j]) + static_cast<float>(dp[r * h + j]));
      const float v = static_cast<float>(sr[j]);
      squares += static_cast<double>(v) * v;
    }
    const float rstd = 1.0f / std::sqrt(static_cast<float>(squares / h) + static_cast<float>(eps));
    T* nr = np + r * h;
    for (int64_t j = 0; j < h; ++j) {
      // float: (x * rstd) * w as F.rms_norm; bfloat16: w * bf16(x.float() * rstd) as llama.rms_norm
      nr[j] = static_cast<T>(round_as<T>(static_cast<float>(sr[j]) * rstd) * static_cast<float>(wp[j]));
    }
  }
  return {sum, normed};
}

// RoPE over q and k of a fused qkv [N, (Hq + 2 Hkv) D] (rotate-half: x cos + rotate(x) sin, each product rounded
// on its own as in apply_rope: built with -ffp-contract=off, so bit for bit), k and v written straight into their
// cache rows [S, Hkv, L, D] at (write_slot[n], write_pos[n]); returns q [N, Hq, D].
template <typename T>
Tensor rope_write_kv(const Tensor& qkv, const Tensor& cos, const Tensor& sin, Tensor& k_cache, Tensor& v_cache,
                     const Tensor& write_slot, const Tensor& write_pos, int64_t hq, int64_t hkv, int64_t d) {
  const int64_t n_tok = qkv.size(0), width = qkv.size(1), half = d / 2;
  // the layout the writes below index: a mismatched cache or projection would be written past its end
  TORCH_CHECK(qkv.dim() == 2 && width == (hq + 2 * hkv) * d, "qkv [N, (Hq + 2 Hkv) D] = [N, ", (hq + 2 * hkv) * d,
              "], got ", qkv.sizes());
  TORCH_CHECK(k_cache.dim() == 4 && k_cache.size(1) == hkv && k_cache.size(3) == d && k_cache.is_contiguous() &&
                  v_cache.sizes() == k_cache.sizes() && v_cache.is_contiguous(),
              "KV caches [S, ", hkv, ", L, ", d, "], contiguous and alike, got ", k_cache.sizes(), " and ",
              v_cache.sizes());
  const int64_t len = k_cache.size(2);
  TORCH_CHECK(cos.numel() == n_tok * d && sin.numel() == n_tok * d && write_slot.numel() == n_tok &&
                  write_pos.numel() == n_tok,
              "one RoPE row and one KV write per token: ", n_tok, " tokens, ", cos.numel() / d, " cos rows, ",
              write_pos.numel(), " write positions");
  Tensor q = at::empty({n_tok, hq, d}, qkv.options());
  const T* src = qkv.data_ptr<T>();
  const T* cp = cos.data_ptr<T>();
  const T* sp = sin.data_ptr<T>();
  const int64_t* slot = write_slot.data_ptr<int64_t>();
  const int64_t* pos = write_pos.data_ptr<int64_t>();
  T* qp = q.data_ptr<T>();
  T* kp = k_cache.data_ptr<T>();
  T* vp = v_cache.data_ptr<T>();
  auto rot = [](float x, float c, float rotated, float s) {
    return static_cast<T>(round_as<T>(x * c) + round_as<T>(rotated * s));
  };
  const int64_t num_slots = k_cache.size(0);
  for (int64_t n = 0; n < n_tok; ++n) {
    TORCH_CHECK(0 <= slot[n] && slot[n] < num_slots && 0 <= pos[n] && pos[n] < len, "KV write outside the cache: slot ",
                slot[n], " position ", pos[n]);
    const T* row = src + n * width;
    const T* c = cp + n * d;
    const T* s = sp + n * d;
    for (int64_t h = 0; h < hq + hkv; ++h) {
      const T* x = row + h * d;
      T* out = h < hq ? qp + (n * hq + h) * d : kp + ((slot[n] * hkv + (h - hq)) * len + pos[n]) * d;
      for (int64_t j = 0; j < half; ++j) out[j] = rot(x[j], c[j], -static_cast<float>(x[j + half]), s[j]);
      for (int64_t j = half; j < d; ++j) out[j] = rot(x[j], c[j], x[j - half], s[j]);
    }
    for (int64_t h = 0; h < hkv; ++h) {
      std::memcpy(vp + ((slot[n] * hkv + h) * len + pos[n]) * d, row + (hq + hkv + h) * d, d * sizeof(T));
    }
  }
  return q;
}

std::pair<Tensor, Tensor> add_rms_norm(const Tensor& x, const Tensor& delta, const Tensor& weight, double eps) {
  return x.scalar_type() == at::kFloat ? add_rms_norm<float>(x, delta, weight, eps)
                                       : add_rms_norm<at::BFloat16>(x, delta, weight, eps);
}

Tensor rope_write_kv(const Tensor& qkv, const Tensor& cos, const Tensor& sin, Tensor& k_cache, Tensor& v_cache,
                     const Tensor& write_slot, const Tensor& write_pos, int64_t hq, int64_t hkv, int64_t d) {
  return qkv.scalar_type() == at::kFloat
             ? rope_write_kv<float>(qkv, cos, sin, k_cache, v_cache, write_slot, write_pos, hq, hkv, d)
             : rope_write_kv<at::BFloat16>(qkv, cos, sin, k_cache, v_cache, write_slot, write_pos, hq, hkv, d);
}

// rms_norm(x) * weight for x [N, H]: the fused stack's norm on its own (a draft head's norms).
Tensor checked_rms_norm(const Tensor& x, const Tensor& weight, double eps) {
  const at::ScalarType dtype = x.scalar_type();
  TORCH_CHECK(x.dim() == 2 && (dtype == at::kFloat || dtype == at::kBFloat16) && fusable(x, dtype) &&
                  fusable(weight, dtype) && weight.numel() == x.size(1),
              "rms_norm: want a contiguous float32 / bfloat16 CPU x [N, H] and a weight [H] of its dtype");
  return add_rms_norm(x, Tensor(), weight, eps).second;
}

class DecoderStack {
 public:
  // fused: the kernels above for norms (with the residual add) and RoPE + KV write, where every tensor is float32
  // or bfloat16 (one dtype) and contiguous; otherwise exactly DecoderLayer.forward's ATen ops. native_attention:
  // float32 attention through attention.cpp (as llama.attention with the model's attention kernel), else SDPA.
  DecoderStack(int64_t num_heads, int64_t num_kv_heads, int64_t head_dim, double eps, bool fused,
               bool native_attention)
      : num_heads_(num_heads),
        num_kv_heads_(num_kv_heads),
        head_dim_(head_dim),
        eps_(eps),
        fused_(fused),
        native_attention_(native_attention) {}

  void add_layer(Tensor input_norm, Tensor post_norm, Proj qkv, Proj o_proj, Proj gate_up, Proj down) {
    layers_.push_back(Layer{std::move(input_norm), std::move(post_norm), std::move(qkv), std::move(o_proj),
                            std::move(gate_up), std::move(down)});
  }

  int64_t num_layers() const { return static_cast<int64_t>(layers_.size()); }

  // x [N, hidden], cos/sin [N, 1, D]; per-step batch layout as ForwardBatch holds it. Returns the last layer's
  // output [N, hidden] and the inputs of layers aux_layers (in order). first_input: the first layer's attention
  // input [N, K] in place of its input norm of x (x then is the residual alone), as an EAGLE head's layer takes it.
  std::vector<Tensor> forward(Tensor x, const Tensor& cos, const Tensor& sin, const std::vector<Tensor>& k_caches,
                              const std::vector<Tensor>& v_caches, const Tensor& write_slot, const Tensor& write_pos,
                              const Tensor& write_from, const std::optional<Tensor>& attn_mask,
                              const Tensor& slots, int64_t slot_first, int64_t slot_end, int64_t b_size,
                              int64_t q_len, int64_t kv_len, const std::vector<int64_t>& aux_layers,
                              const std::optional<Tensor>& first_input) const {
    c10::InferenceMode guard;
    TORCH_CHECK(static_cast<int64_t>(k_caches.size()) == num_layers() &&
                    static_cast<int64_t>(v_caches.size()) == num_layers(),
                "one K and one V cache per layer");
    std::vector<Tensor> out;
    out.reserve(aux_layers.size() + 1);
    const int64_t n_tok = x.size(0);
    const int64_t qk_heads = num_heads_ + num_kv_heads_;
    const int64_t qk_size = qk_heads * head_dim_;
    const bool padded = b_size * q_len != n_tok;
    const bool is_causal = !attn_mask.has_value() && q_len > 1;
    size_t next_aux = 0;
    const at::ScalarType dtype = x.scalar_type();
    bool fused = fused_ && (dtype == at::kFloat || dtype == at::kBFloat16) && fusable(x, dtype) &&
                 (!first_input.has_value() || first_input->scalar_type() == dtype) &&
                 fusable(cos, dtype) && fusable(sin, dtype);
    for (const Tensor& index : {write_slot, write_pos}) {
      fused = fused && index.scalar_type() == at::kLong && index.is_contiguous() && index.device().is_cpu();
    }
    for (int64_t i = 0; fused && i < num_layers(); ++i) {
      fused = fusable(k_caches[i], dtype) && fusable(v_caches[i], dtype) && fusable(layers_[i].input_norm, dtype) &&
              fusable(layers_[i].post_norm, dtype);
    }
    const bool native_attention = native_attention_ && dtype == at::kFloat &&
                                  specserve_attention::supported(head_dim_) &&
                                  (!attn_mask.has_value() || attn_mask->scalar_type() == at::kBool);
    std::optional<Tensor> mask = attn_mask;
    if (fused && !native_attention && mask.has_value() && mask->scalar_type() == at::kBool) {
      // SDPA turns a bool mask into an additive one (0 / -inf) in every layer; once per step here, the same values
      mask = at::zeros(mask->sizes(), x.options()).masked_fill_(mask->logical_not(), -INFINITY);
    }
    Tensor h;  // the fused path: the current layer's normed input, made together with the residual add before it
    if (fused && num_layers() > 0) {
      h = first_input.has_value() ? first_input->contiguous()
                                  : add_rms_norm(x, Tensor(), layers_[0].input_norm, eps_).second;
    }
    for (int64_t i = 0; i < num_layers(); ++i) {
      if (next_aux < aux_layers.size() && aux_layers[next_aux] == i) {
        out.push_back(x);
        ++next_aux;
      }
      const Layer& layer = layers_[i];
      Tensor k_cache = k_caches[i];
      Tensor v_cache = v_caches[i];
      Tensor q;
      if (fused) {
        Tensor qkv = layer.qkv(h).contiguous();
        q = rope_write_kv(qkv, cos, sin, k_cache, v_cache, write_slot, write_pos, num_heads_, num_kv_heads_,
                          head_dim_);
      } else {
        Tensor qkv = layer.qkv(i == 0 && first_input.has_value() ? *first_input : rms_norm(x, layer.input_norm, eps_));
        Tensor qk = apply_rope(qkv.index({Slice(), Slice(0, qk_size)}).view({n_tok, qk_heads, head_dim_}), cos, sin);
        auto parts = qk.split_with_sizes({num_heads_, num_kv_heads_}, 1);
        Tensor v = qkv.index({Slice(), Slice(qk_size, at::indexing::None)}).view({n_tok, num_kv_heads_, head_dim_});
        k_cache.index_put_({write_slot, Slice(), write_pos}, parts[1]);
        v_cache.index_put_({write_slot, Slice(), write_pos}, v);
        q = parts[0];
      }
      Tensor att;  // [N, Hq, D]
      if (native_attention) {
        att = specserve_attention::attend(q, k_cache, v_cache, write_slot, write_pos, write_from, attn_mask, q_len);
      } else {
        Tensor q_pad;
        if (!padded) {
          q_pad = q.view({b_size, q_len, num_heads_, head_dim_});
        } else {
          q_pad = q.new_zeros({b_size * q_len, num_heads_, head_dim_});
          q_pad.index_put_({write_from}, q);
          q_pad = q_pad.view({b_size, q_len, num_heads_, head_dim_});
        }
        Tensor k, vv;
        if (slot_first >= 0) {
          k = k_cache.index({Slice(slot_first, slot_end), Slice(), Slice(0, kv_len)});
          vv = v_cache.index({Slice(slot_first, slot_end), Slice(), Slice(0, kv_len)});
        } else {
          k = k_cache.index({slots, Slice(), Slice(0, kv_len)});
          vv = v_cache.index({slots, Slice(), Slice(0, kv_len)});
        }
        att = at::scaled_dot_product_attention(q_pad.transpose(1, 2), k, vv, mask, 0.0, is_causal, std::nullopt,
                                               /*enable_gqa=*/true);
        att = att.transpose(1, 2).reshape({b_size * q_len, num_heads_, head_dim_});
        if (padded) att = att.index({write_from});
      }
      Tensor o = layer.o_proj(att.reshape({n_tok, -1}));
      if (fused) {
        o = o.contiguous();
        auto [sum, normed] = add_rms_norm(x, o, layer.post_norm, eps_);
        Tensor gate_up = layer.gate_up(normed);
        auto gu = gate_up.chunk(2, -1);  // ATen's SiLU: vectorised exp (a scalar loop was 2-4x slower)
        Tensor d = layer.down(silu_mul(gu[0], gu[1])).contiguous();
        if (i + 1 < num_layers()) {
          std::tie(x, h) = add_rms_norm(sum, d, layers_[i + 1].input_norm, eps_);
        } else {
          x = sum + d;
        }
        continue;
      }
      x = x + o;
      auto gu = layer.gate_up(rms_norm(x, layer.post_norm, eps_)).chunk(2, -1);
      x = x + layer.down(silu_mul(gu[0], gu[1]));
    }
    out.insert(out.begin(), x);
    return out;
  }

  // The model's final norm of forward's output x [N, H]: the fused kernel in a fused stack (x and weight float32 or
  // bfloat16 alike), else the ATen ops of llama.rms_norm. One call where F.rms_norm from Python took several.
  Tensor final_norm(const Tensor& x, const Tensor& weight) const {
    c10::InferenceMode guard;
    const at::ScalarType dtype = x.scalar_type();
    if (fused_ && x.dim() == 2 && (dtype == at::kFloat || dtype == at::kBFloat16) && fusable(x, dtype) &&
        fusable(weight, dtype)) {
      return add_rms_norm(x, Tensor(), weight, eps_).second;
    }
    return rms_norm(x, weight, eps_);
  }

 private:
  int64_t num_heads_, num_kv_heads_, head_dim_;
  double eps_;
  bool fused_, native_attention_;
  std::vector<Layer> layers_;
};

}  // namespace

PYBIND11_MODULE(TORCH_EXTENSION_NAME, m) {
  // the kernels touch no Python object: other Python threads run meanwhile (ATen re-takes the GIL itself for a
  // Python dispatch mode)
  const auto nogil = py::call_guard<py::gil_scoped_release>();
  py::class_<Proj>(m, "Proj")
      .def(py::init<>())
      .def_readwrite("weight", &Proj::weight)
      .def_readwrite("bias", &Proj::bias)
      .def_readwrite("weight_t", &Proj::weight_t)
      .def_readwrite("gemv_rows", &Proj::gemv_rows)
      .def_readwrite("mkl_packed", &Proj::mkl_packed)
      .def_readwrite("pad_from", &Proj::pad_from)
      .def_readwrite("pad_width", &Proj::pad_width)
      .def_readwrite("small_rows", &Proj::small_rows)
      .def_readwrite("small_chunks", &Proj::small_chunks)
      .def_readwrite("small_packed", &Proj::small_packed)
      .def_readwrite("small_packed_rows", &Proj::small_packed_rows)
      .def_readwrite("small_prefetch", &Proj::small_prefetch)
      .def_readwrite("small_records", &Proj::small_records)
      .def_readwrite("small_record_rows", &Proj::small_record_rows)
      .def_readwrite("int8_records", &Proj::int8_records)
      .def_readwrite("int8_q8", &Proj::int8_q8)
      .def_readwrite("q4", &Proj::q4)
      .def_readwrite("packed", &Proj::packed)
      .def_readwrite("scales_and_zeros", &Proj::scales_and_zeros)
      .def_readwrite("dense", &Proj::dense)
      .def_readwrite("dense_from", &Proj::dense_from)
      .def_readwrite("in_features", &Proj::in_features)
      .def_readwrite("out_features", &Proj::out_features)
      .def("__call__", &Proj::operator(), nogil);
  m.def("rms_norm", &checked_rms_norm, nogil, py::arg("x"), py::arg("weight"), py::arg("eps"));
  m.def("first_max_ids", &specserve_argmax::first_max_ids, nogil, py::arg("logits"), py::arg("portable") = false);
  m.def("lumped_kld", &specserve_kld::lumped_kld, nogil, py::arg("logits"), py::arg("rows"), py::arg("idx"),
        py::arg("prob"), py::arg("eps"));
  m.def("small_gemm_supported", &specserve_small_gemm::supported);
  m.def("attention_supported", &specserve_attention::supported, py::arg("head_dim"));
  m.def("attend", &specserve_attention::attend, nogil, py::arg("q"), py::arg("k_cache"), py::arg("v_cache"),
        py::arg("write_slot"), py::arg("write_pos"), py::arg("write_from"), py::arg("mask"), py::arg("q_len"));
  py::enum_<specserve_small_gemm::Prefetch>(m, "Prefetch")
      .value("none", specserve_small_gemm::Prefetch::none)
      .value("l1", specserve_small_gemm::Prefetch::l1)
      .value("l2", specserve_small_gemm::Prefetch::l2);
  m.def("small_linear", &specserve_small_gemm::linear, nogil, py::arg("x"), py::arg("weight"),
        py::arg("bias") = py::none(), py::arg("prefetch") = py::none());
  m.def("small_linear_isa", &specserve_small_gemm::linear_isa, nogil, py::arg("x"), py::arg("weight"), py::arg("bias"),
        py::arg("isa"));
  m.def("small_linear_bf16", &specserve_small_gemm::linear_bf16, nogil, py::arg("x"), py::arg("weight"),
        py::arg("bias") = py::none(), py::arg("prefetch") = py::none());
  m.def("small_linear_bf16_isa", &specserve_small_gemm::linear_bf16_isa, nogil, py::arg("x"), py::arg("weight"),
        py::arg("bias"), py::arg("isa"));
  m.def("small_gemm_isas", &specserve_small_gemm::isas);
  m.def("small_gemm_isa", &specserve_small_gemm::isa_in_use);
  m.def("small_gemm_threads", &specserve_small_gemm::parallel_threads);
  py::class_<specserve_small_gemm::Packed>(m, "SmallPacked")
      .def_readonly("n", &specserve_small_gemm::Packed::n)
      .def_readonly("k", &specserve_small_gemm::Packed::k)
      .def_readonly("data", &specserve_small_gemm::Packed::data);
  m.def("small_pack", &specserve_small_gemm::pack, nogil, py::arg("weight"));
  m.def("small_pack_q4", &specserve_small_gemm::pack_q4, nogil, py::arg("q"), py::arg("d"), py::arg("m"));
  m.def("small_pack_q8", &specserve_small_gemm::pack_q8, nogil, py::arg("q"), py::arg("d"));
  m.def("small_bounded_argmax", &specserve_small_gemm::bounded_argmax, nogil, py::arg("x"), py::arg("approx"),
        py::arg("weight"), py::arg("row_norms"), py::arg("bound"));
  m.def("small_linear_packed", &specserve_small_gemm::linear_packed, nogil, py::arg("x"), py::arg("packed"),
        py::arg("bias") = py::none(), py::arg("prefetch") = py::none());
  m.def("small_linear_packed_isa", &specserve_small_gemm::linear_packed_isa, nogil, py::arg("x"), py::arg("packed"),
        py::arg("bias"), py::arg("isa"));
  m.def("int8_kernels", &specserve_int8::kernels);
  m.def("int8_pack_q4", &specserve_int8::pack_q4, nogil, py::arg("q"), py::arg("d"), py::arg("m"));
  m.def("int8_linear", &specserve_int8::linear, nogil, py::arg("x"), py::arg("packed"), py::arg("bias") = py::none(),
        py::arg("kernel") = py::none());
  m.def("int8_pack_q8", &specserve_int8::pack_q8, nogil, py::arg("q"), py::arg("d"));
  m.def("int8_q8_supported", &specserve_int8::q8_supported);
  m.def("int8_linear_q8", &specserve_int8::linear_q8, nogil, py::arg("x"), py::arg("packed"),
        py::arg("bias") = py::none(), py::arg("kernel") = py::none());
  py::class_<DecoderStack>(m, "DecoderStack")
      .def(py::init<int64_t, int64_t, int64_t, double, bool, bool>())
      .def("add_layer", &DecoderStack::add_layer)
      .def("num_layers", &DecoderStack::num_layers)
      .def("forward", &DecoderStack::forward, nogil)
      .def("final_norm", &DecoderStack::final_norm, nogil, py::arg("x"), py::arg("weight"));
}
