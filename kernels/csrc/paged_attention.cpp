// Paged KV cache on the CPU: writing new tokens' K/V, and attention over it for
// decodes (one query token per sequence) and prefills (many, causal).
//
// Layout, per layer (see kernels/paged_attention.py):
//   key_cache   [num_blocks, kv_heads, head_dim, block_size]  (K transposed per block)
//   value_cache [num_blocks, kv_heads, block_size, head_dim]
// With K transposed, the scores of a whole block against one query head are
// head_dim vertical multiply-adds over block_size lanes (one AVX-512 register of
// 16 floats, two AVX2 ones): no horizontal reduction per token. A block's keys
// (and its values) are contiguous across its KV heads, so a sequence's walk over
// its blocks reads memory in order wherever its blocks are adjacent.
//
// Built for the host at first use (-march=native: AVX-512 or AVX2 code as the
// CPU has it); the loops are written so the compiler vectorizes them.
#include <ATen/ATen.h>
#include <ATen/Parallel.h>

#include <algorithm>
#include <cmath>
#include <cstdint>
#include <cstring>
#include <vector>

#include "vector_math.h"
#include "work_stealing.h"

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

using llmserve::load16;
using llmserve::vf16;

// The query heads of one KV head that one pass over its blocks serves: each
// K/V vector loaded is used by all of them. Their value sums (G x D/16 vectors)
// must stay within half the vector registers: four heads of 64 with AVX-512's 32,
// one with AVX2's 16 (where a vf16 takes two).
template <int D>
constexpr int heads_per_pass() {
  constexpr int fit = llmserve::kVectorRegisters / 2 / (D / 16 * llmserve::kRegistersPerVf16);
  return fit >= 4 ? 4 : (fit >= 2 ? 2 : 1);
}

// Scores of G query heads (scaled, fp32, [G][D]) against a block of keys
// [D][BS], into scores[g * stride + token]: BS/16 vectors of 16 tokens, each the
// sum over d of q[d] * K[d][16 tokens]. A independent sums per head, so that at
// least eight chains of multiply-adds are in flight.
template <typename scalar_t, int BS, int D, int G>
inline void block_scores(const float* q, const scalar_t* kblock, float* scores, int64_t stride) {
  constexpr int A = G >= 4 ? 2 : 4;
  for (int c = 0; c < BS; c += 16) {
    vf16 acc[G][A] = {};
    for (int d = 0; d < D; d += A) {
      for (int a = 0; a < A; ++a) {
        const vf16 k = llmserve::in_register(load16(kblock + (d + a) * BS + c));
        for (int g = 0; g < G; ++g) acc[g][a] += q[g * D + d + a] * k;
      }
    }
    for (int g = 0; g < G; ++g) {
      vf16 sum = acc[g][0];
      for (int a = 1; a < A; ++a) sum += acc[g][a];
      llmserve::store16(scores + g * stride + c, sum);
    }
  }
}

// acc[g] (D/16 vectors per head, in registers) += p[g][t] * V[t] over a block's
// first `valid` tokens; values [BS][D], weights p[g * stride + t]. With fewer
// than eight sums, even and odd tokens add into separate sets (P = 2), so that
// the adds do not wait on each other.
template <typename scalar_t, int D, int G, int P>
inline void block_values(const float* p, int64_t stride, int64_t valid, const scalar_t* vblock,
                         vf16 (&acc)[P][G][D / 16]) {
  int64_t t = 0;
  for (; t + P <= valid; t += P)
    for (int parity = 0; parity < P; ++parity)
      for (int c = 0; c < D / 16; ++c) {
        const vf16 v = llmserve::in_register(load16(vblock + (t + parity) * D + c * 16));
        for (int g = 0; g < G; ++g) acc[parity][g][c] += p[g * stride + t + parity] * v;
      }
  for (; t < valid; ++t)
    for (int c = 0; c < D / 16; ++c) {
      const vf16 v = llmserve::in_register(load16(vblock + t * D + c * 16));
      for (int g = 0; g < G; ++g) acc[0][g][c] += p[g * stride + t] * v;
    }
}

