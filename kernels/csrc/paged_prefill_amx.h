// A bf16 prefill work item (paged_prefill.cpp) on AMX tiles: its scores Q K^T
// and its output P V as tile products, where the AVX-512 path multiplies 16
// lanes at a time. Each 16-token slice of K is turned into tiles once and serves
// all of the item's query rows; V's tokens are turned into tiles once per item.
// P is rounded to bf16 for its product, as FlashAttention rounds it; the
// softmax's sums stay fp32. Against fp32's logits, SmolLM2's bf16 prefill logits
// were as far off as with the AVX path's fp32 P; P as two bf16 parts (hi + lo)
// gained nothing measurable and took the PV product twice (bench/NOTES.md).
#pragma once

#include "amx_tiles.h"

#ifdef LLMSERVE_AMX
#include <ATen/core/Tensor.h>

#include <algorithm>
#include <cmath>
#include <cstdint>
#include <cstring>

#include "paged_attention.h"
#include "vector_math.h"

namespace llmserve::paged {

// An item's bf16 buffers, grown to the longest reach a thread meets: its query
// rows and probabilities, padded to whole tiles of 16 rows; one 16-token slice
// of K and the item's whole reach of V, in tile layout. Kept for the thread from
// call to call, as its Scratch.
struct TileScratch {
  Buffer<at::BFloat16> q, p, k, v;
};

inline TileScratch& thread_tile_scratch() {
  thread_local TileScratch s;
  return s;
}

inline int64_t round_up(int64_t n, int64_t to) { return (n + to - 1) / to * to; }

// Tokens [c, c + 16) of a [D][BS] block of keys as D / 32 right-hand tiles, one
// after another: row r of tile i holds the 16 tokens' (K[d][t], K[d + 1][t]) for
// d = 32 i + 2 r.
template <int BS, int D>
inline void key_tiles(const at::BFloat16* kblock, int c, at::BFloat16* tiles) {
  const __m512i interleave = pair_interleave();
  for (int r = 0; r < D / 2; ++r)
    store_pairs(tiles + r * 32, load_bf16x16(kblock + 2 * r * BS + c),
                load_bf16x16(kblock + (2 * r + 1) * BS + c), interleave);
}

// Unscaled scores of 16 query rows at a time (q: `padded` rows of D bf16) against
// the 16 tokens in `tiles`, into `scores` (rows `stride` floats apart). The K
// tiles stay in tiles 4-7 across the rows; a row tile goes through tile 1, the
// sums through tile 0.
template <int D>
inline void tile_scores(const at::BFloat16* q, int64_t padded, const at::BFloat16* tiles,
                        float* scores, int64_t stride) {
  static_assert(D % 32 == 0 && D <= 128, "head_dim: 32, 64, 96 or 128");
  _tile_loadd(4, tiles, 64);
  if constexpr (D >= 64) _tile_loadd(5, tiles + kTileElems, 64);
  if constexpr (D >= 96) _tile_loadd(6, tiles + 2 * kTileElems, 64);
  if constexpr (D >= 128) _tile_loadd(7, tiles + 3 * kTileElems, 64);
  for (int64_t r = 0; r < padded; r += 16) {
    const at::BFloat16* rows = q + r * D;
    _tile_zero(0);
    _tile_loadd(1, rows, D * 2);
    _tile_dpbf16ps(0, 1, 4);
    if constexpr (D >= 64) {
      _tile_loadd(2, rows + 32, D * 2);
      _tile_dpbf16ps(0, 2, 5);
    }
    if constexpr (D >= 96) {
      _tile_loadd(1, rows + 64, D * 2);
      _tile_dpbf16ps(0, 1, 6);
    }
    if constexpr (D >= 128) {
      _tile_loadd(2, rows + 96, D * 2);
      _tile_dpbf16ps(0, 2, 7);
    }
    _tile_stored(0, scores + r * stride, stride * 4);
  }
}

// Tokens [0, tokens) of a sequence's values (its blocks `row`, this KV head at
// `head` in each) as tiles: for each 32 tokens, D / 16 tiles, and row r of tile j
// holds (V[2r][d], V[2r + 1][d]) for the 16 dims d from 16 j. Tokens from `reach`
// on are zero: their probabilities are 0, and a cache slot nobody wrote may hold
// a NaN, which 0 would not cancel. Each item of a sequence turns its own reach
// into tiles again, a small cost beside the products.
template <int BS, int D>
void value_tiles(const at::BFloat16* vc, const int64_t* row, int64_t block, int64_t head,
                 int64_t reach, int64_t tokens, at::BFloat16* tiles) {
  const __m512i interleave = pair_interleave();
  const __m256i zero = _mm256_setzero_si256();
  auto token = [&](int64_t t, int j) {
    return t < reach ? load_bf16x16(vc + row[t / BS] * block + head + (t % BS) * D + j * 16) : zero;
  };
  for (int64_t t = 0; t < tokens; t += 2) {
    at::BFloat16* dst = tiles + t / 32 * (D / 16) * kTileElems + t % 32 / 2 * 32;
    for (int j = 0; j < D / 16; ++j)
      store_pairs(dst + j * kTileElems, token(t, j), token(t + 1, j), interleave);
  }
}

// acc[16][D] (rows D floats apart) = p[16][tokens] V for the J tiles of 16 dims
// from j0: sums in tiles 0 to J - 1, the probabilities through tile 4, V through
// tiles 5-7.
template <int D, int J>
inline void tile_values(const at::BFloat16* p, int64_t tokens, const at::BFloat16* vt, int j0,
                        float* acc) {
  _tile_zero(0);
  if constexpr (J >= 2) _tile_zero(1);
  if constexpr (J >= 3) _tile_zero(2);
  if constexpr (J >= 4) _tile_zero(3);
  for (int64_t t = 0; t < tokens; t += 32) {
    const at::BFloat16* v = vt + (t / 32 * (D / 16) + j0) * kTileElems;
    _tile_loadd(4, p + t, tokens * 2);
    _tile_loadd(5, v, 64);
    _tile_dpbf16ps(0, 4, 5);
    if constexpr (J >= 2) {
      _tile_loadd(6, v + kTileElems, 64);
      _tile_dpbf16ps(1, 4, 6);
    }
    if constexpr (J >= 3) {
      _tile_loadd(7, v + 2 * kTileElems, 64);
      _tile_dpbf16ps(2, 4, 7);
    }
    if constexpr (J >= 4) {
      _tile_loadd(5, v + 3 * kTileElems, 64);
      _tile_dpbf16ps(3, 4, 5);
    }
  }
  float* out = acc + j0 * 16;
  _tile_stored(0, out, D * 4);
  if constexpr (J >= 2) _tile_stored(1, out + 16, D * 4);
  if constexpr (J >= 3) _tile_stored(2, out + 32, D * 4);
  if constexpr (J >= 4) _tile_stored(3, out + 48, D * 4);
}

// P V for every 16 rows, four tiles of dims (64 values) at a time.
template <int D>
void tile_outputs(const at::BFloat16* p, int64_t padded, int64_t tokens, const at::BFloat16* vt,
                  float* acc) {
  for (int64_t r = 0; r < padded; r += 16) {
    const at::BFloat16* rows = p + r * tokens;
    float* out = acc + r * D;
    if constexpr (D == 32) tile_values<D, 2>(rows, tokens, vt, 0, out);
    if constexpr (D >= 64) tile_values<D, 4>(rows, tokens, vt, 0, out);
    if constexpr (D == 96) tile_values<D, 2>(rows, tokens, vt, 4, out);
    if constexpr (D == 128) tile_values<D, 4>(rows, tokens, vt, 4, out);
  }
}

// A query row's probabilities from its unscaled scores, as bf16 in p: exp(scale
// (score - max)) for keys [0, last], 0 after it up to `tokens`, in two passes
// over the scores (max, then exp), the keys past `last` never read. Returns the
// sum of the exps before rounding.
inline float probabilities(const float* scores, int64_t last, float scale, at::BFloat16* p,
                           int64_t tokens) {
  const int64_t seen = last + 1, whole = seen / 16 * 16;
  const __mmask16 tail = static_cast<__mmask16>((1u << (seen - whole)) - 1);
  __m512 top = _mm512_maskz_loadu_ps(tail, scores + whole);
  top = _mm512_mask_blend_ps(tail, _mm512_set1_ps(-INFINITY), top);
  for (int64_t t = 0; t < whole; t += 16) top = _mm512_max_ps(top, _mm512_loadu_ps(scores + t));
  const float m = _mm512_reduce_max_ps(top);
  vf16 sum = {};
  for (int64_t t = 0; t < whole; t += 16) {
    const vf16 e = fast_exp16((load16(scores + t) - m) * scale);
    sum += e;
    store16(p + t, e);
  }
  int64_t zero_from = whole;
  if (tail) {
    const vf16 e =
        (vf16)_mm512_maskz_mov_ps(tail, (__m512)fast_exp16((load16(scores + whole) - m) * scale));
    sum += e;
    store16(p + whole, e);
    zero_from += 16;
  }
  std::memset(p + zero_from, 0, (tokens - zero_from) * sizeof(at::BFloat16));
  return sum16(sum);
}

// prefill_item (paged_prefill.cpp) for a bf16 query and cache, on AMX tiles;
// the calling thread has configured them (ThreadTiles).
template <int BS, int D>
void prefill_item_tiles(const at::BFloat16* q, int64_t q_stride, const at::BFloat16* kc,
                        const at::BFloat16* vc, const int64_t* row, int64_t prefix, int64_t t0,
                        int64_t t1, int64_t kv_heads, int64_t group, int64_t h, double scale,
                        at::BFloat16* out, int64_t out_stride, Scratch& s, TileScratch& ts) {
  const int64_t rows = (t1 - t0) * group, padded = round_up(rows, 16), reach = prefix + t1;
  const int64_t num_blocks = (reach + BS - 1) / BS, stride = num_blocks * BS;
  const int64_t tokens = round_up(stride, 32), block = kv_heads * D * BS, head = h * D * BS;
  ts.q.ensure(padded * D);
  ts.p.ensure(padded * tokens);
  ts.k.ensure(D * 16);
  ts.v.ensure(tokens * D);
  s.scores.ensure(padded * stride);
  s.acc.ensure(padded * D);
  s.sum.ensure(rows);
  // Rows past the item's, up to a whole tile, multiply as zeros.
  std::memset(ts.q.data() + rows * D, 0, (padded - rows) * D * sizeof(at::BFloat16));
  std::memset(ts.p.data() + rows * tokens, 0, (padded - rows) * tokens * sizeof(at::BFloat16));
  for (int64_t i = 0; i < rows; ++i)
    std::memcpy(ts.q.data() + i * D, q + item_row_offset(i, t0, group, h, D, q_stride),
                D * sizeof(at::BFloat16));
  for (int64_t n = 0; n < num_blocks; ++n)
    for (int c = 0; c < BS; c += 16) {
      key_tiles<BS, D>(kc + row[n] * block + head, c, ts.k.data());
      tile_scores<D>(ts.q.data(), padded, ts.k.data(), s.scores.data() + n * BS + c, stride);
    }
  value_tiles<BS, D>(vc, row, block, head, reach, tokens, ts.v.data());
  for (int64_t i = 0; i < rows; ++i)
    s.sum[i] = probabilities(s.scores.data() + i * stride, prefix + t0 + i / group,
                             static_cast<float>(scale), ts.p.data() + i * tokens, tokens);
  tile_outputs<D>(ts.p.data(), padded, tokens, ts.v.data(), s.acc.data());
  store_item_rows<at::BFloat16, D>(s, rows, t0, group, h, out, out_stride);
}

}  // namespace llmserve::paged

#endif  // LLMSERVE_AMX
