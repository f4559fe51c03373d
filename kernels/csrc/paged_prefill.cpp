// Attention over the CPU's paged KV cache for prefills (many query tokens per
// sequence, causal), chunked ones included. The layout and the block walks it
// shares with decodes: paged_attention.h. On CPUs with AMX, a bf16 model's items
// multiply on tiles instead (paged_prefill_amx.h).
#include <ATen/Parallel.h>
#include <ATen/core/Tensor.h>

#include <algorithm>
#include <cmath>
#include <cstdint>
#include <cstring>
#include <optional>
#include <type_traits>
#include <vector>

#include "ops.h"
#include "paged_attention.h"
#include "paged_prefill_amx.h"
#include "vector_math.h"

namespace llmserve::paged {
namespace {

#if defined(__AVX512BF16__)
// A bf16 query against a bf16 cache multiplies bf16 pairs (VDPBF16PS): each
// query value pair (q[d], q[d + 1]) broadcast against 16 tokens' (K[d][t],
// K[d + 1][t]), interleaved from two rows of the block, serves two steps of d
// in one instruction where the widening path took two widenings and two
// multiply-adds. The products are exact in fp32 and the sums fp32; the scale
// multiplies the sums (exact where it is a power of two, as for D = 64). A
// prefill item's K vectors, loaded once from L1, serve its 48 query rows, so
// its scores wait on arithmetic, and pairs took time off prefill attention. A
// decode's scores wait on K streaming from memory and were no faster this way
// (bench/NOTES.md): decodes widen.
constexpr bool kBf16PairScores = true;

// 16 tokens' (K[d][t], K[d + 1][t]) pairs from rows d and d + 1 of a block.
template <int BS>
inline __m512bh key_pairs(const at::BFloat16* row, __m512i interleave) {
  return (__m512bh)interleave_pairs(load_bf16x16(row), load_bf16x16(row + BS), interleave);
}

// block_scores for a bf16 query (G heads, unscaled, as D / 2 pairs each) over NB
// bf16 blocks of keys; the scale applied to the sums. A independent sums a score
// (partial_sums), as the widening path takes them: with one block a pass its four
// heads' sums alone left each multiply-add waiting on the one before.
// Not inlined: inlined into a prefill item, GCC 12 kept the sums of one block a
// pass on the stack, and each multiply-add waited on a store and a load of its
// sum; the tails of one block a pass cost more than the passes of four
// (bench/NOTES.md).
template <int BS, int D, int G, int NB>
__attribute__((noinline)) void block_scores_pairs(const uint32_t* qpairs, float scale,
                                                  const at::BFloat16* const* kblocks,
                                                  float* scores, int64_t stride) {
  constexpr int A = partial_sums<G, NB>();
  static_assert(D % (2 * A) == 0, "head_dim: whole steps of A pairs");
  const __m512i interleave = pair_interleave();
  for (int c = 0; c < BS; c += 16) {
    __m512 acc[G][NB][A];
    for (int g = 0; g < G; ++g)
      for (int j = 0; j < NB; ++j)
        for (int a = 0; a < A; ++a) acc[g][j][a] = _mm512_setzero_ps();
    for (int d = 0; d < D; d += 2 * A) {
      for (int a = 0; a < A; ++a) {
        __m512bh k[NB];
        for (int j = 0; j < NB; ++j)
          k[j] = key_pairs<BS>(kblocks[j] + (d + 2 * a) * BS + c, interleave);
        for (int g = 0; g < G; ++g) {
          const __m512bh x = (__m512bh)_mm512_set1_epi32(qpairs[g * D / 2 + d / 2 + a]);
          for (int j = 0; j < NB; ++j) acc[g][j][a] = _mm512_dpbf16_ps(acc[g][j][a], x, k[j]);
        }
      }
    }
    for (int g = 0; g < G; ++g)
      for (int j = 0; j < NB; ++j) {
        __m512 sum = acc[g][j][0];
        for (int a = 1; a < A; ++a) sum = _mm512_add_ps(sum, acc[g][j][a]);
        _mm512_storeu_ps(scores + g * stride + j * BS + c,
                         _mm512_mul_ps(sum, _mm512_set1_ps(scale)));
      }
  }
}

template <int BS, int D, int NB = 1>
inline void scores_of_pairs(int64_t heads, const uint32_t* qpairs, float scale,
                            const at::BFloat16* const* kblocks, float* scores, int64_t stride) {
  with_heads<4>(heads, [&](auto g) {
    block_scores_pairs<BS, D, decltype(g)::value, NB>(qpairs, scale, kblocks, scores, stride);
  });
}
#else
constexpr bool kBf16PairScores = false;
#endif

// Whether the scores of a q_t query over a scalar_t cache multiply bf16 pairs
// (kBf16PairScores): both bf16, on a CPU with AVX512-BF16.
template <typename q_t, typename scalar_t>
constexpr bool kPairScores =
    kBf16PairScores && std::is_same_v<q_t, at::BFloat16> && std::is_same_v<scalar_t, at::BFloat16>;

// Room for `rows` query rows of D values as the scores read them.
template <typename q_t, typename scalar_t, int D>
inline void size_query(int64_t rows, Scratch& s) {
  if constexpr (kPairScores<q_t, scalar_t>)
    s.qpairs.ensure(rows * D / 2);
  else
    s.q.ensure(rows * D);
}

// Query row i from its D values at src: bf16 pairs as they are, or fp32 times
// the scale.
template <typename q_t, typename scalar_t, int D>
inline void load_query_row(const q_t* src, int64_t i, double scale, Scratch& s) {
  if constexpr (kPairScores<q_t, scalar_t>) {
    std::memcpy(s.qpairs.data() + i * D / 2, src, D * sizeof(q_t));
  } else {
    for (int64_t d = 0; d < D; ++d) s.q[i * D + d] = static_cast<float>(src[d]) * scale;
  }
}

// Scores of `heads` query rows from row `first` on against NB blocks, into
// their rows of s.scores from token `at`.
template <typename q_t, typename scalar_t, int BS, int D, int NB>
inline void query_scores(int64_t heads, int64_t first, Scratch& s, double scale,
                         const scalar_t* const* kblocks, int64_t stride, int64_t at) {
  float* scores = s.scores.data() + first * stride + at;
#if defined(__AVX512BF16__)
  if constexpr (kPairScores<q_t, scalar_t>) {
    scores_of_pairs<BS, D, NB>(heads, s.qpairs.data() + first * D / 2, static_cast<float>(scale),
                               kblocks, scores, stride);
    return;
  }
#endif
  scores_of<scalar_t, BS, D, NB>(heads, s.q.data() + first * D, kblocks, scores, stride);
}

// Query rows (positions x the query heads of one KV head) a prefill work item
// serves: each K/V vector it loads from L1 is used by all of them, and its
// scores stay within L2 for contexts of a few thousand tokens.
constexpr int64_t kPrefillRows = 48;

// One prefill work item: query positions [t0, t1) of one sequence, for the query
// heads of KV head h, attending causally to the cache (which already holds the
// step's own K/V): position t sees keys [0, prefix + t]. The walks are a
// decode's (attend, paged_attention.cpp), over `rows` query rows; a row's keys
// past its position get scores that exp() takes to 0, so every row can walk the
// tile's longest reach.
template <typename q_t, typename scalar_t, int BS, int D>
void prefill_item(const q_t* q, int64_t q_stride, const scalar_t* kc, const scalar_t* vc,
                  const int64_t* row, int64_t prefix, int64_t t0, int64_t t1, int64_t kv_heads,
                  int64_t group, int64_t h, double scale, q_t* out, int64_t out_stride,
                  Scratch& s) {
  constexpr int most = heads_per_pass<D>();
  const int64_t rows = (t1 - t0) * group, reach = prefix + t1;
  const int64_t num_blocks = (reach + BS - 1) / BS, stride = num_blocks * BS;
  const int64_t block = kv_heads * D * BS, head = h * D * BS;
  size_query<q_t, scalar_t, D>(rows, s);
  s.scores.ensure(rows * stride);
  std::fill_n(s.acc.ensure(rows * D), rows * D, 0.f);
  s.top.ensure(rows);
  s.sum.ensure(rows);
  for (int64_t i = 0; i < rows; ++i) {
    const q_t* src = q + item_row_offset(i, t0, group, h, D, q_stride);
    load_query_row<q_t, scalar_t, D>(src, i, scale, s);
  }
  in_block_groups<blocks_per_pass<most>()>(num_blocks, [&](int64_t n, auto count) {
    constexpr int nb = decltype(count)::value;
    const scalar_t* kblocks[nb];
    for (int j = 0; j < nb; ++j) kblocks[j] = kc + row[n + j] * block + head;
    for (int64_t i = 0; i < rows; i += most)
      query_scores<q_t, scalar_t, BS, D, nb>(std::min<int64_t>(most, rows - i), i, s, scale,
                                             kblocks, stride, n * BS);
  });
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
  store_item_rows<q_t, D>(s, rows, t0, group, h, out, out_stride);
}

// Where a thread's items take AMX tiles (paged_prefill_amx.h): a bf16 query and
// cache on a CPU with AMX-BF16, once the process may use it. Elsewhere on() is
// false and item() is never called.
template <typename q_t, typename scalar_t>
struct OnTiles {
  bool on() const { return false; }
  template <int BS, int D, typename... Args>
  void item(Args&&...) {}
};

#ifdef LLMSERVE_AMX
template <>
struct OnTiles<at::BFloat16, at::BFloat16> {
  std::optional<ThreadTiles> tiles;  // configured for the thread while it lives
  TileScratch& scratch = thread_tile_scratch();

