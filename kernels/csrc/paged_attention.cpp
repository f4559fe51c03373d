// Paged KV cache on the CPU: writing new tokens' K/V, and decode attention.
//
// Layout, per layer (see kernels/cpu_paged_attention.py):
//   key_cache   [num_blocks, kv_heads, head_dim, block_size]  (K transposed per block)
//   value_cache [num_blocks, kv_heads, block_size, head_dim]
// With K transposed, the scores of a whole block against one query head are
// head_dim vertical multiply-adds over block_size lanes (one AVX-512 register of
// 16 floats, two AVX2 ones): no horizontal reduction per token. Both blocks of a
// (block, KV head) pair are contiguous, so a sequence streams through memory.
//
// Built for the host at first use (-march=native: AVX-512 or AVX2 code as the
// CPU has it); the loops are written so the compiler vectorizes them.
#include <ATen/Parallel.h>
#include <torch/extension.h>

#include <algorithm>
#include <cmath>
#include <cstdint>
#include <cstring>
#include <limits>
#include <vector>

#include "vector_math.h"

namespace {

template <typename scalar_t>
void write_kv_impl(const torch::Tensor& k, const torch::Tensor& v, torch::Tensor& key_cache,
                   torch::Tensor& value_cache, const torch::Tensor& slot_mapping) {
  const int64_t T = k.size(0), KV = k.size(1), D = k.size(2);
  const int64_t bs = key_cache.size(3);
  const scalar_t* kp = k.data_ptr<scalar_t>();
  const scalar_t* vp = v.data_ptr<scalar_t>();
  scalar_t* kc = key_cache.data_ptr<scalar_t>();
  scalar_t* vc = value_cache.data_ptr<scalar_t>();
  const int64_t* slots = slot_mapping.data_ptr<int64_t>();
  at::parallel_for(0, T, 16, [&](int64_t begin, int64_t end) {
    llmserve::FlushDenormals flush;
    for (int64_t t = begin; t < end; ++t) {
      const int64_t block = slots[t] / bs, offset = slots[t] % bs;
      for (int64_t h = 0; h < KV; ++h) {
        const scalar_t* ksrc = kp + (t * KV + h) * D;
        const scalar_t* vsrc = vp + (t * KV + h) * D;
        scalar_t* kdst = kc + (block * KV + h) * D * bs + offset;
        scalar_t* vdst = vc + ((block * KV + h) * bs + offset) * D;
        for (int64_t d = 0; d < D; ++d) kdst[d * bs] = ksrc[d];
        std::copy(vsrc, vsrc + D, vdst);
      }
    }
  });
}

using llmserve::load16;
using llmserve::vf16;

// Scores of one query head (scaled, fp32) against a block of keys [D][BS]:
// BS/16 vectors of 16 tokens, each the sum over d of q[d] * K[d][16 tokens],
// with four independent accumulators so the multiply-adds pipeline.
template <typename scalar_t, int BS, int D>
inline void head_block_scores(const float* q, const scalar_t* kblock, float* scores) {
  for (int c = 0; c < BS; c += 16) {
    vf16 a0 = {}, a1 = {}, a2 = {}, a3 = {};
    for (int d = 0; d < D; d += 4) {
      a0 += q[d] * load16(kblock + d * BS + c);
      a1 += q[d + 1] * load16(kblock + (d + 1) * BS + c);
      a2 += q[d + 2] * load16(kblock + (d + 2) * BS + c);
      a3 += q[d + 3] * load16(kblock + (d + 3) * BS + c);
    }
    const vf16 sum = (a0 + a1) + (a2 + a3);
    std::memcpy(scores + c, &sum, sizeof(sum));
  }
}

// acc (D/16 vectors, kept in registers by the caller) += p[t] * V[t] over a
// block's first `valid` tokens; values [BS][D].
template <typename scalar_t, int D>
inline void head_block_values(const float* p, int64_t valid, const scalar_t* vblock,
                              vf16* acc) {
  for (int64_t t = 0; t < valid; ++t) {
    const float w = p[t];
    for (int c = 0; c < D / 16; ++c) acc[c] += w * load16(vblock + t * D + c * 16);
  }
}

// Numerically stable softmax of each row's first `len` scores, in place; each
// row's sum goes to `sums`.
inline void softmax_rows(float* scores, int64_t group, int64_t stride, int64_t len,
                         float* sums) {
  for (int64_t g = 0; g < group; ++g) {
    float* s = scores + g * stride;
    float m = -std::numeric_limits<float>::max();
#pragma omp simd reduction(max : m)
    for (int64_t t = 0; t < len; ++t) m = std::max(m, s[t]);
    float sum = 0.f;
#pragma omp simd reduction(+ : sum)
    for (int64_t t = 0; t < len; ++t) {
      s[t] = llmserve::fast_exp(s[t] - m);
      sum += s[t];
    }
    sums[g] = sum;
  }
}

// Blocks are scattered pages, and hardware prefetchers stop at page boundaries:
// ask for the next block while this one is worked on.
template <typename scalar_t>
inline void prefetch_block(const scalar_t* block, int64_t elems) {
  const char* p = reinterpret_cast<const char*>(block);
  for (int64_t i = 0; i < elems * static_cast<int64_t>(sizeof(scalar_t)); i += 64)
    __builtin_prefetch(p + i);
}

// One (sequence, KV head) work item: its `group` query heads against the
// sequence's blocks; out[h] = softmax(q_h K^T * scale) V.
template <typename q_t, typename scalar_t, int BS, int D>
void decode_item(const q_t* q, const scalar_t* kc, const scalar_t* vc, const int64_t* row,
                 int64_t len, int64_t group, int64_t kv_heads, int64_t h, double scale,
                 q_t* out, std::vector<float>& scores) {
  const int64_t num_blocks = (len + BS - 1) / BS, stride = num_blocks * BS;
  scores.resize(stride);
  alignas(64) float qf[D];
  for (int64_t g = 0; g < group; ++g) {
    for (int d = 0; d < D; ++d) qf[d] = static_cast<float>(q[g * D + d]) * scale;
    for (int64_t n = 0; n < num_blocks; ++n) {
      // The first head brings the blocks into L2; the group's other heads find them there.
      if (g == 0 && n + 1 < num_blocks)
        prefetch_block(kc + (row[n + 1] * kv_heads + h) * D * BS, D * BS);
      head_block_scores<scalar_t, BS, D>(qf, kc + (row[n] * kv_heads + h) * D * BS,
                                         scores.data() + n * BS);
    }
    // Past the end, scores that exp() takes to ~0: the softmax runs over whole
    // vectors, and the value pass reads only the first `len` weights anyway.
    std::fill(scores.begin() + len, scores.end(), -1e30f);
    float sum;
    softmax_rows(scores.data(), 1, stride, stride, &sum);
    vf16 acc[D / 16] = {};
    for (int64_t n = 0; n < num_blocks; ++n) {
      if (g == 0 && n + 1 < num_blocks)
        prefetch_block(vc + (row[n + 1] * kv_heads + h) * D * BS, D * BS);
      head_block_values<scalar_t, D>(scores.data() + n * BS, std::min<int64_t>(BS, len - n * BS),
                                     vc + (row[n] * kv_heads + h) * D * BS, acc);
    }
    const float inv = 1.f / sum;
    for (int c = 0; c < D / 16; ++c)
      for (int i = 0; i < 16; ++i) out[g * D + c * 16 + i] = static_cast<q_t>(acc[c][i] * inv);
  }
}

template <typename q_t, typename scalar_t, int BS, int D>
void decode_impl(const torch::Tensor& query, const torch::Tensor& key_cache,
                 const torch::Tensor& value_cache, const torch::Tensor& block_table,
                 const torch::Tensor& seq_lens, double scale, torch::Tensor& out) {
  const int64_t B = query.size(0), H = query.size(1);
  const int64_t KV = key_cache.size(1), group = H / KV, max_blocks = block_table.size(1);
  const q_t* q = query.data_ptr<q_t>();
  const scalar_t* kc = key_cache.data_ptr<scalar_t>();
  const scalar_t* vc = value_cache.data_ptr<scalar_t>();
  const int64_t* table = block_table.data_ptr<int64_t>();
  const int64_t* lens = seq_lens.data_ptr<int64_t>();
  q_t* o = out.data_ptr<q_t>();
  at::parallel_for(0, B * KV, 1, [&](int64_t begin, int64_t end) {
    llmserve::FlushDenormals flush;
    std::vector<float> scores;
    for (int64_t item = begin; item < end; ++item) {
      const int64_t b = item / KV, h = item % KV, first = (b * H + h * group) * D;
      decode_item<q_t, scalar_t, BS, D>(q + first, kc, vc, table + b * max_blocks, lens[b], group,
                                        KV, h, scale, o + first, scores);
    }
  });
}

// The block sizes and head dims the kernel is specialized for (registers and
// loop bounds fixed at compile time); kernels/cpu_paged_attention.py lists them.
template <typename q_t, typename c_t, int BS>
void dispatch_head_dim(const torch::Tensor& q, const torch::Tensor& kc, const torch::Tensor& vc,
                       const torch::Tensor& table, const torch::Tensor& lens, double scale,
                       torch::Tensor& out) {
  switch (q.size(2)) {
    case 32: return decode_impl<q_t, c_t, BS, 32>(q, kc, vc, table, lens, scale, out);
    case 64: return decode_impl<q_t, c_t, BS, 64>(q, kc, vc, table, lens, scale, out);
    case 96: return decode_impl<q_t, c_t, BS, 96>(q, kc, vc, table, lens, scale, out);
    case 128: return decode_impl<q_t, c_t, BS, 128>(q, kc, vc, table, lens, scale, out);
    default: TORCH_CHECK(false, "head_dim must be 32, 64, 96 or 128 for the CPU kernel");
  }
}

template <typename q_t, typename c_t>
void decode_dispatch(const torch::Tensor& q, const torch::Tensor& kc, const torch::Tensor& vc,
                     const torch::Tensor& table, const torch::Tensor& lens, double scale,
                     torch::Tensor& out) {
  switch (kc.size(3)) {
    case 16: return dispatch_head_dim<q_t, c_t, 16>(q, kc, vc, table, lens, scale, out);
    case 32: return dispatch_head_dim<q_t, c_t, 32>(q, kc, vc, table, lens, scale, out);
    case 128: return dispatch_head_dim<q_t, c_t, 128>(q, kc, vc, table, lens, scale, out);
    default: TORCH_CHECK(false, "block_size must be 16, 32 or 128 for the CPU kernel");
  }
}

}  // namespace

