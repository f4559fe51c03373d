// Decode attention over the paged KV cache, for the CPU (fp32).
//
// One query token per sequence. Each (sequence, KV head) pair is one work item:
// the keys and values of its context are read once, block by block through the
// block table, for all the query heads that share that KV head (GQA), with a
// numerically stable softmax. Parallel over work items with at::parallel_for, i.e.
// torch's own OpenMP thread pool and thread count.
#include <ATen/Parallel.h>
#include <torch/extension.h>

#include <algorithm>
#include <cmath>
#include <limits>
#include <vector>

torch::Tensor paged_decode_attention(torch::Tensor query,        // [B, H, D]
                                     torch::Tensor key_cache,    // [N, block_size, KV, D]
                                     torch::Tensor value_cache,  // [N, block_size, KV, D]
                                     torch::Tensor block_table,  // [B, max_blocks] int64
                                     torch::Tensor seq_lens,     // [B] int64
                                     double scale) {
  TORCH_CHECK(query.scalar_type() == torch::kFloat32, "fp32 only");
  TORCH_CHECK(key_cache.is_contiguous() && value_cache.is_contiguous(), "contiguous caches");
  query = query.contiguous();
  block_table = block_table.contiguous();
  seq_lens = seq_lens.contiguous();
  const int64_t B = query.size(0), H = query.size(1), D = query.size(2);
  const int64_t block_size = key_cache.size(1), KV = key_cache.size(2);
  const int64_t group = H / KV, max_blocks = block_table.size(1);
  TORCH_CHECK(H % KV == 0, "query heads must be a multiple of KV heads");
  auto out = torch::empty_like(query);
  const float* q = query.data_ptr<float>();
  const float* kc = key_cache.data_ptr<float>();
  const float* vc = value_cache.data_ptr<float>();
  const int64_t* table = block_table.data_ptr<int64_t>();
  const int64_t* lens = seq_lens.data_ptr<int64_t>();
  float* o = out.data_ptr<float>();
  const int64_t token_stride = KV * D;  // between consecutive tokens of a block

  at::parallel_for(0, B * KV, 1, [&](int64_t begin, int64_t end) {
    std::vector<float> scores, acc(group * D), total(group);
    for (int64_t item = begin; item < end; ++item) {
      const int64_t b = item / KV, kvh = item % KV;
      {
        const int64_t len = lens[b];
        scores.assign(group * len, 0.f);
        const float* qg = q + (b * H + kvh * group) * D;
        for (int64_t t = 0; t < len; ++t) {
          const int64_t block = table[b * max_blocks + t / block_size];
          const float* k = kc + (block * block_size + t % block_size) * token_stride + kvh * D;
          for (int64_t g = 0; g < group; ++g) {
            const float* qh = qg + g * D;
            float dot = 0.f;
#pragma omp simd reduction(+ : dot)
            for (int64_t d = 0; d < D; ++d) dot += qh[d] * k[d];
            scores[g * len + t] = dot * static_cast<float>(scale);
          }
        }
        for (int64_t g = 0; g < group; ++g) {
          float* s = scores.data() + g * len;
          float m = -std::numeric_limits<float>::max();  // -ffast-math assumes no infinities
#pragma omp simd reduction(max : m)
          for (int64_t t = 0; t < len; ++t) m = std::max(m, s[t]);
          float sum = 0.f;
          // Vectorized through glibc's libmvec (needs -ffast-math): a scalar exp
          // per score was most of the kernel's time.
#pragma omp simd reduction(+ : sum)
          for (int64_t t = 0; t < len; ++t) {
            s[t] = expf(s[t] - m);
            sum += s[t];
          }
          total[g] = sum;
        }
        std::fill(acc.begin(), acc.end(), 0.f);
        for (int64_t t = 0; t < len; ++t) {
          const int64_t block = table[b * max_blocks + t / block_size];
          const float* v = vc + (block * block_size + t % block_size) * token_stride + kvh * D;
          for (int64_t g = 0; g < group; ++g) {
            const float w = scores[g * len + t];
            float* a = acc.data() + g * D;
#pragma omp simd
            for (int64_t d = 0; d < D; ++d) a[d] += w * v[d];
          }
        }
        for (int64_t g = 0; g < group; ++g) {
          float* oh = o + (b * H + kvh * group + g) * D;
          for (int64_t d = 0; d < D; ++d) oh[d] = acc[g * D + d] / total[g];
        }
      }
    }
  });
  return out;
}

PYBIND11_MODULE(TORCH_EXTENSION_NAME, m) {
  m.def("paged_decode_attention", &paged_decode_attention,
        "Decode attention over the paged KV cache (CPU, fp32)");
}