  OnTiles() {
    if (amx_permitted()) tiles.emplace();
  }
  bool on() const { return tiles.has_value(); }
  template <int BS, int D, typename... Args>
  void item(Args&&... args) {
    prefill_item_tiles<BS, D>(args..., scratch);
  }
};
#endif

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
      Scratch& scratch = thread_scratch();
      OnTiles<q_t, scalar_t> amx;
      for (int64_t k = begin; k < end; ++k) {
        const PrefillTile& t = tiles[k % 2 == 0 ? k / 2 : n - 1 - k / 2];
        const int64_t q_len = starts[t.seq + 1] - starts[t.seq];
        const q_t* qs = q + starts[t.seq] * q_stride;
        const int64_t* row = table + t.seq * block_table.size(1);
        q_t* os = o + starts[t.seq] * o_stride;
        if (amx.on())
          amx.template item<BS, D>(qs, q_stride, kc, vc, row, lens[t.seq] - q_len, t.t0, t.t1, KV,
                                   group, t.kv_head, scale, os, o_stride, scratch);
        else
          prefill_item<q_t, scalar_t, BS, D>(qs, q_stride, kc, vc, row, lens[t.seq] - q_len, t.t0,
                                             t.t1, KV, group, t.kv_head, scale, os, o_stride,
                                             scratch);
      }
    });
  }
};

}  // namespace
}  // namespace llmserve::paged

