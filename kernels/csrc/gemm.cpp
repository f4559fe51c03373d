// y = x W^T for any number of rows of x, on weights packed once into panels of
// kPanel output columns, 48 with AVX-512 (16 with AVX2): panel p holds
// W[kPanel p : kPanel (p + 1), :] transposed, [K][kPanel], front to back, in the
// weight's dtype (fp32, bf16 or fp16; fp32 sums always). A tile of up to 8 rows
// of x (6 with AVX2) walks one panel along K, its 8 x 48 sums in 24 AVX-512
// registers (6 x 16 in 12 AVX2 ones); each step loads the panel's row of vectors
// and broadcasts one value of each row (outer products, no horizontal sums); the
// fp32 tile with AVX-512 is assembly (gemm_tile_avx512.h says why). A
// thread keeps a panel in L2 while every row tile of a block of up to 256 rows
// passes over it, and meanwhile asks for the next, so the weights stream from
// memory once a block, in one sequential stream per thread, behind the arithmetic.
//
// Why not oneDNN's prepacked product, as vLLM-CPU uses: on the decode steps'
// shapes (tens of rows, N of 576-3072) it ran at 70-85% of an AMD EPYC's fp32
// peak with the weights in memory, against ~93% here, and ~95% of it with them
// in cache; on an Intel Xeon MKL's pack ran at 75-90% of this kernel's rate from
// 2 to 512 rows (bench/NOTES.md). With AVX2 on an AMD EPYC Zen 3, oneDNN ran at
// 0.54-0.82x this kernel's rate from 1 to 256 rows.
//
// gemm_silu_and_mul multiplies by an MLP's gate_up weight and applies the
// activation tile by tile, gate's panel and up's in turn, so the product (twice
// the MLP's width) is never written out and read back.
//
// bf16 models where the kernels are built with AVX512-BF16: the panels hold
// pairs of K ([K / 2][48][2]) and the tiles multiply bf16 by bf16 with VDPBF16PS,
// two steps of K for 16 columns an instruction, into the same fp32 sums, and
// store them rounded to bf16. On an AMD EPYC Zen 5 a pass over the model's
// linears ran 1.1-1.3x oneDNN's bf16 product from 8 to 256 rows, and tied it at
// 2,048, where the widening path ran at 0.5-0.6x it (bench/NOTES.md).
#include <ATen/Dispatch_v2.h>
#include <ATen/Parallel.h>
#include <ATen/core/Tensor.h>
#include <ATen/ops/constant_pad_nd.h>
#include <ATen/ops/empty.h>

#include <algorithm>
#include <cstdint>
#include <type_traits>

#include "vector_math.h"
#include "work_stealing.h"
#if defined(__AVX512F__)
#include "gemm_tile_avx512.h"
#endif