void write_kv_cache(torch::Tensor k, torch::Tensor v, torch::Tensor key_cache,
                    torch::Tensor value_cache, torch::Tensor slot_mapping) {
  TORCH_CHECK(key_cache.is_contiguous() && value_cache.is_contiguous(), "contiguous caches");
  // A 16-bit cache under an fp32 model takes rounded K/V.
  k = k.to(key_cache.scalar_type()).contiguous();
  v = v.to(value_cache.scalar_type()).contiguous();
  slot_mapping = slot_mapping.to(torch::kInt64).contiguous();
  AT_DISPATCH_FLOATING_TYPES_AND2(at::kBFloat16, at::kHalf, k.scalar_type(), "write_kv_cache",
                                  [&] {
    write_kv_impl<scalar_t>(k, v, key_cache, value_cache, slot_mapping);
  });
}

torch::Tensor paged_decode_attention(torch::Tensor query, torch::Tensor key_cache,
                                     torch::Tensor value_cache, torch::Tensor block_table,
                                     torch::Tensor seq_lens, double scale) {
  TORCH_CHECK(key_cache.is_contiguous() && value_cache.is_contiguous(), "contiguous caches");
  TORCH_CHECK(query.size(1) % key_cache.size(1) == 0,
              "query heads must be a multiple of KV heads");
  query = query.contiguous();
  block_table = block_table.to(torch::kInt64).contiguous();
  seq_lens = seq_lens.to(torch::kInt64).contiguous();
  auto out = torch::empty_like(query);
  const auto cache_type = key_cache.scalar_type();
  if (query.scalar_type() == cache_type) {
    AT_DISPATCH_FLOATING_TYPES_AND2(at::kBFloat16, at::kHalf, cache_type, "paged_decode_attention",
                                    [&] {
      decode_dispatch<scalar_t, scalar_t>(query, key_cache, value_cache, block_table, seq_lens,
                                          scale, out);
    });
    return out;
  }
  // A 16-bit cache under an fp32 model: the query and the output stay fp32.
  TORCH_CHECK(query.scalar_type() == torch::kFloat32 &&
                  (cache_type == at::kBFloat16 || cache_type == at::kHalf),
              "query and cache dtypes: equal, or an fp32 query with a bf16/fp16 cache");
  if (cache_type == at::kBFloat16)
    decode_dispatch<float, at::BFloat16>(query, key_cache, value_cache, block_table, seq_lens,
                                         scale, out);
  else
    decode_dispatch<float, at::Half>(query, key_cache, value_cache, block_table, seq_lens, scale,
                                     out);
  return out;
}