void paged_prefill_attention(at::Tensor query, at::Tensor key_cache, at::Tensor value_cache,
                             at::Tensor block_table, at::Tensor seq_lens,
                             at::Tensor query_start_loc, double scale, at::Tensor out) {
  using namespace llmserve::paged;
  TORCH_CHECK(key_cache.is_contiguous() && value_cache.is_contiguous(), "contiguous caches");
  TORCH_CHECK(query.size(1) % key_cache.size(1) == 0, "query heads must be a multiple of KV heads");
  TORCH_CHECK(has_contiguous_heads(query) && out.is_contiguous() && out.sizes() == query.sizes() &&
                  out.scalar_type() == query.scalar_type(),
              "query and out: [tokens, heads, head_dim] of one dtype, each token's heads "
              "contiguous (out contiguous)");
  block_table = block_table.to(at::kLong).contiguous();
  seq_lens = seq_lens.to(at::kLong).contiguous();
  query_start_loc = query_start_loc.to(at::kLong).contiguous();
  TORCH_CHECK(
      query_start_loc.size(0) == seq_lens.size(0) + 1 && block_table.size(0) == seq_lens.size(0),
      "one block table row and seq_len per sequence, and one more query_start_loc");
  dispatch_dtypes<Prefill>(query, key_cache, value_cache, block_table, seq_lens, query_start_loc,
                           scale, out);
}
