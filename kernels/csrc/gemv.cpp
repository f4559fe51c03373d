// y = x W^T for a few rows of x (decode steps of one or a few sequences): the
// weights (fp32, bf16 or fp16) read once, front to back, at memory speed, 16-bit
// ones widened to fp32 in registers; the sums are fp32. GEMM libraries are built
// for many rows: at one row oneDNN streams the weights far slower than this
// kernel, which comes close to a bare sum over them (bench/NOTES.md). Works with
// AVX2 as with AVX-512 (widening bf16 is a shift), so it also serves 16-bit
// weights on CPUs without bf16 arithmetic.
#include <ATen/Dispatch_v2.h>
#include <ATen/Parallel.h>
#include <ATen/core/Tensor.h>
#include <ATen/ops/empty.h>

#include <cstdint>

#include "ops.h"
#include "vector_math.h"
#include "work_stealing.h"

namespace {

using llmserve::load16;
using llmserve::vf16;

constexpr int kMaxRows = 8;
// How far ahead of its loads a thread asks for its weights, where it asks at all
// (gemv_prefetches): into L2 one weight row at a time, into L1 eight at once
// (dot_rows_of_one). On an Intel Xeon, with the hardware
// prefetchers alone a pass over the weights read them well below the rate a
// copy reaches, 16-bit ones most (bench/NOTES.md). Near the end of a thread's
// rows the requests run into the next thread's, read anyway.
constexpr int kPrefetchBytes = 16384;

// Independent sums per row along K for M rows: two vf16 where the registers hold
// them and two vf16 of weights (always with AVX-512; up to 3 rows with AVX2),
// else one (a vf16's two halves are two chains of multiply-adds already).
template <int M>
constexpr int sums_per_row() {
  return (2 * M + 2) * llmserve::kRegistersPerVf16 <= llmserve::kVectorRegisters ? 2 : 1;
}
// Rows one pass over the weights serves: their sums and a step's weights within
// the vector registers (8 x 2 + 2 of AVX-512's 32; 6 x 2 + 2 of AVX2's 16).
constexpr int kRowsPerPass = llmserve::kVectorRegisters == 32 ? 8 : 6;

// One output's independent sums added in one order, whichever walk made them, so
// both walks give the same bits.
template <int S>
inline float row_total(const vf16 (&acc)[S]) {
  vf16 sum = acc[0];
  for (int s = 1; s < S; ++s) sum += acc[s];
  return llmserve::sum16(sum);
}

// out[m][n] for every row m of x and one weight row n, walking the weight row
// once, front to back (one sequential stream for the prefetchers), with
// independent sums along K so the multiply-adds pipeline. Two vf16, not four,
// with AVX-512: four streamed the weights measurably slower at one and two rows
// (bench/NOTES.md, "GEMV: two sums"); the loads, not the adds, set the pace.
// With AVX2, two (four registers) beat one by 5-8% at one and two rows.
template <typename w_t, int M>
inline void dot_row(const float* x, int64_t K, const w_t* wrow, float* out, int64_t N,
                    bool prefetch) {
  constexpr int S = sums_per_row<M>();
  vf16 acc[M][S] = {};
  int64_t k = 0;
  for (; k + 16 * S <= K; k += 16 * S) {
    if (prefetch) {
      const char* ahead = reinterpret_cast<const char*>(wrow + k) + kPrefetchBytes;
      for (int b = 0; b < int(16 * S * sizeof(w_t)); b += 64) __builtin_prefetch(ahead + b, 0, 2);
    }
    vf16 w[S];
    for (int s = 0; s < S; ++s) w[s] = load16(wrow + k + 16 * s);
    for (int m = 0; m < M; ++m)
      for (int s = 0; s < S; ++s) acc[m][s] += load16(x + m * K + k + 16 * s) * w[s];
  }
  for (; k < K; k += 16) {
    const vf16 w0 = load16(wrow + k);
    for (int m = 0; m < M; ++m) acc[m][0] += load16(x + m * K + k) * w0;
  }
  for (int m = 0; m < M; ++m) out[m * N] = row_total(acc[m]);
}

// One row of x against kWeightRowsAtOnce weight rows (out[0..R)), their loads
// interleaved along K and each row's line kPrefetchBytes ahead asked into L1:
// eight sequential streams a thread. Each row's sums run in dot_row<w_t, 1>'s
// order, so the results are its bits. On an Intel Xeon (Ice Lake) a one-row pass
// over fp32 weights ran faster this way, level with MKL's sgemv, which one row
// at a time asked into L2 trailed (bench/NOTES.md).
constexpr int kWeightRowsAtOnce = 8;

template <typename w_t>
inline void dot_rows_of_one(const float* x, int64_t K, const w_t* w, float* out) {
  constexpr int S = sums_per_row<1>(), R = kWeightRowsAtOnce;
  vf16 acc[R][S] = {};
  int64_t k = 0;
  for (; k + 16 * S <= K; k += 16 * S) {
    vf16 xs[S];
    for (int s = 0; s < S; ++s) xs[s] = load16(x + k + 16 * s);
    for (int r = 0; r < R; ++r) {
      const char* ahead = reinterpret_cast<const char*>(w + r * K + k) + kPrefetchBytes;
      for (int b = 0; b < int(16 * S * sizeof(w_t)); b += 64) __builtin_prefetch(ahead + b, 0, 3);
      for (int s = 0; s < S; ++s) acc[r][s] += xs[s] * load16(w + r * K + k + 16 * s);
    }
  }
  for (; k < K; k += 16)
    for (int r = 0; r < R; ++r) acc[r][0] += load16(x + k) * load16(w + r * K + k);
  for (int r = 0; r < R; ++r) out[r] = row_total(acc[r]);
}

template <typename w_t, int M>
void gemv_impl(const float* x, const w_t* w, int64_t N, int64_t K, float* out) {
  const bool prefetch = gemv_prefetches(c10::CppTypeToScalarType<w_t>::value);
  const bool rows_at_once =
      M == 1 && gemv_walks_rows_at_once(c10::CppTypeToScalarType<w_t>::value);
  // A static share of the weight rows a thread, then the last rows 8 at a time
  // (work_stealing.h): a call of a one-stream step is short.
  llmserve::parallel_for_shared_tail(N, 8, [&](int64_t begin, int64_t end) {
    llmserve::FlushDenormals flush;
    int64_t n = begin;
    if (rows_at_once)
      for (; n + kWeightRowsAtOnce <= end; n += kWeightRowsAtOnce)
        dot_rows_of_one(x, K, w + n * K, out + n);
    for (; n < end; ++n) dot_row<w_t, M>(x, K, w + n * K, out + n, N, prefetch);
  });
}

template <typename w_t>
void gemv_rows(const float* x, int64_t M, const w_t* w, int64_t N, int64_t K, float* out) {
  switch (M) {
    case 0: return;
    case 1: return gemv_impl<w_t, 1>(x, w, N, K, out);
    case 2: return gemv_impl<w_t, 2>(x, w, N, K, out);
    case 3: return gemv_impl<w_t, 3>(x, w, N, K, out);
    case 4: return gemv_impl<w_t, 4>(x, w, N, K, out);
    case 5: return gemv_impl<w_t, 5>(x, w, N, K, out);
    case 6: return gemv_impl<w_t, 6>(x, w, N, K, out);
  }
  if constexpr (kRowsPerPass == 8) {
    if (M == 7) return gemv_impl<w_t, 7>(x, w, N, K, out);
    return gemv_impl<w_t, 8>(x, w, N, K, out);
  }
  // Up to kMaxRows with fewer rows per pass: the weights twice.
  gemv_rows<w_t>(x, kRowsPerPass, w, N, K, out);
  gemv_rows<w_t>(x + kRowsPerPass * K, M - kRowsPerPass, w, N, K, out + kRowsPerPass * N);
}

}  // namespace

