// The paged KV cache's layout on the CPU, and what the decode and prefill
// kernels (paged_attention.cpp, paged_prefill.cpp) share: a block's scores and
// value sums, the softmax, the prefetch of blocks ahead, the dispatch to the
// shapes they are compiled for.
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
// CPU has it); the loops are written so the compiler vectorizes them. Decode and
// prefill are two files so that the two cores compile their instantiations
// (dtypes x block sizes x head dims) side by side.
#pragma once

#include <ATen/Dispatch.h>
#include <ATen/core/Tensor.h>

#include <algorithm>
#include <cmath>
#include <cstdint>
#include <type_traits>

#include "vector_math.h"

namespace llmserve::paged {

// The query heads of one KV head that one pass over its blocks serves: each
// K/V vector loaded is used by all of them. Their value sums (G x D/16 vectors)
// must stay within half the vector registers: four heads of 64 with AVX-512's 32,
// one with AVX2's 16 (where a vf16 takes two).
template <int D>
constexpr int heads_per_pass() {
  constexpr int fit = llmserve::kVectorRegisters / 2 / (D / 16 * llmserve::kRegistersPerVf16);
  return fit >= 4 ? 4 : (fit >= 2 ? 2 : 1);
}

// Blocks of keys whose scores one pass takes together (NB): each query value,
// broadcast once, then serves NB key vectors instead of one. With one block a
// pass, a K vector cost a vector load and G broadcasts (G loads) for its G
// multiply-adds; decode attention streams K and V from memory, and on an Intel
// Xeon reads with three broadcast multiply-adds a line streamed a quarter to a
// third slower than the reads alone (bench/NOTES.md). As many blocks as fit the
// vector registers beside their sums (four with AVX-512's 32, two with AVX2).
template <int G>
constexpr int blocks_per_pass() {
  constexpr int budget = llmserve::kVectorRegisters - 4;
  for (int nb = 4; nb > 1; nb /= 2)
    if ((G * nb + nb) * llmserve::kRegistersPerVf16 <= budget) return nb;
  return 1;
}

// Independent sums a score takes over d, so that at least eight chains of
// multiply-adds are in flight where G x NB sums alone are fewer.
template <int G, int NB>
constexpr int partial_sums() {
  int a = 1;
  while (G * NB * a < 8 &&
         (G * NB * 2 * a + NB) * llmserve::kRegistersPerVf16 <= llmserve::kVectorRegisters - 4)
    a *= 2;
  return a;
}

// Asks for the line at `offset` (elements) of the block `ahead` (none: nullptr)
// where a line begins there, so each line once whatever the loads' order: blocks
// (and each KV head's part of one) begin on a line.
template <typename scalar_t>
inline void stream_line(const scalar_t* ahead, int64_t offset) {
  if (ahead && offset * static_cast<int64_t>(sizeof(scalar_t)) % 64 == 0)
    __builtin_prefetch(ahead + offset, 0, 3);
}

// Scores of G query heads (scaled, fp32, [G][D]) against NB blocks of keys, each
// [D][BS], into scores[g * stride + j * BS + token] for block j: BS/16 vectors of
// 16 tokens a block, each the sum over d of q[d] * K[d][16 tokens]. With `ahead`
// (for each block j, the one stream_ahead_blocks on; see streams_ahead), each line
// loaded asks for the line at the same place there.
// The loops over the sums are unrolled by pragma: left to GCC 12, one block a
// pass (A = 4 sums a score) kept its sums on the stack, and a decode read 7-9%
// slower for it (bench/NOTES.md).
template <typename scalar_t, int BS, int D, int G, int NB>
inline void block_scores(const float* q, const scalar_t* const* kblocks, float* scores,
                         int64_t stride, const scalar_t* const* ahead = nullptr) {
  constexpr int A = partial_sums<G, NB>();
  for (int c = 0; c < BS; c += 16) {
    vf16 acc[G][NB][A] = {};
    for (int d = 0; d < D; d += A) {
#pragma GCC unroll 8
      for (int a = 0; a < A; ++a) {
        vf16 k[NB];
        for (int j = 0; j < NB; ++j)
          k[j] = llmserve::in_register(load16(kblocks[j] + (d + a) * BS + c));
        for (int j = 0; ahead && j < NB; ++j) stream_line(ahead[j], (d + a) * BS + c);
#pragma GCC unroll 8
        for (int g = 0; g < G; ++g) {
          const float x = q[g * D + d + a];
#pragma GCC unroll 8
          for (int j = 0; j < NB; ++j) acc[g][j][a] += x * k[j];
        }
      }
    }
    for (int g = 0; g < G; ++g)
      for (int j = 0; j < NB; ++j) {
        vf16 sum = acc[g][j][0];
        for (int a = 1; a < A; ++a) sum += acc[g][j][a];
        llmserve::store16(scores + g * stride + j * BS + c, sum);
      }
  }
}

// f(n, count) for the blocks [0, num_blocks) in groups: `count` blocks from n,
// NB at a time, then one at a time; count is a std::integral_constant, so that
// each group size compiles to its own loop.
template <int NB, typename F>
inline void in_block_groups(int64_t num_blocks, F&& f) {
  int64_t n = 0;
  for (; n + NB <= num_blocks; n += NB) f(n, std::integral_constant<int, NB>{});
  for (; n < num_blocks; ++n) f(n, std::integral_constant<int, 1>{});
}

// f(count) for count = `heads` (1 to Most), chosen at run time; count is a
// std::integral_constant, so that each head count compiles to its own loop.
template <int Most, typename F>
inline void with_heads(int64_t heads, F&& f) {
  if constexpr (Most > 1)
    if (heads < Most) return with_heads<Most - 1>(heads, f);
  f(std::integral_constant<int, Most>{});
}

// acc[g] (D/16 vectors per head, in registers) += p[g][t] * V[t] over a block's
// first `valid` tokens; values [BS][D], weights p[g * stride + t]. With fewer
// than eight sums, even and odd tokens add into separate sets (P = 2), so that
// the adds do not wait on each other. `ahead` as block_scores's, one block.
template <typename scalar_t, int D, int G, int P>
inline void block_values(const float* p, int64_t stride, int64_t valid, const scalar_t* vblock,
                         vf16 (&acc)[P][G][D / 16], const scalar_t* ahead) {
  int64_t t = 0;
  for (; t + P <= valid; t += P)
    for (int parity = 0; parity < P; ++parity)
      for (int c = 0; c < D / 16; ++c) {
        const vf16 v = llmserve::in_register(load16(vblock + (t + parity) * D + c * 16));
        stream_line(ahead, (t + parity) * D + c * 16);
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
  // A halving tree: four dependent steps where a loop over the lanes took fifteen.
#if defined(__AVX512F__)
  const float m = _mm512_reduce_max_ps((__m512)top);
#else
  float m = top[0];
  for (int i = 1; i < 16; ++i) m = std::max(m, top[i]);
#endif
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
// on Intel, an fp32 walk asks for the block kPrefetchAhead on while this one is
// worked on, into L2 (prefetcht2; into L1, two whole blocks ahead crowd out the
// one in use; into L2, four ahead beat two). AMD treats the hints alike, into L1,
// and there whole blocks asked for (two blocks ahead, one, a line a page) made
// decode slower than none on Zen 4, and no faster on Zen 5: bench/NOTES.md.
// 16-bit walks ask a line at a time instead, on every CPU (streams_ahead).
constexpr int64_t kPrefetchAhead = 4;

template <typename scalar_t>
inline bool prefetches_blocks() {
  return llmserve::cpu_is_intel() && sizeof(scalar_t) == 4;
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

// Block i of `walk`, counting on into the walk after it (the values after the
// keys, the next sequence's keys after the values), which would otherwise begin
// on blocks nobody asked for; nullptr past both.
template <typename scalar_t>
inline const scalar_t* block_at(const Walk<scalar_t>& walk, const Walk<scalar_t>& then, int64_t i,
                                int64_t block) {
  if (i < walk.blocks) return walk.cache + walk.row[i] * block;
  if (i - walk.blocks < then.blocks) return then.cache + then.row[i - walk.blocks] * block;
  return nullptr;
}

// At block n of `walk`, asks for the one kPrefetchAhead on, whole.
template <typename scalar_t>
inline void prefetch_ahead(const Walk<scalar_t>& walk, const Walk<scalar_t>& then, int64_t n,
                           int64_t block) {
  if (const scalar_t* ahead = block_at(walk, then, n + kPrefetchAhead, block))
    prefetch_block(ahead, block);
}

// A walk's blocks come from memory faster where, as each line is loaded, it
// asks for the line at the same place some blocks on: one request a line,
// spread over the walk. 16-bit K and V streamed well below fp32's rate without
// it (presumably their widening holds up the loads); on Zen 5 whole blocks had
// not helped and lines did, and on the AMX Xeon lines read 16-bit caches at
// 1.4-1.6x the rate of whole blocks. fp32 walks ask too where a thread walks
// whole sequences (a batch of them) and does not ask for whole blocks (Intel
// keeps those, prefetches_blocks): on Zen 5 their lines took a decode batch's
// attention from 34-35 to 36-37 GB/s, where an earlier try had found no
// difference; one stream's chunks were 0.5% slower with them (bench/NOTES.md).
template <typename scalar_t>
inline bool streams_ahead(bool whole_sequences) {
  return sizeof(scalar_t) == 2 || (whole_sequences && !prefetches_blocks<scalar_t>());
}

// How many blocks on those lines are: the same bytes ahead for either width
// (8 blocks of 16-bit values, 4 of fp32), as measured best for each.
template <typename scalar_t>
constexpr int64_t stream_ahead_blocks() {
  return sizeof(scalar_t) == 2 ? 8 : 4;
}

// block_scores for `heads` (1 to heads_per_pass) query heads, chosen at run
// time, over NB blocks.
template <typename scalar_t, int BS, int D, int NB = 1>
inline void scores_of(int64_t heads, const float* q, const scalar_t* const* kblocks, float* scores,
                      int64_t stride, const scalar_t* const* ahead = nullptr) {
  with_heads<heads_per_pass<D>()>(heads, [&](auto g) {
    block_scores<scalar_t, BS, D, decltype(g)::value, NB>(q, kblocks, scores, stride, ahead);
  });
}

// acc[G][D] (fp32, in memory between blocks) += p V over a block: block_values
// with the sums in registers for the block's duration.
template <typename scalar_t, int D, int G>
inline void add_values(const float* p, int64_t stride, int64_t valid, const scalar_t* vblock,
                       float* acc, const scalar_t* ahead) {
  constexpr int P = G * D / 16 * llmserve::kRegistersPerVf16 >= 8 ? 1 : 2;
  vf16 sums[P][G][D / 16] = {};
  for (int g = 0; g < G; ++g)
    for (int c = 0; c < D / 16; ++c) sums[0][g][c] = load16(acc + g * D + c * 16);
  block_values<scalar_t, D, G, P>(p, stride, valid, vblock, sums, ahead);
  for (int g = 0; g < G; ++g)
    for (int c = 0; c < D / 16; ++c) {
      vf16 sum = sums[0][g][c];
      if constexpr (P == 2) sum += sums[1][g][c];
      llmserve::store16(acc + g * D + c * 16, sum);
    }
}

// The most query heads (G) whose value sums for two blocks at once (2 x G x
// D/16 vectors) fit the registers beside a vector of each block and G weights:
// three heads of 64 with AVX-512's 32; none with AVX2's 16 (0).
template <int D>
constexpr int pair_heads() {
  for (int g = 4; g > 0; --g)
    if ((2 * g * (D / 16) + 2 + g) * llmserve::kRegistersPerVf16 <= llmserve::kVectorRegisters)
      return g;
  return 0;
}

// add_values over two blocks at once, a token of each in turn: block a's
// weights at p[g * stride + t], block b's BS on; a full, b's first valid_b
// tokens. A block's value walk alone left its loads waiting on memory where
// the keys' (four blocks a pass) did not; two walks keep more lines in flight.
// Each block sums into its own set, added at the end.
template <typename scalar_t, int BS, int D, int G>
inline void add_values_pair(const float* p, int64_t stride, int64_t valid_b, const scalar_t* va,
                            const scalar_t* vb, float* acc, const scalar_t* ahead_a,
                            const scalar_t* ahead_b) {
  vf16 sums[2][G][D / 16] = {};
  for (int g = 0; g < G; ++g)
    for (int c = 0; c < D / 16; ++c) sums[0][g][c] = load16(acc + g * D + c * 16);
  int64_t t = 0;
  for (; t < valid_b; ++t)
    for (int c = 0; c < D / 16; ++c) {
      const vf16 a = llmserve::in_register(load16(va + t * D + c * 16));
      const vf16 b = llmserve::in_register(load16(vb + t * D + c * 16));
      stream_line(ahead_a, t * D + c * 16);
      stream_line(ahead_b, t * D + c * 16);
      for (int g = 0; g < G; ++g) {
        sums[0][g][c] += p[g * stride + t] * a;
        sums[1][g][c] += p[g * stride + BS + t] * b;
      }
    }
  for (; t < BS; ++t)
    for (int c = 0; c < D / 16; ++c) {
      const vf16 a = llmserve::in_register(load16(va + t * D + c * 16));
      stream_line(ahead_a, t * D + c * 16);
      for (int g = 0; g < G; ++g) sums[0][g][c] += p[g * stride + t] * a;
    }
  for (int g = 0; g < G; ++g)
    for (int c = 0; c < D / 16; ++c)
      llmserve::store16(acc + g * D + c * 16, sums[0][g][c] + sums[1][g][c]);
}

// add_values_pair for `heads` (1 to pair_heads) query heads, chosen at run time.
template <typename scalar_t, int BS, int D>
inline void values_pair_of(int64_t heads, const float* p, int64_t stride, int64_t valid_b,
                           const scalar_t* va, const scalar_t* vb, float* acc,
                           const scalar_t* ahead_a, const scalar_t* ahead_b) {
  if constexpr (pair_heads<D>() > 0)
    with_heads<pair_heads<D>()>(heads, [&](auto g) {
      add_values_pair<scalar_t, BS, D, decltype(g)::value>(p, stride, valid_b, va, vb, acc, ahead_a,
                                                           ahead_b);
    });
}

template <typename scalar_t, int D>
inline void values_of(int64_t heads, const float* p, int64_t stride, int64_t valid,
                      const scalar_t* vblock, float* acc, const scalar_t* ahead = nullptr) {
  with_heads<heads_per_pass<D>()>(heads, [&](auto g) {
    add_values<scalar_t, D, decltype(g)::value>(p, stride, valid, vblock, acc, ahead);
  });
}

// Per-thread buffers, grown to the longest sequence a thread meets.
struct Scratch {
  Buffer<float> q, scores, acc, top, sum;
  Buffer<uint32_t> qpairs;  // a bf16 prefill query's value pairs (paged_prefill.cpp)
};

// This thread's Scratch, kept from call to call (the calls of one step are a
// few hundred), the size of the largest item the thread has met.
inline Scratch& thread_scratch() {
  thread_local Scratch s;
  return s;
}

// Where a prefill item's query row i lies in a [T, heads, D] tensor whose tokens
// are `token_stride` apart: the item's rows run over the query heads of KV head
// h (group of them) for each of its positions from t0.
inline int64_t item_row_offset(int64_t i, int64_t t0, int64_t group, int64_t h, int64_t D,
                               int64_t token_stride) {
  return (t0 + i / group) * token_stride + (h * group + i % group) * D;
}

// A prefill item's output rows: each row's value sums (s.acc) over its softmax
// sum (s.sum), in the query's dtype.
template <typename q_t, int D>
inline void store_item_rows(const Scratch& s, int64_t rows, int64_t t0, int64_t group, int64_t h,
                            q_t* out, int64_t out_stride) {
  for (int64_t i = 0; i < rows; ++i) {
    q_t* dst = out + item_row_offset(i, t0, group, h, D, out_stride);
    for (int c = 0; c < D / 16; ++c)
      llmserve::store16(dst + c * 16, load16(s.acc.data() + i * D + c * 16) * (1.f / s.sum[i]));
  }
}

// The block sizes and head dims the kernels are specialized for (registers and
// loop bounds fixed at compile time); kernels/paged_attention.py lists them.
template <template <typename, typename, int, int> class Kernel, typename q_t, typename c_t, int BS,
          typename... Args>
void dispatch_head_dim(int64_t head_dim, Args&... args) {
  switch (head_dim) {
    case 32:
      return Kernel<q_t, c_t, BS, 32>::run(args...);
    case 64:
      return Kernel<q_t, c_t, BS, 64>::run(args...);
    case 96:
      return Kernel<q_t, c_t, BS, 96>::run(args...);
    case 128:
      return Kernel<q_t, c_t, BS, 128>::run(args...);
    default:
      TORCH_CHECK(false, "head_dim must be 32, 64, 96 or 128 for the CPU kernel");
  }
}

template <template <typename, typename, int, int> class Kernel, typename q_t, typename c_t,
          typename... Args>
void dispatch_shape(int64_t block_size, int64_t head_dim, Args&... args) {
  switch (block_size) {
    case 16:
      return dispatch_head_dim<Kernel, q_t, c_t, 16>(head_dim, args...);
    case 32:
      return dispatch_head_dim<Kernel, q_t, c_t, 32>(head_dim, args...);
    case 64:
      return dispatch_head_dim<Kernel, q_t, c_t, 64>(head_dim, args...);
    case 128:
      return dispatch_head_dim<Kernel, q_t, c_t, 128>(head_dim, args...);
    default:
      TORCH_CHECK(false, "block_size must be 16, 32, 64 or 128 for the CPU kernel");
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
inline bool has_contiguous_heads(const at::Tensor& x) {
  return x.stride(2) == 1 && x.stride(1) == x.size(2);
}

// x itself where its heads are contiguous, else a contiguous copy.
inline at::Tensor heads_contiguous(const at::Tensor& x) {
  return has_contiguous_heads(x) ? x : x.contiguous();
}

}  // namespace llmserve::paged
