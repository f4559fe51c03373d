// The kernels' entry points (paged_attention.cpp, paged_prefill.cpp, layers.cpp, gemv.cpp,
// gemm.cpp, work_stealing.cpp, sampling.cpp, amx_linear.cpp, decode_layers.cpp): what ops.cpp
// registers as torch operators, and what decode_layers.cpp calls directly.
#pragma once

// ATen's Tensor, here and in every kernel file, and each file the ATen/ops/*.h of
// the functions it calls: not <ATen/ATen.h> (every operator's declaration) nor
// <torch/extension.h> (Python bindings, the C++ frontend). Parsing what the
// kernels never use was most of each small file's compile time.
#include <ATen/core/Tensor.h>

#include <vector>

void write_kv_cache(at::Tensor k, at::Tensor v, at::Tensor key_cache, at::Tensor value_cache,
                    at::Tensor slot_mapping);
at::Tensor paged_decode_attention(at::Tensor query, at::Tensor key_cache, at::Tensor value_cache,
                                  at::Tensor block_table, at::Tensor seq_lens, double scale);
void paged_prefill_attention(at::Tensor query, at::Tensor key_cache, at::Tensor value_cache,
                             at::Tensor block_table, at::Tensor seq_lens,
                             at::Tensor query_start_loc, double scale, at::Tensor out);

at::Tensor rms_norm(at::Tensor x, at::Tensor weight, double eps);
void fused_add_rms_norm(at::Tensor x, at::Tensor residual, at::Tensor weight, double eps);
void rotary_embedding(at::Tensor q, at::Tensor k, at::Tensor positions, at::Tensor cos_sin);
at::Tensor silu_and_mul(at::Tensor gate_up);
at::Tensor argmax_rows(at::Tensor logits);
at::Tensor gemv(at::Tensor x, at::Tensor weight);
bool gemv_prefetches(at::ScalarType weight_dtype);
bool gemv_walks_rows_at_once(at::ScalarType weight_dtype);
at::Tensor pack_gemm_weight(at::Tensor weight);
at::Tensor gemm(at::Tensor x, at::Tensor packed, int64_t n);
at::Tensor gemm_silu_and_mul(at::Tensor x, at::Tensor packed, int64_t n);
int64_t gemm_panel_columns();
bool gemm_bf16_dot_available();
at::Tensor stolen_items(int64_t items, int64_t stall_us);
at::Tensor shared_tail_rows(int64_t rows, int64_t grain, int64_t stall_us);
bool amx_bf16_available();
at::Tensor llama_decode_layers(at::Tensor x, std::vector<at::Tensor> weights,
                               std::vector<at::Tensor> packed, std::vector<at::Tensor> caches,
                               at::Tensor positions, at::Tensor cos_sin, at::Tensor slot_mapping,
                               at::Tensor block_table, at::Tensor seq_lens, int64_t num_heads,
                               int64_t num_kv_heads, int64_t head_dim, int64_t gemv_rows,
                               double eps, double scale);
at::Tensor amx_bf16_linear(at::Tensor x, at::Tensor packed);
