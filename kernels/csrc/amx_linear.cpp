// y = x W^T in bf16 on Intel AMX, for the row counts of decode steps. oneDNN's
// AMX kernels are built for big GEMMs; at 32-96 rows they read the weights at
// 8-13 GB/s where this kernel reaches 11-18 (bench/NOTES.md). Two things make
// the difference: the weights are packed once into the tile layout, so one
// block's weights are a single contiguous stream, and the next block is
// prefetched while the current one multiplies, so DRAM never idles during the
// tile math. Compiled only where the build host has AMX-BF16 (-march=native);
// elsewhere amx_bf16_available() is false and the linears use oneDNN.
#include <ATen/Parallel.h>
#include <ATen/core/Tensor.h>
#include <ATen/ops/empty.h>
#include <ATen/ops/zeros.h>

#include <algorithm>
#include <cstdint>

#include "amx_tiles.h"

namespace {

// One block: 32 output columns (two weight tiles side by side) by 32 rows.
constexpr int64_t kBlock = 32;

#ifdef LLMSERVE_AMX
using llmserve::amx_permitted;
using llmserve::kTileElems;
using llmserve::ThreadTiles;

// Rounds the fp32 sums of `rows` rows x 32 columns to bf16 (to nearest even).
inline void store_block(const float* sums, int64_t rows, at::BFloat16* out, int64_t N) {
  for (int64_t r = 0; r < rows; ++r) {
    const __m512 lo = _mm512_loadu_ps(sums + r * kBlock);
    const __m512 hi = _mm512_loadu_ps(sums + r * kBlock + 16);
    _mm512_storeu_si512(out + r * N, (__m512i)_mm512_cvtne2ps_pbh(hi, lo));
  }
}

// The 32 columns of one weight block for every row of x (padded to 32 rows),
// prefetching the next block's weights (K * 64 bytes) evenly over the passes.
// Tiles 0-3: the 2 x 2 sums of a 32 x 32 block; 4-5: two 16-row slices of x;
// 6-7: two 16-column slices of W.
void multiply_block(const at::BFloat16* x, int64_t padded_rows, int64_t M, int64_t K,
                    const at::BFloat16* w, at::BFloat16* out, int64_t N) {
  alignas(64) float sums[kBlock * kBlock];
  const int64_t k_steps = K / 32, block_bytes = K * 64;
  const int64_t prefetch_step = (block_bytes / (padded_rows / kBlock * k_steps) + 63) / 64 * 64;
  const char* next = reinterpret_cast<const char*>(w) + block_bytes;
  int64_t prefetched = 0;
  for (int64_t m0 = 0; m0 < padded_rows; m0 += kBlock) {
    _tile_zero(0); _tile_zero(1); _tile_zero(2); _tile_zero(3);
    const at::BFloat16* xm = x + m0 * K;
    for (int64_t kb = 0; kb < k_steps; ++kb) {
      const int64_t until = std::min(block_bytes, prefetched + prefetch_step);
      for (; prefetched < until; prefetched += 64) _mm_prefetch(next + prefetched, _MM_HINT_T0);
      _tile_loadd(4, xm + kb * 32, K * 2);
      _tile_loadd(5, xm + 16 * K + kb * 32, K * 2);
      _tile_loadd(6, w + (2 * kb) * kTileElems, 64);
      _tile_loadd(7, w + (2 * kb + 1) * kTileElems, 64);
      _tile_dpbf16ps(0, 4, 6);
      _tile_dpbf16ps(1, 4, 7);
      _tile_dpbf16ps(2, 5, 6);
      _tile_dpbf16ps(3, 5, 7);
    }
    _tile_stored(0, sums, kBlock * 4);
    _tile_stored(1, sums + 16, kBlock * 4);
    _tile_stored(2, sums + 16 * kBlock, kBlock * 4);
    _tile_stored(3, sums + 16 * kBlock + 16, kBlock * 4);
    store_block(sums, std::min(kBlock, M - m0), out + m0 * N, N);
  }
}

#endif  // LLMSERVE_AMX

}  // namespace

bool amx_bf16_available() {
#ifdef LLMSERVE_AMX
  return amx_permitted();
#else
  return false;
#endif
}

// x [M, K] bf16, packed [N / 32, K / 32, 1024] bf16 from pack_amx_weight
// (services/worker/cpu_linear.py) -> [M, N] bf16, with fp32 sums.
at::Tensor amx_bf16_linear(at::Tensor x, at::Tensor packed) {
  TORCH_CHECK(amx_bf16_available(), "amx_bf16_linear: this CPU or build has no AMX-BF16");
  const int64_t M = x.size(0), K = x.size(1), N = packed.size(0) * kBlock;
  TORCH_CHECK(x.scalar_type() == at::kBFloat16 && packed.scalar_type() == at::kBFloat16 &&
                  K % 32 == 0 && packed.size(1) == K / 32 && packed.is_contiguous(),
              "amx_bf16_linear: bf16 x [M, K], packed [N/32, K/32, 1024], K % 32 == 0");
  auto out = at::empty({M, N}, x.options());
  if (M == 0) return out;
#ifdef LLMSERVE_AMX
  // Tiles load 16 rows at a time: pad x to whole blocks with zero rows.
  const int64_t padded_rows = (M + kBlock - 1) / kBlock * kBlock;
  at::Tensor xp = x.contiguous();
  if (padded_rows != M) {
    xp = at::zeros({padded_rows, K}, x.options());
    xp.narrow(0, 0, M).copy_(x);
  }
  const auto* xd = xp.data_ptr<at::BFloat16>();
  const auto* wd = packed.data_ptr<at::BFloat16>();
  auto* od = out.data_ptr<at::BFloat16>();
  at::parallel_for(0, N / kBlock, 4, [&](int64_t begin, int64_t end) {
    ThreadTiles tiles;
    for (int64_t nb = begin; nb < end; ++nb)
      multiply_block(xd, padded_rows, M, K, wd + nb * K * kBlock, od + nb * kBlock, N);
  });
#endif
  return out;
}
