// Paged KV cache on the CPU: writing new tokens' K/V, and attention over it for
// decodes (one query token per sequence). The layout and the block walks it
// shares with prefills: paged_attention.h.
#include "paged_attention.h"

#include <ATen/Dispatch.h>
#include <ATen/Parallel.h>
#include <ATen/core/Tensor.h>
#include <ATen/ops/empty.h>

#include <algorithm>
#include <cmath>
#include <cstdint>
#include <vector>

#include "ops.h"
#include "vector_math.h"
#include "work_stealing.h"

namespace llmserve::paged {
namespace {

// k, v: [T, KV, D] with each token's heads contiguous (token stride free: they
// are usually views into the fused qkv projection's output).
template <typename scalar_t>
void write_kv_impl(const at::Tensor& k, const at::Tensor& v, at::Tensor& key_cache,
                   at::Tensor& value_cache, const at::Tensor& slot_mapping) {
  const int64_t T = k.size(0), KV = k.size(1), D = k.size(2);
  const int64_t bs = key_cache.size(3), k_stride = k.stride(0), v_stride = v.stride(0);
  const scalar_t* kp = k.data_ptr<scalar_t>();
  const scalar_t* vp = v.data_ptr<scalar_t>();
  scalar_t* kc = key_cache.data_ptr<scalar_t>();
  scalar_t* vc = value_cache.data_ptr<scalar_t>();
  const int64_t* slots = slot_mapping.data_ptr<int64_t>();
  at::parallel_for(0, T, 16, [&](int64_t begin, int64_t end) {
    for (int64_t t = begin; t < end; ++t) {
      const int64_t block = slots[t] / bs, offset = slots[t] % bs;
      for (int64_t h = 0; h < KV; ++h) {
        const scalar_t* ksrc = kp + t * k_stride + h * D;
        const scalar_t* vsrc = vp + t * v_stride + h * D;
        scalar_t* kdst = kc + (block * KV + h) * D * bs + offset;
        scalar_t* vdst = vc + ((block * KV + h) * bs + offset) * D;
        for (int64_t d = 0; d < D; ++d) kdst[d * bs] = ksrc[d];
        std::copy(vsrc, vsrc + D, vdst);
      }
    }
  });
}

// exp(score - top) in place over each head's scores, the ones past `len` first
// set to what exp() takes to ~0: the softmax runs over whole vectors, and the
// value pass reads only the first `len` weights anyway.
inline void softmax_heads(Scratch& s, int64_t heads, int64_t len, int64_t stride) {
  for (int64_t i = 0; i < heads; ++i) {
    float* scores = s.scores.data() + i * stride;
    std::fill(scores + len, scores + stride, -1e30f);
    s.sum[i] = softmax(scores, stride, s.top[i]);
  }
}

// KV head h's part of block n + stream_ahead_blocks of `walk` (counting on into
// `then`) where the walk asks for lines ahead (`ahead`: streams_ahead);
// otherwise nullptr.
template <int BS, int D, typename scalar_t>
inline const scalar_t* head_ahead(bool ahead, const Walk<scalar_t>& walk,
                                  const Walk<scalar_t>& then, int64_t n, int64_t h, int64_t block) {
  const scalar_t* b =
      ahead ? block_at(walk, then, n + stream_ahead_blocks<scalar_t>(), block) : nullptr;
  return b ? b + h * D * BS : nullptr;
}

// Whether a decode walks its keys and its values one block at a time, each
// block's KV heads in order: with AVX-512, off Intel. Passes over several blocks
// read a KV head's part of each in turn (streams a block apart); on a Zen 5,
// where a sequence's blocks are adjacent (as the engine allocates them), one
// block a pass read memory 8-11% faster for the keys (against four) and 8-10%
// for the values (against two), bf16 and fp32 (bench/NOTES.md). On the AMX Xeon
// keys four blocks a pass and values two had read faster than one; AVX2 keeps
// two blocks a key pass, as measured there.
inline bool walks_block_by_block() {
  return llmserve::kVectorRegisters >= 32 && !llmserve::cpu_is_intel();
}

// acc += p V for every query head over the value blocks, where `s` holds each
// head's exp(score - top): two blocks a pass where the pass's sums fit the
// registers twice (values_pair_of) and the walk is not block by block, the
// rest one at a time.
template <typename scalar_t, int BS, int D>
void walk_values(Scratch& s, const Walk<scalar_t>& values, const Walk<scalar_t>& next, int64_t len,
                 int64_t kv_heads, int64_t group, bool ahead) {
  constexpr int most = heads_per_pass<D>();
  const int64_t stride = values.blocks * BS, block = kv_heads * D * BS;
  const bool prefetch = prefetches_blocks<scalar_t>();
  const bool pairs = !walks_block_by_block() && std::min<int64_t>(most, group) <= pair_heads<D>();
  int64_t n = 0;
  for (; pairs && n + 2 <= values.blocks; n += 2) {
    for (int j = 0; prefetch && j < 2; ++j) prefetch_ahead(values, next, n + j, block);
    const int64_t valid_b = std::min<int64_t>(BS, len - (n + 1) * BS);
    const scalar_t* va = values.cache + values.row[n] * block;
    const scalar_t* vb = values.cache + values.row[n + 1] * block;
    for (int64_t h = 0; h < kv_heads; ++h)
      for (int64_t g = 0; g < group; g += most)
        values_pair_of<scalar_t, BS, D>(
            std::min<int64_t>(most, group - g), s.scores.data() + (h * group + g) * stride + n * BS,
            stride, valid_b, va + h * D * BS, vb + h * D * BS, s.acc.data() + (h * group + g) * D,
            g == 0 ? head_ahead<BS, D>(ahead, values, next, n, h, block) : nullptr,
            g == 0 ? head_ahead<BS, D>(ahead, values, next, n + 1, h, block) : nullptr);
  }
  for (; n < values.blocks; ++n) {
    if (prefetch) prefetch_ahead(values, next, n, block);
    const int64_t valid = std::min<int64_t>(BS, len - n * BS);
    for (int64_t h = 0; h < kv_heads; ++h)
      for (int64_t g = 0; g < group; g += most)
        values_of<scalar_t, D>(std::min<int64_t>(most, group - g),
                               s.scores.data() + (h * group + g) * stride + n * BS, stride, valid,
                               values.cache + values.row[n] * block + h * D * BS,
                               s.acc.data() + (h * group + g) * D,
                               g == 0 ? head_ahead<BS, D>(ahead, values, next, n, h, block)
                                      : nullptr);
  }
}

// Every query head of one sequence against its `len` tokens in blocks row[0],
// row[1], ...: one walk over the key blocks and one over the value blocks; the
// keys of the walk to follow (`next`, none when its blocks are 0) are asked for
// while the values end.
// Leaves per head, in s, the max score (top), the sum of exp(score - top) (sum)
// and the value sums weighted by those (acc). A block's K (or V) of consecutive
// KV heads is contiguous, so with all KV heads in one item a walk reads whole
// blocks in order: from memory, 1.3-1.45x (fp32) and 1.28x (bf16) the rate of
// one walk per KV head, 64 sequences with half their blocks adjacent.
// whole_sequence: the walk is a batch's item, not a chunk of a sequence
// (streams_ahead).
template <typename q_t, typename scalar_t, int BS, int D>
void attend(const q_t* q, const scalar_t* kc, const scalar_t* vc, const int64_t* row, int64_t len,
            int64_t kv_heads, int64_t group, double scale, Scratch& s, bool whole_sequence,
            const Walk<scalar_t>& next = {}) {
  constexpr int most = heads_per_pass<D>(), NB = blocks_per_pass<most>();
  const int64_t heads = kv_heads * group, num_blocks = (len + BS - 1) / BS;
  const int64_t stride = num_blocks * BS, block = kv_heads * D * BS;
  s.q.ensure(heads * D);
  s.scores.ensure(heads * stride);
  std::fill_n(s.acc.ensure(heads * D), heads * D, 0.f);
  s.top.ensure(heads);
  s.sum.ensure(heads);
  for (int64_t i = 0; i < heads * D; ++i) s.q[i] = static_cast<float>(q[i]) * scale;
  const bool prefetch = prefetches_blocks<scalar_t>();
  const bool ahead = streams_ahead<scalar_t>(whole_sequence);
  const Walk<scalar_t> keys{kc, row, num_blocks}, values{vc, row, num_blocks};
  const auto key_pass = [&](int64_t n, auto count) {
    constexpr int nb = decltype(count)::value;
    for (int j = 0; prefetch && j < nb; ++j) prefetch_ahead(keys, values, n + j, block);
    for (int64_t h = 0; h < kv_heads; ++h) {
      const scalar_t *kblocks[nb], *kahead[nb];
      for (int j = 0; j < nb; ++j) kblocks[j] = kc + row[n + j] * block + h * D * BS;
      for (int j = 0; j < nb; ++j)
        kahead[j] = head_ahead<BS, D>(ahead, keys, values, n + j, h, block);
      for (int64_t g = 0; g < group; g += most)  // the keys are in cache after g = 0
        scores_of<scalar_t, BS, D, nb>(
            std::min<int64_t>(most, group - g), s.q.data() + (h * group + g) * D, kblocks,
            s.scores.data() + (h * group + g) * stride + n * BS, stride, g == 0 ? kahead : nullptr);
    }
  };
  if (walks_block_by_block())
    in_block_groups<1>(num_blocks, key_pass);
  else
    in_block_groups<NB>(num_blocks, key_pass);
  softmax_heads(s, heads, len, stride);
  walk_values<scalar_t, BS, D>(s, values, next, len, kv_heads, group, ahead);
}

// One work item: out = softmax(q K^T * scale) V for every query head of one
// sequence.
template <typename q_t, typename scalar_t, int BS, int D>
void decode_item(const q_t* q, const scalar_t* kc, const scalar_t* vc, const int64_t* row,
                 int64_t len, int64_t kv_heads, int64_t group, double scale, q_t* out, Scratch& s,
                 const Walk<scalar_t>& next) {
  attend<q_t, scalar_t, BS, D>(q, kc, vc, row, len, kv_heads, group, scale, s, true, next);
  for (int64_t i = 0; i < kv_heads * group; ++i) {
    const float inv_sum = 1.f / s.sum[i];
    for (int c = 0; c < D / 16; ++c) {
      const vf16 sum = load16(s.acc.data() + i * D + c * 16);
      llmserve::store16(out + i * D + c * 16, sum * inv_sum);
    }
  }
}

// A sequence's blocks [n0, n1): one work item of a small batch.
struct DecodeChunk {
  int64_t seq, n0, n1;
};

// The fewest blocks a thread's run of chunks walks: below it the partials cost
// more to merge than the walk saves.
constexpr int64_t kMinChunkBlocks = 2;

// out[i] for each query head i of one sequence from its chunks' partials, each
// [heads * D value sums | heads tops | heads sums]: the softmax over all of its
// tokens, each chunk weighted by exp(its top - the overall top) (flash-decoding's
// merge).
template <typename q_t, int D>
void merge_chunks(const float* partial, int64_t chunks, int64_t heads, int64_t width,
                  q_t* out) {
  for (int64_t i = 0; i < heads; ++i) {
    float top = -INFINITY;
    for (int64_t c = 0; c < chunks; ++c) top = std::max(top, partial[c * width + heads * D + i]);
    float total = 0.f, acc[D] = {};
    for (int64_t c = 0; c < chunks; ++c) {
      const float* p = partial + c * width;
      const float w = std::exp(p[heads * D + i] - top);
      total += w * p[heads * D + heads + i];
      for (int d = 0; d < D; ++d) acc[d] += w * p[i * D + d];
    }
    for (int d = 0; d < D; ++d) out[i * D + d] = static_cast<q_t>(acc[d] / total);
  }
}

// Work items are whole sequences when there are enough of them to share out (4
// per thread). Fewer sequences (one stream's decode, a few) are cut into chunks
// of blocks, each with every KV head, merged after: every thread walks its share
// of whole blocks, whatever the number of KV heads (split by KV head, SmolLM2's 3
// gave one thread of two twice the other's work). Shared out with stealing, as
// the GEMM's (work_stealing.h).
template <typename q_t, typename scalar_t, int BS, int D>
struct Decode {
  // The step's tensors as both ways of sharing out the work read them.
  struct Batch {
    const q_t* q;
    const scalar_t *kc, *vc;
    const int64_t *table, *lens;
    q_t* out;
    int64_t B, H, KV, group, q_stride, max_blocks;
    double scale;
  };

