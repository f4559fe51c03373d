// Greedy sampling: the argmax of each row of logits, rows in parallel (torch's
// argmax over the vocabulary runs on one thread). 16-bit logits are compared
// widened to fp32, which is exact, so a 16-bit model's greedy step needs no fp32
// copy of its logits (50 MB at 256 rows).
#include <ATen/Dispatch.h>
#include <ATen/Parallel.h>
#include <ATen/core/Tensor.h>
#include <ATen/ops/empty.h>

#include <algorithm>
#include <cstdint>

#include "vector_math.h"

namespace {

// One pass: each of 16 lanes keeps its running maximum and where it first saw
// it (strict >); then the largest lane value, at the smallest index among the
// lanes that hold it: the first maximal index, as torch.argmax returns. The
// indices are kept as floats, exact below 2^24, so that one select serves
// both (AVX2's vf16 is a pair of float registers, vector_math.h).
template <typename scalar_t>
int64_t argmax_row(const scalar_t* row, int64_t vocab) {
  using llmserve::vf16;
  if (vocab < 16) return std::max_element(row, row + vocab) - row;
  const float lanes[16] = {0, 1, 2, 3, 4, 5, 6, 7, 8, 9, 10, 11, 12, 13, 14, 15};
  vf16 best = llmserve::load16(row), best_at = llmserve::load16(lanes), at = best_at;
  int64_t i = 16;
  for (; i + 16 <= vocab; i += 16) {
    at += 16.f;
    const vf16 v = llmserve::load16(row + i);
    best_at = llmserve::where_greater(v, best, at, best_at);
    best = llmserve::max16(v, best);
  }
  float top = best[0];
  int64_t top_at = static_cast<int64_t>(best_at[0]);
  for (int lane = 1; lane < 16; ++lane) {
    const int64_t lane_at = static_cast<int64_t>(best_at[lane]);
    if (best[lane] > top || (best[lane] == top && lane_at < top_at))
      top = best[lane], top_at = lane_at;
  }
  for (; i < vocab; ++i)
    if (static_cast<float>(row[i]) > top) top = row[i], top_at = i;
  return top_at;
}

}  // namespace

at::Tensor argmax_rows(at::Tensor logits) {
  TORCH_CHECK(logits.dim() == 2 && logits.size(1) < (1 << 24),
              "logits: [rows, vocab < 2^24]");
  logits = logits.contiguous();
  const int64_t rows = logits.size(0), vocab = logits.size(1);
  auto out = at::empty({rows}, logits.options().dtype(at::kLong));
  int64_t* o = out.data_ptr<int64_t>();
  AT_DISPATCH_FLOATING_TYPES_AND2(at::kBFloat16, at::kHalf, logits.scalar_type(), "argmax_rows",
                                  [&] {
    const scalar_t* x = logits.data_ptr<scalar_t>();
    at::parallel_for(0, rows, 1, [&](int64_t begin, int64_t end) {
      llmserve::FlushDenormals flush;
      for (int64_t r = begin; r < end; ++r) o[r] = argmax_row(x + r * vocab, vocab);
    });
  });
  return out;
}
