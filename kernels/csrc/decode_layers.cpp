// A decode step through every layer of a Llama-family model, in one call: the
// same kernels, in the same order and on the same tensors, as
// LlamaDecoderLayer.forward runs them one by one from Python. At one stream a
// step's ~500 kernel calls are short, and the Python and dispatch around each
// one cost more than the element-wise kernels themselves (bench/NOTES.md);
// here each costs a C++ call. Plain layers only (no biases, no q/k norms, no
// LoRA, one rank): services/worker/models/cpu_decode_layers.py decides.
#include <ATen/core/Tensor.h>
#include <ATen/core/dispatch/Dispatcher.h>

#include <vector>

#include "ops.h"

namespace {

// Per layer in `weights`: input norm, qkv, o, post-attention norm, gate_up, down;
// in `packed`, where given: qkv, o, gate_up, down as our GEMM, MKL, oneDNN or our AMX
// kernel packed them.
constexpr int64_t kPerLayer = 6;
constexpr int64_t kPackedPerLayer = 4;

struct Step {
  at::Tensor positions, cos_sin, slot_mapping, block_table, seq_lens;
  int64_t num_heads, num_kv_heads, head_dim, gemv_rows;
  double eps, scale;
};

// Calls a torch operator, as Python's torch.ops does.
at::Tensor call(const c10::OperatorHandle& op, torch::jit::Stack stack) {
  op.callBoxed(&stack);
  return stack[0].toTensor();
}

// Our AMX kernel's layout (cpu_matmul/amx.py pack_amx_weight): [N / 32, K / 32, 32 * 32],
// where our GEMM's panels end in their columns (48, or 96 for pairs of K).
bool amx_packed(const at::Tensor& packed) {
  return !packed.is_mkldnn() && packed.dim() == 3 && packed.size(2) == 32 * 32;
}

// x W^T as the linear's strategy (cpu_matmul/gemv.py GemvForFewRows) computes it:
// our GEMV up to its rows, else the product with the packed weight: our AMX
// kernel's tiles (cpu_matmul/amx.py AMXWeights, for the rows the caller lets it
// take), our GEMM's panels (cpu_matmul/gemm.py PackedGemmWeights), or an opaque
// tensor, called as its strategy calls it: MKL's pack (cpu_matmul/mkl.py, a buffer
// of [floats, 1]) or oneDNN's (cpu_matmul/onednn.py, the weight's own [N, K]).
at::Tensor linear(const at::Tensor& x, const at::Tensor& weight, const at::Tensor* packed,
                  const Step& s) {
  if (x.size(0) <= s.gemv_rows) return gemv(x, weight);
  if (amx_packed(*packed)) return amx_bf16_linear(x, *packed);
  if (!packed->is_mkldnn()) return gemm(x, *packed, weight.size(0));
  static auto& ops = c10::Dispatcher::singleton();
  static const auto mkl = ops.findSchemaOrThrow("mkl::_mkl_linear", "");
  static const auto onednn = ops.findSchemaOrThrow("mkldnn::_linear_pointwise", "");
  if (packed->sizes() != weight.sizes())
    return call(mkl, {x, *packed, weight, c10::IValue(), x.size(0)});
  return call(onednn, {x, *packed, c10::IValue(), std::string("none"),
                       c10::List<std::optional<at::Scalar>>(), std::string("")});
}

// silu_and_mul of the gate_up linear's product: in our GEMM's own pass where it
// takes the step and each half of the weight is whole panels, as
// PackedColumnParallelLinear.silu_and_mul chooses.
at::Tensor gated(const at::Tensor& x, const at::Tensor& weight, const at::Tensor* packed,
                 const Step& s) {
  const int64_t n = weight.size(0);
  if (x.size(0) > s.gemv_rows && !packed->is_mkldnn() && !amx_packed(*packed) &&
      n % (2 * gemm_panel_columns()) == 0)
    return gemm_silu_and_mul(x, *packed, n);
  return silu_and_mul(linear(x, weight, packed, s));
}

// Attention then MLP of one layer, from its normed input x; leaves the residual
// stream updated and returns the MLP's output (not yet added to it).
at::Tensor layer(const at::Tensor& x, at::Tensor& residual, const at::Tensor* w,
                 const at::Tensor* p, const at::Tensor& key_cache, const at::Tensor& value_cache,
                 const Step& s) {
  const int64_t T = x.size(0), q_size = s.num_heads * s.head_dim;
  const int64_t kv_size = s.num_kv_heads * s.head_dim;
  // The j-th linear of the layer (qkv, o, gate_up, down) on `in`.
  auto lin = [&](const at::Tensor& in, int j) {
    static constexpr int kWeight[] = {1, 2, 4, 5};
    return linear(in, w[kWeight[j]], p ? p + j : nullptr, s);
  };
  auto qkv = lin(x, 0);
  auto q = qkv.narrow(1, 0, q_size).view({T, s.num_heads, s.head_dim});
  auto k = qkv.narrow(1, q_size, kv_size).view({T, s.num_kv_heads, s.head_dim});
  auto v = qkv.narrow(1, q_size + kv_size, kv_size).view({T, s.num_kv_heads, s.head_dim});
  rotary_embedding(q, k, s.positions, s.cos_sin);
  write_kv_cache(k, v, key_cache, value_cache, s.slot_mapping);
  auto attn = paged_decode_attention(q, key_cache, value_cache, s.block_table, s.seq_lens,
                                     s.scale);
  auto h = lin(attn.view({T, q_size}), 1);
  fused_add_rms_norm(h, residual, w[3], s.eps);
  return lin(gated(h, w[4], p ? p + 2 : nullptr, s), 3);
}

}  // namespace