// Numerically stable softmax of `len` scores (a multiple of 16), in place:
// exp(score - max); returns their sum, and the max in `top`.
inline float softmax(float* s, int64_t len, float& top_out) {
  vf16 top = load16(s);
  for (int64_t t = 16; t < len; t += 16) {
    top = llmserve::max16(load16(s + t), top);
  }
  float m = top[0];
  for (int i = 1; i < 16; ++i) m = std::max(m, top[i]);
  top_out = m;
  vf16 sum = {};
  for (int64_t t = 0; t < len; t += 16) {
    const vf16 e = llmserve::fast_exp16(load16(s + t) - m);
    llmserve::store16(s + t, e);
    sum += e;
  }
  return llmserve::sum16(sum);
}

// Blocks are scattered pages, and hardware prefetchers stop at page boundaries:
// on Intel, ask for the block kPrefetchAhead on while this one is worked on, into
// L2 (prefetcht2; into L1, two whole blocks ahead crowd out the one in use; into
// L2, four ahead beat two). AMD treats the hints alike, into L1, and there any of
// these prefetches (two blocks ahead, one, a line a page) made decode slower than
// none: bench/NOTES.md.
constexpr int64_t kPrefetchAhead = 4;

inline bool prefetches_blocks() {
  static const bool intel = __builtin_cpu_is("intel");
  return intel;
}

template <typename scalar_t>
inline void prefetch_block(const scalar_t* block, int64_t elems) {
  const char* p = reinterpret_cast<const char*>(block);
  for (int64_t i = 0; i < elems * static_cast<int64_t>(sizeof(scalar_t)); i += 64)
    __builtin_prefetch(p + i, 0, 1);
}

// One walk over a sequence's blocks: of keys or of values.
template <typename scalar_t>
struct Walk {
  const scalar_t* cache;
  const int64_t* row;  // its block numbers
  int64_t blocks;
};

// At block n of `walk`, asks for the one kPrefetchAhead on: in this walk, else
// one of the first blocks of the walk after it (the values after the keys, the
// next sequence's keys after the values), which would otherwise begin on blocks
// nobody asked for.
template <typename scalar_t>
inline void prefetch_ahead(const Walk<scalar_t>& walk, const Walk<scalar_t>& then, int64_t n,
                           int64_t block) {
  const int64_t ahead = n + kPrefetchAhead;
  if (ahead < walk.blocks)
    prefetch_block(walk.cache + walk.row[ahead] * block, block);
  else if (ahead - walk.blocks < then.blocks)
    prefetch_block(then.cache + then.row[ahead - walk.blocks] * block, block);
}

// block_scores for `heads` (1 to heads_per_pass) query heads, chosen at run time.
template <typename scalar_t, int BS, int D>
inline void scores_of(int64_t heads, const float* q, const scalar_t* kblock, float* scores,
                      int64_t stride) {
  if (heads == 1) return block_scores<scalar_t, BS, D, 1>(q, kblock, scores, stride);
  if (heads == 2) return block_scores<scalar_t, BS, D, 2>(q, kblock, scores, stride);
  if constexpr (heads_per_pass<D>() == 4) {
    if (heads == 3) return block_scores<scalar_t, BS, D, 3>(q, kblock, scores, stride);
    block_scores<scalar_t, BS, D, 4>(q, kblock, scores, stride);
  }
}

// acc[G][D] (fp32, in memory between blocks) += p V over a block: block_values
// with the sums in registers for the block's duration.
template <typename scalar_t, int D, int G>
inline void add_values(const float* p, int64_t stride, int64_t valid, const scalar_t* vblock,
                       float* acc) {
  constexpr int P = G * D / 16 * llmserve::kRegistersPerVf16 >= 8 ? 1 : 2;
  vf16 sums[P][G][D / 16] = {};
  for (int g = 0; g < G; ++g)
    for (int c = 0; c < D / 16; ++c) sums[0][g][c] = load16(acc + g * D + c * 16);
  block_values<scalar_t, D, G, P>(p, stride, valid, vblock, sums);
  for (int g = 0; g < G; ++g)
    for (int c = 0; c < D / 16; ++c) {
      vf16 sum = sums[0][g][c];
      if constexpr (P == 2) sum += sums[1][g][c];
      llmserve::store16(acc + g * D + c * 16, sum);
    }
}

