// The kernels' entry points (paged_attention.cpp, layers.cpp, gemv.cpp, gemm.cpp,
// work_stealing.cpp, sampling.cpp, amx_linear.cpp, decode_layers.cpp): what ops.cpp registers as
// torch operators, and what decode_layers.cpp calls directly.
#pragma once

#include <torch/extension.h>

#include <vector>

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
torch::Tensor pack_gemm_weight(torch::Tensor weight);
torch::Tensor gemm(torch::Tensor x, torch::Tensor packed, int64_t n);
torch::Tensor gemm_silu_and_mul(torch::Tensor x, torch::Tensor packed, int64_t n);
torch::Tensor stolen_items(int64_t items, int64_t stall_us);
bool amx_bf16_available();
torch::Tensor llama_decode_layers(torch::Tensor x, std::vector<torch::Tensor> weights,
                                  std::vector<torch::Tensor> packed,
                                  std::vector<torch::Tensor> caches, torch::Tensor positions,
                                  torch::Tensor cos_sin, torch::Tensor slot_mapping,
                                  torch::Tensor block_table, torch::Tensor seq_lens,
                                  int64_t num_heads, int64_t num_kv_heads, int64_t head_dim,
                                  int64_t gemv_rows, double eps, double scale);
torch::Tensor amx_bf16_linear(torch::Tensor x, torch::Tensor packed);