// x: the step's embeddings [T, hidden]; weights: kPerLayer per layer, then the
// final norm's; packed: kPackedPerLayer per layer, or none where every step has
// at most gemv_rows rows; caches: each layer's key and value caches. Returns the
// final norm of the last hidden states, as LlamaModel.forward does.
at::Tensor llama_decode_layers(at::Tensor x, std::vector<at::Tensor> weights,
                               std::vector<at::Tensor> packed, std::vector<at::Tensor> caches,
                               at::Tensor positions, at::Tensor cos_sin, at::Tensor slot_mapping,
                               at::Tensor block_table, at::Tensor seq_lens, int64_t num_heads,
                               int64_t num_kv_heads, int64_t head_dim, int64_t gemv_rows,
                               double eps, double scale) {
  const int64_t num_layers = static_cast<int64_t>(caches.size()) / 2;
  const auto num_packed = static_cast<int64_t>(packed.size());
  TORCH_CHECK(num_layers > 0 && static_cast<int64_t>(weights.size()) ==
              num_layers * kPerLayer + 1, "llama_decode_layers: ", kPerLayer,
              " weights per layer and the final norm's, two caches per layer");
  TORCH_CHECK(num_packed == num_layers * kPackedPerLayer || (num_packed == 0 &&
              x.size(0) <= gemv_rows), "llama_decode_layers: ", kPackedPerLayer,
              " packed weights per layer for steps of more than ", gemv_rows, " rows");
  const Step s{positions, cos_sin, slot_mapping, block_table, seq_lens, num_heads,
               num_kv_heads, head_dim, gemv_rows, eps, scale};
  // The first layer: the embeddings are the residual stream, normed apart.
  at::Tensor residual = x;
  at::Tensor h = rms_norm(x, weights[0], eps);
  for (int64_t i = 0; i < num_layers; ++i) {
    const at::Tensor* w = weights.data() + i * kPerLayer;
    if (i > 0) fused_add_rms_norm(h, residual, w[0], eps);
    const at::Tensor* p = num_packed ? packed.data() + i * kPackedPerLayer : nullptr;
    h = layer(h, residual, w, p, caches[2 * i], caches[2 * i + 1], s);
  }
  fused_add_rms_norm(h, residual, weights.back(), eps);
  return h;
}
