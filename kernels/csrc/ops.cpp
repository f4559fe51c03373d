// The CPU kernels as torch operators: torch.ops.llmserve.<name>. Registered
// operators show up in the profiler and can be traced by torch.compile.
#include "ops.h"

#include <ATen/core/Tensor.h>
#include <torch/library.h>

namespace {

// Whether these kernels were built for AVX-512 (the host's -march=native, or
// LLMSERVE_KERNELS_MARCH): the worker sizes our GEMV's share of rows by what
// the kernels were built for, not by what the CPU could run.
bool built_for_avx512() {
#if defined(__AVX512F__)
  return true;
#else
  return false;
#endif
}

}  // namespace

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
  m.def("gemv_prefetches(ScalarType weight_dtype) -> bool");
  m.def("gemv_walks_rows_at_once(ScalarType weight_dtype) -> bool");
  m.def("pack_gemm_weight(Tensor weight) -> Tensor");
  m.def("gemm(Tensor x, Tensor packed, int n) -> Tensor");
  m.def("gemm_silu_and_mul(Tensor x, Tensor packed, int n) -> Tensor");
  m.def("stolen_items(int items, int stall_us) -> Tensor");
  m.def("shared_tail_rows(int rows, int grain, int stall_us) -> Tensor");
  m.def("amx_bf16_available() -> bool");
  m.def("built_for_avx512() -> bool");
  m.def("gemm_bf16_dot_available() -> bool");
  m.def("gemm_panel_columns() -> int");
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
  m.impl("pack_gemm_weight", &pack_gemm_weight);
  m.impl("gemm", &gemm);
  m.impl("gemm_silu_and_mul", &gemm_silu_and_mul);
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
  m.impl("gemm_bf16_dot_available", &gemm_bf16_dot_available);
  m.impl("gemm_panel_columns", &gemm_panel_columns);
  m.impl("gemv_prefetches", &gemv_prefetches);
  m.impl("gemv_walks_rows_at_once", &gemv_walks_rows_at_once);
  m.impl("built_for_avx512", &built_for_avx512);
  m.impl("stolen_items", &stolen_items);
  m.impl("shared_tail_rows", &shared_tail_rows);
}
