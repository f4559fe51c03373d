// The CPU kernels as torch operators: torch.ops.llmserve.<name>. Registered
// operators show up in the profiler and can be traced by torch.compile.
#include <torch/library.h>
#include <torch/extension.h>

void write_kv_cache(torch::Tensor k, torch::Tensor v, torch::Tensor key_cache,
                    torch::Tensor value_cache, torch::Tensor slot_mapping);
torch::Tensor paged_decode_attention(torch::Tensor query, torch::Tensor key_cache,
                                     torch::Tensor value_cache, torch::Tensor block_table,
                                     torch::Tensor seq_lens, double scale);
void paged_prefill_attention(torch::Tensor query, torch::Tensor key_cache,
                             torch::Tensor value_cache, torch::Tensor block_table,
                             torch::Tensor seq_lens, torch::Tensor query_start_loc, double scale,
                             torch::Tensor out);

torch::Tensor rms_norm(torch::Tensor x, torch::Tensor weight, double eps);
void fused_add_rms_norm(torch::Tensor x, torch::Tensor residual, torch::Tensor weight,
                        double eps);
void rotary_embedding(torch::Tensor q, torch::Tensor k, torch::Tensor positions,
                      torch::Tensor cos_sin);
torch::Tensor silu_and_mul(torch::Tensor gate_up);
torch::Tensor argmax_rows(torch::Tensor logits);
torch::Tensor gemv(torch::Tensor x, torch::Tensor weight);
bool amx_bf16_available();
torch::Tensor llama_decode_layers(torch::Tensor x, std::vector<torch::Tensor> weights,
                                  std::vector<torch::Tensor> packed,
                                  std::vector<torch::Tensor> caches, torch::Tensor positions,
                                  torch::Tensor cos_sin, torch::Tensor slot_mapping,
                                  torch::Tensor block_table, torch::Tensor seq_lens,
                                  int64_t num_heads, int64_t num_kv_heads, int64_t head_dim,
                                  int64_t gemv_rows, double eps, double scale);
torch::Tensor amx_bf16_linear(torch::Tensor x, torch::Tensor packed);

TORCH_LIBRARY(llmserve, m) {
  m.def("write_kv_cache(Tensor k, Tensor v, Tensor(a!) key_cache, Tensor(b!) value_cache, "
        "Tensor slot_mapping) -> ()");
  m.def("paged_decode_attention(Tensor query, Tensor key_cache, Tensor value_cache, "
        "Tensor block_table, Tensor seq_lens, float scale) -> Tensor");
  m.def("paged_prefill_attention(Tensor query, Tensor key_cache, Tensor value_cache, "
        "Tensor block_table, Tensor seq_lens, Tensor query_start_loc, float scale, "
        "Tensor(a!) out) -> ()");
  m.def("rms_norm(Tensor x, Tensor weight, float eps) -> Tensor");
  m.def("fused_add_rms_norm(Tensor(a!) x, Tensor(b!) residual, Tensor weight, float eps) -> ()");
  m.def("rotary_embedding(Tensor(a!) q, Tensor(b!) k, Tensor positions, Tensor cos_sin) -> ()");
  m.def("silu_and_mul(Tensor gate_up) -> Tensor");
  m.def("argmax_rows(Tensor logits) -> Tensor");
  m.def("gemv(Tensor x, Tensor weight) -> Tensor");
  m.def("amx_bf16_available() -> bool");
  m.def("llama_decode_layers(Tensor x, Tensor[] weights, Tensor[] packed, Tensor(a!)[] caches, "
        "Tensor positions, Tensor cos_sin, Tensor slot_mapping, Tensor block_table, "
        "Tensor seq_lens, int num_heads, int num_kv_heads, int head_dim, int gemv_rows, "
        "float eps, float scale) -> Tensor");
  m.def("amx_bf16_linear(Tensor x, Tensor packed) -> Tensor");
}

TORCH_LIBRARY_IMPL(llmserve, CPU, m) {
  m.impl("write_kv_cache", &write_kv_cache);
  m.impl("paged_decode_attention", &paged_decode_attention);
  m.impl("paged_prefill_attention", &paged_prefill_attention);
  m.impl("rms_norm", &rms_norm);
  m.impl("fused_add_rms_norm", &fused_add_rms_norm);
  m.impl("rotary_embedding", &rotary_embedding);
  m.impl("silu_and_mul", &silu_and_mul);
  m.impl("argmax_rows", &argmax_rows);
  m.impl("gemv", &gemv);
  m.impl("amx_bf16_linear", &amx_bf16_linear);
  m.impl("llama_decode_layers", &llama_decode_layers);
}

// oneDNN's packed weights, among its arguments, carry the MkldnnCPU key, which
// outranks CPU in dispatch.
TORCH_LIBRARY_IMPL(llmserve, MkldnnCPU, m) {
  m.impl("llama_decode_layers", &llama_decode_layers);
}

// No tensor arguments to dispatch on: one kernel for every backend.
TORCH_LIBRARY_IMPL(llmserve, CompositeExplicitAutograd, m) {
  m.impl("amx_bf16_available", &amx_bf16_available);
}