template <typename scalar_t, int D>
inline void values_of(int64_t heads, const float* p, int64_t stride, int64_t valid,
                      const scalar_t* vblock, float* acc) {
  if (heads == 1) return add_values<scalar_t, D, 1>(p, stride, valid, vblock, acc);
  if (heads == 2) return add_values<scalar_t, D, 2>(p, stride, valid, vblock, acc);
  if constexpr (heads_per_pass<D>() == 4) {
    if (heads == 3) return add_values<scalar_t, D, 3>(p, stride, valid, vblock, acc);
    add_values<scalar_t, D, 4>(p, stride, valid, vblock, acc);
  }
}

// Per-thread buffers, grown to the longest sequence a thread meets.
struct Scratch {
  std::vector<float> q, scores, acc, top, sum;
};

// Every query head of one sequence against its `len` tokens in blocks row[0],
// row[1], ...: one walk over the key blocks and one over the value blocks; the
// keys of the walk to follow (`next`, none when its blocks are 0) are asked for
// while the values end.
// Leaves per head, in s, the max score (top), the sum of exp(score - top) (sum)
// and the value sums weighted by those (acc). A block's K (or V) of consecutive
// KV heads is contiguous, so with all KV heads in one item a walk reads whole
// blocks in order: from memory, 1.3-1.45x (fp32) and 1.28x (bf16) the rate of
// one walk per KV head, 64 sequences with half their blocks adjacent.
template <typename q_t, typename scalar_t, int BS, int D>
void attend(const q_t* q, const scalar_t* kc, const scalar_t* vc, const int64_t* row, int64_t len,
            int64_t kv_heads, int64_t group, double scale, Scratch& s,
            const Walk<scalar_t>& next = {}) {
  constexpr int most = heads_per_pass<D>();
  const int64_t heads = kv_heads * group, num_blocks = (len + BS - 1) / BS;
  const int64_t stride = num_blocks * BS, block = kv_heads * D * BS;
  s.q.resize(heads * D);
  s.scores.resize(heads * stride);
  s.acc.assign(heads * D, 0.f);
  s.top.resize(heads);
  s.sum.resize(heads);
  for (int64_t i = 0; i < heads * D; ++i) s.q[i] = static_cast<float>(q[i]) * scale;
  const bool prefetch = prefetches_blocks();
  const Walk<scalar_t> keys{kc, row, num_blocks}, values{vc, row, num_blocks};
  for (int64_t n = 0; n < num_blocks; ++n) {
    if (prefetch) prefetch_ahead(keys, values, n, block);
    for (int64_t h = 0; h < kv_heads; ++h)
      for (int64_t g = 0; g < group; g += most)
        scores_of<scalar_t, BS, D>(std::min<int64_t>(most, group - g),
                                   s.q.data() + (h * group + g) * D,
                                   kc + row[n] * block + h * D * BS,
                                   s.scores.data() + (h * group + g) * stride + n * BS, stride);
  }
  for (int64_t i = 0; i < heads; ++i) {
    // Past the end, scores that exp() takes to ~0: the softmax runs over whole
    // vectors, and the value pass reads only the first `len` weights anyway.
    float* scores = s.scores.data() + i * stride;
    std::fill(scores + len, scores + stride, -1e30f);
    s.sum[i] = softmax(scores, stride, s.top[i]);
  }
  for (int64_t n = 0; n < num_blocks; ++n) {
    if (prefetch) prefetch_ahead(values, next, n, block);
    const int64_t valid = std::min<int64_t>(BS, len - n * BS);
    for (int64_t h = 0; h < kv_heads; ++h)
      for (int64_t g = 0; g < group; g += most)
        values_of<scalar_t, D>(std::min<int64_t>(most, group - g),
                               s.scores.data() + (h * group + g) * stride + n * BS, stride, valid,
                               vc + row[n] * block + h * D * BS,
                               s.acc.data() + (h * group + g) * D);
  }
}