// Whether the GEMV asks for weights of this dtype ahead of its loads: on Intel,
// and 16-bit ones everywhere. AMD treats the hints alike, into L1
// (paged_attention.h); on Zen 3 and Zen 5 fp32 weights streamed faster with the
// hardware prefetchers alone, bf16 ones faster asked for (fp16 ones tied on
// Zen 3; bench/NOTES.md).
bool gemv_prefetches(at::ScalarType weight_dtype) {
  return llmserve::cpu_is_intel() || weight_dtype != at::kFloat;
}

// Whether a one-row call walks kWeightRowsAtOnce weight rows at a time: measured
// for fp32 weights on Intel with AVX-512 (eight rows' sums take 16 of its 32
// registers; AVX2 has 16 in all). Elsewhere unmeasured, so one row at a time.
bool gemv_walks_rows_at_once(at::ScalarType weight_dtype) {
  return llmserve::kVectorRegisters == 32 && weight_dtype == at::kFloat &&
         llmserve::cpu_is_intel();
}

// x [M, K] (fp32, bf16 or fp16), weight [N, K] fp32/bf16/fp16, K a multiple of
// 16, M <= 8 -> [M, N] in x's dtype. A 16-bit x is widened into scratch and the
// sums narrowed into the output here: as two tensor conversions around the
// kernel they cost 7-11% of a bf16 model's one-row pass over its weights.
at::Tensor gemv(at::Tensor x, at::Tensor weight) {
  const int64_t M = x.size(0), K = x.size(1), N = weight.size(0);
  TORCH_CHECK(M <= kMaxRows && K % 16 == 0 && weight.size(1) == K && weight.is_contiguous(),
              "gemv: x [M <= 8, K], weight [N, K] contiguous, K % 16 == 0");
  x = x.contiguous();
  auto out = at::empty({M, N}, x.options());
  const bool fp32 = x.scalar_type() == at::kFloat;
  float* xf = fp32 ? x.data_ptr<float>() : llmserve::scratch(0, M * K);
  float* outf = fp32 ? out.data_ptr<float>() : llmserve::scratch(1, M * N);
  if (!fp32) {
    AT_DISPATCH_V2(x.scalar_type(), "gemv", AT_WRAP([&] {
      llmserve::widen(x.data_ptr<scalar_t>(), xf, M * K);
    }), at::kBFloat16, at::kHalf);
  }
  // Any other weight dtype fails: "gemv" not implemented for it.
  AT_DISPATCH_V2(weight.scalar_type(), "gemv", AT_WRAP([&] {
    gemv_rows(xf, M, weight.data_ptr<scalar_t>(), N, K, outf);
  }), at::kFloat, at::kBFloat16, at::kHalf);
  if (!fp32) {
    AT_DISPATCH_V2(x.scalar_type(), "gemv", AT_WRAP([&] {
      llmserve::narrow(outf, out.data_ptr<scalar_t>(), M * N);
    }), at::kBFloat16, at::kHalf);
  }
  return out;
}