  static void run(const at::Tensor& query, const at::Tensor& key_cache,
                  const at::Tensor& value_cache, const at::Tensor& block_table,
                  const at::Tensor& seq_lens, double scale, at::Tensor& out) {
    const int64_t H = query.size(1), KV = key_cache.size(1);
    const Batch x{query.data_ptr<q_t>(), key_cache.data_ptr<scalar_t>(),
                  value_cache.data_ptr<scalar_t>(), block_table.data_ptr<int64_t>(),
                  seq_lens.data_ptr<int64_t>(), out.data_ptr<q_t>(), query.size(0), H, KV,
                  H / KV, query.stride(0), block_table.size(1), scale};
    if (x.B < 4 * at::get_num_threads()) return chunked(x);
    llmserve::parallel_for_stealing(x.B, [&](auto& next) {
      llmserve::FlushDenormals flush;
      Scratch& scratch = thread_scratch();
      for (int64_t b; (b = next()) >= 0;)
        decode_item<q_t, scalar_t, BS, D>(x.q + b * x.q_stride, x.kc, x.vc,
                                          x.table + b * x.max_blocks, x.lens[b], x.KV, x.group,
                                          x.scale, x.out + b * x.H * D, scratch, keys_of(x, b + 1));
    });
  }

  // The keys of sequence b, which a thread usually takes after b - 1 (its own
  // range, front to back); none past the batch.
  static Walk<scalar_t> keys_of(const Batch& x, int64_t b) {
    if (b >= x.B) return {};
    return {x.kc, x.table + b * x.max_blocks, blocks_of(x, b)};
  }