// One work item: out = softmax(q K^T * scale) V for every query head of one
// sequence.
template <typename q_t, typename scalar_t, int BS, int D>
void decode_item(const q_t* q, const scalar_t* kc, const scalar_t* vc, const int64_t* row,
                 int64_t len, int64_t kv_heads, int64_t group, double scale, q_t* out, Scratch& s,
                 const Walk<scalar_t>& next) {
  attend<q_t, scalar_t, BS, D>(q, kc, vc, row, len, kv_heads, group, scale, s, next);
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

// The fewest blocks a chunk walks: below it the partials cost more to merge
// than the walk saves.
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
// of blocks, about 4 per thread in all, each with every KV head, merged after:
// every thread walks its share of whole blocks, whatever the number of KV heads
// (split by KV head, SmolLM2's 3 gave one thread of two twice the other's work).
// Shared out with stealing, as the GEMM's (work_stealing.h).
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
      Scratch scratch;
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
    return {x.kc, x.table + b * x.max_blocks, (x.lens[b] + BS - 1) / BS};
  }

  static void chunked(const Batch& x) {
    std::vector<int64_t> num_blocks(x.B);
    int64_t total_blocks = 0;
    for (int64_t b = 0; b < x.B; ++b) total_blocks += num_blocks[b] = (x.lens[b] + BS - 1) / BS;
    const int64_t items = 4 * at::get_num_threads();
    const int64_t per = std::max(kMinChunkBlocks, (total_blocks + items - 1) / items);
    std::vector<DecodeChunk> chunks;
    std::vector<int64_t> first(x.B + 1);
    for (int64_t b = 0; b < x.B; ++b) {
      first[b] = static_cast<int64_t>(chunks.size());
      for (int64_t n0 = 0; n0 < num_blocks[b]; n0 += per)
        chunks.push_back({b, n0, std::min(n0 + per, num_blocks[b])});
    }
    first[x.B] = static_cast<int64_t>(chunks.size());
    const int64_t width = x.H * D + 2 * x.H;
    std::vector<float> partial(chunks.size() * width);
    llmserve::parallel_for_stealing(first[x.B], [&](auto& next) {
      llmserve::FlushDenormals flush;
      Scratch s;
      for (int64_t item; (item = next()) >= 0;) {
        const DecodeChunk& c = chunks[item];
        attend<q_t, scalar_t, BS, D>(x.q + c.seq * x.q_stride, x.kc, x.vc,
                                     x.table + c.seq * x.max_blocks + c.n0,
                                     std::min(x.lens[c.seq], c.n1 * BS) - c.n0 * BS, x.KV,
                                     x.group, x.scale, s);
        float* dst = partial.data() + item * width;
        std::copy(s.acc.begin(), s.acc.begin() + x.H * D, dst);
        std::copy(s.top.begin(), s.top.begin() + x.H, dst + x.H * D);
        std::copy(s.sum.begin(), s.sum.begin() + x.H, dst + x.H * D + x.H);
      }
    });
    for (int64_t b = 0; b < x.B; ++b)
      merge_chunks<q_t, D>(partial.data() + first[b] * width, first[b + 1] - first[b], x.H,
                           width, x.out + b * x.H * D);
  }
};

// Query rows (positions x the query heads of one KV head) a prefill work item
// serves: each K/V vector it loads from L1 is used by all of them, and its
// scores stay within L2 for contexts of a few thousand tokens.
constexpr int64_t kPrefillRows = 48;

// One prefill work item: query positions [t0, t1) of one sequence, for the query
// heads of KV head h, attending causally to the cache (which already holds the
// step's own K/V): position t sees keys [0, prefix + t]. The walks are
// decode_item's, over `rows` query rows; a row's keys past its position get
// scores that exp() takes to 0, so every row can walk the tile's longest reach.
template <typename q_t, typename scalar_t, int BS, int D>
void prefill_item(const q_t* q, int64_t q_stride, const scalar_t* kc, const scalar_t* vc,
                  const int64_t* row, int64_t prefix, int64_t t0, int64_t t1, int64_t kv_heads,
                  int64_t group, int64_t h, double scale, q_t* out, int64_t out_stride,
                  Scratch& s) {
  constexpr int most = heads_per_pass<D>();
  const int64_t rows = (t1 - t0) * group, reach = prefix + t1;
  const int64_t num_blocks = (reach + BS - 1) / BS, stride = num_blocks * BS;
  const int64_t block = kv_heads * D * BS, head = h * D * BS;
  s.q.resize(rows * D);
  s.scores.resize(rows * stride);
  s.acc.assign(rows * D, 0.f);
  s.top.resize(rows);
  s.sum.resize(rows);
  for (int64_t i = 0; i < rows; ++i) {
    const q_t* src = q + (t0 + i / group) * q_stride + (h * group + i % group) * D;
    for (int64_t d = 0; d < D; ++d) s.q[i * D + d] = static_cast<float>(src[d]) * scale;
  }
  for (int64_t n = 0; n < num_blocks; ++n)
    for (int64_t i = 0; i < rows; i += most)
      scores_of<scalar_t, BS, D>(std::min<int64_t>(most, rows - i), s.q.data() + i * D,
                                 kc + row[n] * block + head,
                                 s.scores.data() + i * stride + n * BS, stride);
  for (int64_t i = 0; i < rows; ++i) {
    float* scores = s.scores.data() + i * stride;
    std::fill(scores + prefix + t0 + i / group + 1, scores + stride, -1e30f);
    s.sum[i] = softmax(scores, stride, s.top[i]);
  }
  for (int64_t n = 0; n < num_blocks; ++n) {
    const int64_t valid = std::min<int64_t>(BS, reach - n * BS);
    for (int64_t i = 0; i < rows; i += most)
      values_of<scalar_t, D>(std::min<int64_t>(most, rows - i),
                             s.scores.data() + i * stride + n * BS, stride, valid,
                             vc + row[n] * block + head, s.acc.data() + i * D);
  }
  for (int64_t i = 0; i < rows; ++i) {
    q_t* dst = out + (t0 + i / group) * out_stride + (h * group + i % group) * D;
    for (int c = 0; c < D / 16; ++c)
      llmserve::store16(dst + c * 16, load16(s.acc.data() + i * D + c * 16) * (1.f / s.sum[i]));
  }
}