namespace {

using llmserve::load16;
using llmserve::store16;
using llmserve::vf16;

// Output columns a panel holds, and the rows of x a tile takes: with AVX-512,
// 48 columns (three vectors) and 8 rows, 24 sums of the 32 vector registers;
// with AVX2, 16 columns (two 8-float registers) and 6 rows, 12 sums, the panel's
// 2 and a broadcast: 15 of its 16 (the shape of BLIS's Haswell kernel).
constexpr bool kWide = llmserve::kVectorRegisters == 32;
constexpr int64_t kPanel = kWide ? 48 : 16;
constexpr int kVectors = kPanel / 16;
constexpr int kTileRows = kWide ? 8 : 6;

// The panel a thread most likely takes after this one (the next of its range,
// work_stealing.h), as stored: K x kPanel of the weight's dtype; none after the last.
struct NextPanel {
  const char* start = nullptr;
  int64_t bytes = 0;
};

template <typename T>
NextPanel next_panel(const T* panel, int64_t K, bool last) {
  if (last) return {};
  return {reinterpret_cast<const char*>(panel + K * kPanel), int64_t(K * kPanel * sizeof(T))};
}

// The part of the next panel that the t-th of `tiles` row tiles of this one
// prefetches into L2: lines [from, from + lines), spread evenly over the tile's
// K steps at `rate` lines a step (in 1/65536ths). Without it a panel's first
// tile waited on memory: with the weights out of cache our GEMM ran at 70% of
// its in-cache rate (bench/NOTES.md).
struct Prefetch {
  const char* from = nullptr;
  int64_t rate = 0;
};

Prefetch prefetch_part(NextPanel next, int64_t K, int64_t t, int64_t tiles) {
  if (next.start == nullptr) return {};
  const int64_t lines = next.bytes / 64;
  const int64_t first = lines * t / tiles, last = lines * (t + 1) / tiles;
  return {next.start + first * 64, ((last - first) << 16) / K};
}

// A panel as the tiles read it, fp32: itself, or a 16-bit one widened once into
// this thread's scratch `slot`, where every row tile then reads it from L2. The
// sums are fp32 either way: a 16-bit model's products are the fp32 path's, on
// the weights it holds (oneDNN's bf16 product ran at about half this kernel's
// rate on an Intel Xeon without AMX; bench/NOTES.md).
template <typename T>
const float* fp32_panel(const T* panel, int64_t K, int slot) {
  if constexpr (std::is_same_v<T, float>) {
    return panel;
  } else {
    float* out = llmserve::scratch(slot, K * kPanel);
    llmserve::widen(panel, out, K * kPanel);
    return out;
  }
}

// c[r][0:kPanel] = a[r] . panel for MR rows; c's rows are ldc apart. With
// AVX-512 the same loop in assembly (gemm_tile_avx512.h), the same sums.
template <int MR>
void tile(const float* a, int64_t lda, const float* panel, int64_t K, float* c, int64_t ldc,
          Prefetch pf) {
#if defined(__AVX512F__)
  static_assert(kPanel == 48);
  llmserve::gemm_asm::tile<MR>(a, lda, panel, K, c, ldc, pf.from, pf.rate);
#else
  vf16 acc[MR][kVectors] = {};
  for (int64_t k = 0; k < K; ++k) {
    if (pf.from != nullptr) __builtin_prefetch(pf.from + ((k * pf.rate) >> 16) * 64, 0, 2);
    vf16 b[kVectors];
    for (int v = 0; v < kVectors; ++v) b[v] = load16(panel + k * kPanel + 16 * v);
#pragma GCC unroll 8
    for (int r = 0; r < MR; ++r) {
      // A float, not a vf16: GCC then broadcasts it from memory (a load) where
      // `vf16{} + x` cost an add and a register broadcast on the FMA ports.
      const float x = a[r * lda + k];
      for (int v = 0; v < kVectors; ++v) acc[r][v] += x * b[v];
    }
  }
  for (int r = 0; r < MR; ++r)
    for (int v = 0; v < kVectors; ++v) store16(c + r * ldc + 16 * v, acc[r][v]);
#endif
}

#if defined(__AVX512BF16__)
constexpr bool kBf16Dot = true;

// The same tile for bf16 activations on a pair panel (pack_gemm_weight): row k/2
// of the panel holds W[col][k], W[col][k + 1] for each of its 48 columns, so one
// VDPBF16PS takes two steps of K for 16 columns: the products of bf16 values are
// exact in fp32 and add to fp32 sums, as the widening path's, with no widening.
template <int MR, typename O>
void tile(const at::BFloat16* a, int64_t lda, const at::BFloat16* panel, int64_t K, O* c,
          int64_t ldc, Prefetch pf) {
  __m512 acc[MR][kVectors];
  for (int r = 0; r < MR; ++r)
    for (int v = 0; v < kVectors; ++v) acc[r][v] = _mm512_setzero_ps();
  for (int64_t k = 0; k < K; k += 2) {
    if (pf.from != nullptr) {
      __builtin_prefetch(pf.from + ((k * pf.rate) >> 16) * 64, 0, 2);
      __builtin_prefetch(pf.from + (((k + 1) * pf.rate) >> 16) * 64, 0, 2);
    }
    const at::BFloat16* b = panel + k * kPanel;
    const __m512bh b0 = (__m512bh)_mm512_loadu_si512(b);
    const __m512bh b1 = (__m512bh)_mm512_loadu_si512(b + 32);
    const __m512bh b2 = (__m512bh)_mm512_loadu_si512(b + 64);
#pragma GCC unroll 8
    for (int r = 0; r < MR; ++r) {
      int32_t pair;
      std::memcpy(&pair, a + r * lda + k, sizeof pair);
      const __m512bh x = (__m512bh)_mm512_set1_epi32(pair);
      acc[r][0] = _mm512_dpbf16_ps(acc[r][0], x, b0);
      acc[r][1] = _mm512_dpbf16_ps(acc[r][1], x, b1);
      acc[r][2] = _mm512_dpbf16_ps(acc[r][2], x, b2);
    }
  }
  for (int r = 0; r < MR; ++r)
    for (int v = 0; v < kVectors; ++v) store16(c + r * ldc + 16 * v, acc[r][v]);
}
#else
constexpr bool kBf16Dot = false;
#endif

// The tile of each row count for activations of type A (on panels of A), sums
// stored as O: fp32, or (bf16 activations) rounded to bf16.
template <typename A, typename O>
using TileFn = void (*)(const A*, int64_t, const A*, int64_t, O*, int64_t, Prefetch);
// (Eight entries however many rows a tile takes; an AVX2 build calls up to tile<6>.)
static_assert(kTileRows <= 8);
template <typename A, typename O>
constexpr TileFn<A, O> kTiles[8 + 1] = {nullptr, tile<1>, tile<2>, tile<3>, tile<4>,
                                        tile<5>, tile<6>, tile<7>, tile<8>};

// Rows [r0, r1) of x against panel p, in tiles of at most kTileRows rows of near
// equal size (with AVX-512, 64 rows: eight of 8; 20 rows: 7, 7, 6). The last panel may hold
// fewer than kPanel real columns (zeros after them): its tiles go through a buffer.
template <typename A, typename O>
void panel_rows(const A* x, int64_t K, const A* panel, NextPanel next, int64_t r0, int64_t r1, O* y,
                int64_t N, int64_t col) {
  const int64_t cols = std::min(kPanel, N - col);
  const int64_t tiles = (r1 - r0 + kTileRows - 1) / kTileRows;
  O buffer[kTileRows * kPanel];
  for (int64_t t = 0; t < tiles; ++t) {
    const int64_t rows = (r1 - r0) / (tiles - t);
    O* out = cols == kPanel ? y + r0 * N + col : buffer;
    const TileFn<A, O> tile_of = kTiles<A, O>[rows];
    tile_of(x + r0 * K, K, panel, K, out, cols == kPanel ? N : kPanel,
            prefetch_part(next, K, t, tiles));
    for (int64_t r = 0; cols < kPanel && r < rows; ++r)
      std::copy(buffer + r * kPanel, buffer + r * kPanel + cols, y + (r0 + r) * N + col);
    r0 += rows;
  }
}

// silu(x W_gate^T) * (x W_up^T) for rows [r0, r1), on the kPanel output columns at
// `col` of gate panel `gate` and up panel `up` (the same columns of each half of
// W): both tiles and the product stay in L1, so gate_up's product, twice the
// output, never goes through memory (bench/NOTES.md). The same sums, the same
// silu and, for a 16-bit model, the same roundings to T as gemm then
// silu_and_mul (layers.cpp), so the same bits.
template <typename T, typename A, typename O>
void gated_panel_rows(const A* x, int64_t K, const A* gate, const A* up, NextPanel next_gate,
                      NextPanel next_up, int64_t r0, int64_t r1, O* y, int64_t n, int64_t col) {
  const int64_t tiles = (r1 - r0 + kTileRows - 1) / kTileRows;
  float g[kTileRows * kPanel], u[kTileRows * kPanel];
  for (int64_t t = 0; t < tiles; ++t) {
    const int64_t rows = (r1 - r0) / (tiles - t);
    const TileFn<A, float> tile_of = kTiles<A, float>[rows];
    tile_of(x + r0 * K, K, gate, K, g, kPanel, prefetch_part(next_gate, K, t, tiles));
    tile_of(x + r0 * K, K, up, K, u, kPanel, prefetch_part(next_up, K, t, tiles));
    // gemm's output is T, so silu_and_mul's input was rounded to it, and its
    // activation is before the product (which the caller narrows to T).
    llmserve::round_to<T>(g, rows * kPanel);
    llmserve::round_to<T>(u, rows * kPanel);
    for (int64_t r = 0; r < rows; ++r) {
      float* gr = g + r * kPanel;
      llmserve::silu(gr, kPanel);
      llmserve::round_to<T>(gr, kPanel);
      O* out = y + (r0 + r) * n + col;
      for (int v = 0; v < kVectors; ++v)
        store16(out + 16 * v, load16(gr + 16 * v) * load16(u + r * kPanel + 16 * v));
    }
    r0 += rows;
  }
}

// Rows a block holds at most: a block's rows of x stay in L2 while every panel
// passes over them. Above ~512 rows x left L2 and a panel's tiles read it from
// L3: 2,048-row products (a prefill step) ran 8-12% slower than the same rows
// in blocks of 256 (bench/NOTES.md).
constexpr int64_t kBlockRows = 256;

// Work items: a block of rows, a panel (of `panels`) and a group of that block's
// rows, block by block. Row groups only where the panels alone are too few to
// keep every thread busy (N of 576 is 12 panels). Stealing, not a static split:
// a thread that loses its core to another process for a while no longer holds
// the other at the end of every product.
template <typename Fn>
void for_panels_and_rows(int64_t panels, int64_t M, Fn&& fn) {
  const int64_t blocks = (M + kBlockRows - 1) / kBlockRows;
  const int64_t tiles = (M / blocks + kTileRows - 1) / kTileRows;
  const int64_t groups = std::clamp<int64_t>(2 * at::get_num_threads() / panels, 1, tiles);
  llmserve::parallel_for_stealing(blocks * panels * groups, [&](auto& next) {
    llmserve::FlushDenormals flush;
    for (int64_t item; (item = next()) >= 0;) {
      const int64_t b = item / (panels * groups), p = item / groups % panels, g = item % groups;
      const int64_t b0 = M * b / blocks, rows = M * (b + 1) / blocks - b0;
      fn(p, b0 + rows * g / groups, b0 + rows * (g + 1) / groups);
    }
  });
}

// A panel as tile<A> reads it: widened to fp32 (fp32_panel) for fp32 activations,
// as stored (a pair panel) for bf16 ones.
template <typename A, typename T>
const A* tile_panel(const T* panel, int64_t K, int slot) {
  if constexpr (std::is_same_v<A, float>) {
    return fp32_panel(panel, K, slot);
  } else {
    return panel;
  }
}

// y = x W^T, x [M, K] (fp32, or bf16 on pair panels) into y [M, n] of O (fp32,
// or bf16 for bf16 x), on packed panels of T.
template <typename A, typename T, typename O>
void gemm_impl(const A* x, int64_t M, int64_t K, const T* w, int64_t panels, O* y, int64_t n) {
  for_panels_and_rows(panels, M, [&](int64_t p, int64_t r0, int64_t r1) {
    const T* panel = w + p * K * kPanel;
    panel_rows<A, O>(x, K, tile_panel<A>(panel, K, 0), next_panel(panel, K, p + 1 == panels), r0,
                     r1, y, n, p * kPanel);
  });
}

// silu_and_mul of x W^T into y [M, n / 2], for a gate_up weight of n rows whose
// halves are whole panels; y as gemm_impl's.
template <typename A, typename T, typename O>
void gemm_silu_and_mul_impl(const A* x, int64_t M, int64_t K, const T* w, int64_t n, O* y) {
  const int64_t half = n / 2, panels = half / kPanel;
  for_panels_and_rows(panels, M, [&](int64_t p, int64_t r0, int64_t r1) {
    const T* gate = w + p * K * kPanel;
    const T* up = w + (p + panels) * K * kPanel;
    const bool last = p + 1 == panels;
    gated_panel_rows<T, A, O>(x, K, tile_panel<A>(gate, K, 0), tile_panel<A>(up, K, 1),
                              next_panel(gate, K, last), next_panel(up, K, last), r0, r1, y, half,
                              p * kPanel);
  });
}

bool packable(at::ScalarType type) {
  return type == at::kFloat || type == at::kBFloat16 || type == at::kHalf;
}

// Whether `packed` is a pair panels' pack (bf16 activations, VDPBF16PS): [panels,
// K / 2, 96]; else [panels, K, kPanel].
bool pair_panels(const at::Tensor& packed) { return packed.size(2) == 2 * kPanel; }

void check_packed(const at::Tensor& x, const at::Tensor& packed, const char* name) {
  TORCH_CHECK(x.dim() == 2 && packed.dim() == 3 &&
                  packed.size(1) * packed.size(2) == x.size(1) * kPanel &&
                  x.scalar_type() == packed.scalar_type() && packable(x.scalar_type()),
              name, ": x [M, K] and pack_gemm_weight's panels of a [n, K] weight, of one dtype ",
              "(fp32, bf16 or fp16)");
}

// x W^T over `packed` ([M, n]), or silu_and_mul of it ([M, n / 2]) with `gated`:
// bf16 on pair panels, else fp32 sums for the caller to round.
at::Tensor packed_product(const at::Tensor& x, const at::Tensor& packed, int64_t n, bool gated) {
  const int64_t M = x.size(0), K = x.size(1), cols = gated ? n / 2 : n;
  auto product = [&](const auto* xp, const auto* w, auto* out) {
    if (M == 0) return;
    if (gated)
      gemm_silu_and_mul_impl(xp, M, K, w, n, out);
    else
      gemm_impl(xp, M, K, w, packed.size(0), out, n);
  };
  if (pair_panels(packed)) {
#if defined(__AVX512BF16__)
    const auto xb = x.contiguous();
    auto y = at::empty({M, cols}, x.options());
    product(xb.data_ptr<at::BFloat16>(), packed.data_ptr<at::BFloat16>(),
            y.data_ptr<at::BFloat16>());
    return y;
#else
    TORCH_CHECK(false, "gemm: pair panels need kernels built with AVX512-BF16");
#endif
  }
  const auto x32 = x.to(at::kFloat).contiguous();
  auto y = at::empty({M, cols}, x32.options());
  AT_DISPATCH_V2(packed.scalar_type(), "gemm", AT_WRAP([&] {
                   product(x32.data_ptr<float>(), packed.data_ptr<scalar_t>(), y.data_ptr<float>());
                 }),
                 at::kFloat, at::kBFloat16, at::kHalf);
  return y;
}

}  // namespace