  // The blocks sequence b's tokens fill.
  static int64_t blocks_of(const Batch& x, int64_t b) { return (x.lens[b] + BS - 1) / BS; }

  // The batch's blocks, sequence after sequence, cut into one run a thread of
  // equal length, and each run into chunks where sequences end; first[b] is
  // sequence b's first chunk. Chunks of a quarter of a run each were slower for
  // one stream: each chunk starts its walk cold and leaves a partial to merge
  // (bench/NOTES.md).
  static std::vector<DecodeChunk> cut(const Batch& x, std::vector<int64_t>& first) {
    int64_t total_blocks = 0;
    for (int64_t b = 0; b < x.B; ++b) total_blocks += blocks_of(x, b);
    const int64_t threads = at::get_num_threads();
    const int64_t run = std::max(kMinChunkBlocks, (total_blocks + threads - 1) / threads);
    std::vector<DecodeChunk> chunks;
    int64_t before = 0;  // the blocks of the sequences before b
    for (int64_t b = 0; b < x.B; ++b) {
      first[b] = static_cast<int64_t>(chunks.size());
      const int64_t num_blocks = blocks_of(x, b);
      for (int64_t n0 = 0, n1; n0 < num_blocks; n0 = n1) {
        n1 = std::min(num_blocks, ((before + n0) / run + 1) * run - before);
        chunks.push_back({b, n0, n1});
      }
      before += num_blocks;
    }
    first[x.B] = static_cast<int64_t>(chunks.size());
    return chunks;
  }