struct PrefillTile {
  int64_t seq, kv_head, t0, t1;
};

// Every sequence with more than one query token, cut into tiles of positions
// per KV head. A tile's cost grows with its position, and parallel_for hands
// each thread one contiguous range: taking tiles alternately from both ends of
// the list gives every range a like share of cheap and costly ones.
template <typename q_t, typename scalar_t, int BS, int D>
struct Prefill {
  static void run(const at::Tensor& query, const at::Tensor& key_cache,
                  const at::Tensor& value_cache, const at::Tensor& block_table,
                  const at::Tensor& seq_lens, const at::Tensor& query_start_loc, double scale,
                  at::Tensor& out) {
    const int64_t H = query.size(1), KV = key_cache.size(1), group = H / KV;
    const int64_t positions = std::max<int64_t>(1, kPrefillRows / group);
    const int64_t* lens = seq_lens.data_ptr<int64_t>();
    const int64_t* starts = query_start_loc.data_ptr<int64_t>();
    std::vector<PrefillTile> tiles;
    for (int64_t b = 0; b < seq_lens.size(0); ++b) {
      const int64_t q_len = starts[b + 1] - starts[b];
      if (q_len < 2) continue;
      for (int64_t t0 = 0; t0 < q_len; t0 += positions)
        for (int64_t h = 0; h < KV; ++h)
          tiles.push_back({b, h, t0, std::min(t0 + positions, q_len)});
    }
    // The query may be a view into the qkv projection's rows (a token stride
    // wider than its heads): read in place, not copied first.
    const int64_t n = tiles.size(), q_stride = query.stride(0), o_stride = out.stride(0);
    const q_t* q = query.data_ptr<q_t>();
    const scalar_t* kc = key_cache.data_ptr<scalar_t>();
    const scalar_t* vc = value_cache.data_ptr<scalar_t>();
    const int64_t* table = block_table.data_ptr<int64_t>();
    q_t* o = out.data_ptr<q_t>();
    at::parallel_for(0, n, 1, [&](int64_t begin, int64_t end) {
      llmserve::FlushDenormals flush;
      Scratch scratch;
      for (int64_t k = begin; k < end; ++k) {
        const PrefillTile& t = tiles[k % 2 == 0 ? k / 2 : n - 1 - k / 2];
        const int64_t q_len = starts[t.seq + 1] - starts[t.seq];
        prefill_item<q_t, scalar_t, BS, D>(
            q + starts[t.seq] * q_stride, q_stride, kc, vc,
            table + t.seq * block_table.size(1), lens[t.seq] - q_len, t.t0, t.t1, KV, group,
            t.kv_head, scale, o + starts[t.seq] * o_stride, o_stride, scratch);
      }
    });
  }
};

// The block sizes and head dims the kernels are specialized for (registers and
// loop bounds fixed at compile time); kernels/paged_attention.py lists them.
template <template <typename, typename, int, int> class Kernel, typename q_t, typename c_t,
          int BS, typename... Args>