int64_t gemm_panel_columns() { return kPanel; }

bool gemm_bf16_dot_available() { return kBf16Dot; }

// weight [N, K] (fp32, bf16 or fp16) -> [panels, K, kPanel] of its dtype, zeros after
// its last row; a bf16 weight of even K, where the kernels are built with
// AVX512-BF16, -> pair panels [panels, K / 2, 96] (pair_panels).
at::Tensor pack_gemm_weight(at::Tensor weight) {
  TORCH_CHECK(weight.dim() == 2 && packable(weight.scalar_type()),
              "pack_gemm_weight: an fp32, bf16 or fp16 [N, K] weight");
  const int64_t N = weight.size(0), K = weight.size(1), panels = (N + kPanel - 1) / kPanel;
  // Zero rows up to whole panels, then each panel's rows transposed, in one copy.
  const auto padded = at::constant_pad_nd(weight, {0, 0, 0, panels * kPanel - N});
  if (kBf16Dot && weight.scalar_type() == at::kBFloat16 && K % 2 == 0)
    return padded.reshape({panels, kPanel, K / 2, 2})
        .permute({0, 2, 1, 3})
        .reshape({panels, K / 2, 2 * kPanel});
  return padded.reshape({panels, kPanel, K}).transpose(1, 2).contiguous();
}

// x: [M, K] of the packed weight's dtype; packed: pack_gemm_weight's panels; n:
// W's rows -> [M, n] in x's dtype (16-bit: the fp32 sums rounded once).
at::Tensor gemm(at::Tensor x, at::Tensor packed, int64_t n) {
  check_packed(x, packed, "gemm");
  TORCH_CHECK(packed.size(0) == (n + kPanel - 1) / kPanel, "gemm: pack_gemm_weight's panels of a ",
              "weight of ", n, " rows are ", (n + kPanel - 1) / kPanel, ", not ", packed.size(0));
  return packed_product(x, packed, n, false).to(x.scalar_type());
}

// silu_and_mul(gemm(x, packed, n)) in one pass, for a gate_up weight [n, K] whose
// halves (gate, then up) are whole panels: [M, n / 2].
at::Tensor gemm_silu_and_mul(at::Tensor x, at::Tensor packed, int64_t n) {
  check_packed(x, packed, "gemm_silu_and_mul");
  TORCH_CHECK(n % (2 * kPanel) == 0 && packed.size(0) == n / kPanel,
              "gemm_silu_and_mul: a [n, K] weight whose halves are multiples of ", kPanel, " rows");
  return packed_product(x, packed, n, true).to(x.scalar_type());
}