  static void chunked(const Batch& x) {
    std::vector<int64_t> first(x.B + 1);
    const std::vector<DecodeChunk> chunks = cut(x, first);
    const int64_t width = x.H * D + 2 * x.H;
    std::vector<float> partial(chunks.size() * width);
    llmserve::parallel_for_stealing(first[x.B], [&](auto& next) {
      llmserve::FlushDenormals flush;
      Scratch& s = thread_scratch();
      for (int64_t item; (item = next()) >= 0;) {
        const DecodeChunk& c = chunks[item];
        attend<q_t, scalar_t, BS, D>(x.q + c.seq * x.q_stride, x.kc, x.vc,
                                     x.table + c.seq * x.max_blocks + c.n0,
                                     std::min(x.lens[c.seq], c.n1 * BS) - c.n0 * BS, x.KV,
                                     x.group, x.scale, s, false);
        float* dst = partial.data() + item * width;
        std::copy_n(s.acc.data(), x.H * D, dst);
        std::copy_n(s.top.data(), x.H, dst + x.H * D);
        std::copy_n(s.sum.data(), x.H, dst + x.H * D + x.H);
      }
    });
    for (int64_t b = 0; b < x.B; ++b)
      merge_chunks<q_t, D>(partial.data() + first[b] * width, first[b + 1] - first[b], x.H,
                           width, x.out + b * x.H * D);
  }
};

}  // namespace
}  // namespace llmserve::paged

void write_kv_cache(at::Tensor k, at::Tensor v, at::Tensor key_cache, at::Tensor value_cache,
                    at::Tensor slot_mapping) {
  using namespace llmserve::paged;
  TORCH_CHECK(key_cache.is_contiguous() && value_cache.is_contiguous(), "contiguous caches");
  // A 16-bit cache under an fp32 model takes rounded K/V. Otherwise no copy: the
  // kernel reads k and v in place, views into the qkv projection.
  k = heads_contiguous(k.to(key_cache.scalar_type()));
  v = heads_contiguous(v.to(value_cache.scalar_type()));
  slot_mapping = slot_mapping.to(at::kLong).contiguous();
  AT_DISPATCH_FLOATING_TYPES_AND2(at::kBFloat16, at::kHalf, k.scalar_type(), "write_kv_cache",
                                  [&] {
    write_kv_impl<scalar_t>(k, v, key_cache, value_cache, slot_mapping);
  });
}

at::Tensor paged_decode_attention(at::Tensor query, at::Tensor key_cache, at::Tensor value_cache,
                                  at::Tensor block_table, at::Tensor seq_lens, double scale) {
  using namespace llmserve::paged;
  TORCH_CHECK(key_cache.is_contiguous() && value_cache.is_contiguous(), "contiguous caches");
  TORCH_CHECK(query.size(1) % key_cache.size(1) == 0,
              "query heads must be a multiple of KV heads");
  query = heads_contiguous(query);
  block_table = block_table.to(at::kLong).contiguous();
  seq_lens = seq_lens.to(at::kLong).contiguous();
  auto out = at::empty({query.size(0), query.size(1), query.size(2)}, query.options());
  dispatch_dtypes<Decode>(query, key_cache, value_cache, block_table, seq_lens, scale, out);
  return out;
}