void dispatch_head_dim(int64_t head_dim, Args&... args) {
  switch (head_dim) {
    case 32: return Kernel<q_t, c_t, BS, 32>::run(args...);
    case 64: return Kernel<q_t, c_t, BS, 64>::run(args...);
    case 96: return Kernel<q_t, c_t, BS, 96>::run(args...);
    case 128: return Kernel<q_t, c_t, BS, 128>::run(args...);
    default: TORCH_CHECK(false, "head_dim must be 32, 64, 96 or 128 for the CPU kernel");
  }
}

template <template <typename, typename, int, int> class Kernel, typename q_t, typename c_t,
          typename... Args>
void dispatch_shape(int64_t block_size, int64_t head_dim, Args&... args) {
  switch (block_size) {
    case 16: return dispatch_head_dim<Kernel, q_t, c_t, 16>(head_dim, args...);
    case 32: return dispatch_head_dim<Kernel, q_t, c_t, 32>(head_dim, args...);
    case 128: return dispatch_head_dim<Kernel, q_t, c_t, 128>(head_dim, args...);
    default: TORCH_CHECK(false, "block_size must be 16, 32 or 128 for the CPU kernel");
  }
}

// Kernel over (query, key_cache, ...): the query and cache in one dtype, or an
// fp32 query (and output) over a 16-bit cache under an fp32 model.
template <template <typename, typename, int, int> class Kernel, typename... Args>
void dispatch_dtypes(const at::Tensor& query, const at::Tensor& key_cache, Args&... args) {
  const int64_t block_size = key_cache.size(3), head_dim = query.size(2);
  const auto cache_type = key_cache.scalar_type();
  if (query.scalar_type() == cache_type) {
    AT_DISPATCH_FLOATING_TYPES_AND2(at::kBFloat16, at::kHalf, cache_type, "paged_attention", [&] {
      dispatch_shape<Kernel, scalar_t, scalar_t>(block_size, head_dim, query, key_cache, args...);
    });
    return;
  }
  TORCH_CHECK(
      query.scalar_type() == at::kFloat && (cache_type == at::kBFloat16 || cache_type == at::kHalf),
      "query and cache dtypes: equal, or an fp32 query with a bf16/fp16 cache");
  if (cache_type == at::kBFloat16)
    dispatch_shape<Kernel, float, at::BFloat16>(block_size, head_dim, query, key_cache, args...);
  else
    dispatch_shape<Kernel, float, at::Half>(block_size, head_dim, query, key_cache, args...);
}

// [T, heads, D] with each token's heads contiguous, as the kernels read them (any
// token stride).
bool has_contiguous_heads(const at::Tensor& x) {
  return x.stride(2) == 1 && x.stride(1) == x.size(2);
}

// x itself where its heads are contiguous, else a contiguous copy.
at::Tensor heads_contiguous(const at::Tensor& x) {
  return has_contiguous_heads(x) ? x : x.contiguous();
}

}  // namespace

void write_kv_cache(at::Tensor k, at::Tensor v, at::Tensor key_cache, at::Tensor value_cache,
                    at::Tensor slot_mapping) {
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

void paged_prefill_attention(at::Tensor query, at::Tensor key_cache, at::Tensor value_cache,
                             at::Tensor block_table, at::Tensor seq_lens,
                             at::Tensor query_start_loc, double scale, at::Tensor out) {
  TORCH_CHECK(key_cache.is_contiguous() && value_cache.is_contiguous(), "contiguous caches");
  TORCH_CHECK(query.size(1) % key_cache.size(1) == 0,
              "query heads must be a multiple of KV heads");
  TORCH_CHECK(has_contiguous_heads(query) && out.is_contiguous() &&
                  out.sizes() == query.sizes() && out.scalar_type() == query.scalar_type(),
              "query and out: [tokens, heads, head_dim] of one dtype, each token's heads "
              "contiguous (out contiguous)");
  block_table = block_table.to(at::kLong).contiguous();
  seq_lens = seq_lens.to(at::kLong).contiguous();
  query_start_loc = query_start_loc.to(at::kLong).contiguous();
  TORCH_CHECK(query_start_loc.size(0) == seq_lens.size(0) + 1 &&
                  block_table.size(0) == seq_lens.size(0),
              "one block table row and seq_len per sequence, and one more query_start_loc");
  dispatch_dtypes<Prefill>(query, key_cache, value_cache, block_table, seq_lens,
                           query_start_loc, scale, out);
}
