// The element-wise layers of a Llama-family decoder, each one pass over memory
// instead of torch's several: RMSNorm (optionally fused with the residual add),
// rotary embedding applied in place to q and k, and SiLU(gate) * up.
//
// Rounding follows the transformers reference: RMSNorm computes in fp32, rounds
// the normalized value to the model dtype, then multiplies by the weight (two
// roundings in bf16, none in fp32). The sum of squares is a vectorized reduction,
// as torch's mean is, so it can differ from torch in the last bit.
#include <ATen/Dispatch.h>
#include <ATen/Parallel.h>
#include <ATen/core/Tensor.h>
#include <ATen/ops/empty.h>
#include <ATen/ops/empty_like.h>

#include <cmath>
#include <cstring>

#include "vector_math.h"

namespace {

// The kernels work a row at a time in fp32 scratch (vector_math.h: widen,
// narrow, round_to), so the bf16/fp16 conversions run 16 at a time; SiLU and
// the norm after a residual add keep their 16 lanes in registers (round16)
// from load to store, where the passes through scratch cost more than the math.

// A row's sum of squares: 16 lanes, each summed in order, then halved (sum16).
// Every norm here sums in this order, in one pass or two, so that
// fused_add_rms_norm's x is rms_norm(residual + x) to the bit.
inline float sum_squares(const float* v, int64_t n) {
  llmserve::vf16 acc = {};
  int64_t i = 0;
  for (; i + 16 <= n; i += 16) {
    const llmserve::vf16 a = llmserve::load16(v + i);
    acc += a * a;
  }
  if (i < n) {  // the tail through a zero-padded vector
    float tail[16] = {};
    std::memcpy(tail, v + i, (n - i) * sizeof(float));
    const llmserve::vf16 a = llmserve::load16(tail);
    acc += a * a;
  }
  return llmserve::sum16(acc);
}

// v (a row, exactly representable in T) -> out = rms_norm(v) * w; v is clobbered.
template <typename scalar_t>
inline void rms_norm_row(float* v, const float* w, int64_t n, double eps, scalar_t* out) {
  const float sum_sq = sum_squares(v, n);
  const float inv = 1.f / std::sqrt(sum_sq / static_cast<float>(n) + static_cast<float>(eps));
#pragma omp simd
  for (int64_t i = 0; i < n; ++i) v[i] *= inv;
  llmserve::round_to<scalar_t>(v, n);
#pragma omp simd
  for (int64_t i = 0; i < n; ++i) v[i] *= w[i];
  llmserve::narrow(v, out, n);
}

template <typename scalar_t>
void rms_norm_impl(const at::Tensor& x, const at::Tensor& weight, double eps, at::Tensor& out) {
  const int64_t n = x.size(-1), rows = x.numel() / n;
  const scalar_t* xp = x.data_ptr<scalar_t>();
  const scalar_t* wp = weight.data_ptr<scalar_t>();
  scalar_t* op = out.data_ptr<scalar_t>();
  at::parallel_for(0, rows, 16, [&](int64_t begin, int64_t end) {
    llmserve::FlushDenormals flush;
    float* v = llmserve::scratch(0, n);
    float* w = llmserve::scratch(1, n);
    llmserve::widen(wp, w, n);
    for (int64_t r = begin; r < end; ++r) {
      llmserve::widen(xp + r * n, v, n);
      rms_norm_row(v, w, n, eps, op + r * n);
    }
  });
}

// One row of add_rms_norm_impl whose width is whole vectors, in two passes over
// registers where rms_norm_row's steps took eight through scratch: residual +=
// x, rounded to T, kept in v as its squares are summed (as sum_squares sums
// them); then x = rms_norm(v) * w. The same arithmetic as rms_norm_row's.
template <typename scalar_t>
inline void add_rms_norm_vectors(scalar_t* xr, scalar_t* rr, float* v, const float* w, int64_t n,
                                 double eps) {
  using llmserve::load16;
  using llmserve::vf16;
  vf16 sum_sq = {};
  for (int64_t i = 0; i < n; i += 16) {
    const vf16 sum = llmserve::round16<scalar_t>(load16(rr + i) + load16(xr + i));
    llmserve::store16(rr + i, sum);
    llmserve::store16(v + i, sum);
    sum_sq += sum * sum;
  }
  const float mean = llmserve::sum16(sum_sq) / static_cast<float>(n);
  const float inv = 1.f / std::sqrt(mean + static_cast<float>(eps));
  for (int64_t i = 0; i < n; i += 16)
    llmserve::store16(xr + i, llmserve::round16<scalar_t>(load16(v + i) * inv) * load16(w + i));
}

// residual += x; x = rms_norm(residual), row by row, in place.
template <typename scalar_t>
void add_rms_norm_impl(at::Tensor& x, at::Tensor& residual, const at::Tensor& weight, double eps) {
  const int64_t n = x.size(-1), rows = x.numel() / n;
  scalar_t* xp = x.data_ptr<scalar_t>();
  scalar_t* rp = residual.data_ptr<scalar_t>();
  const scalar_t* wp = weight.data_ptr<scalar_t>();
  at::parallel_for(0, rows, 16, [&](int64_t begin, int64_t end) {
    llmserve::FlushDenormals flush;
    float* v = llmserve::scratch(0, n);
    float* w = llmserve::scratch(1, n);
    float* add = llmserve::scratch(2, n);
    llmserve::widen(wp, w, n);
    for (int64_t r = begin; r < end; ++r) {
      scalar_t* xr = xp + r * n;
      scalar_t* rr = rp + r * n;
      if (n % 16 == 0) {
        add_rms_norm_vectors(xr, rr, v, w, n, eps);
        continue;
      }
      llmserve::widen(rr, v, n);
      llmserve::widen(xr, add, n);
#pragma omp simd
      for (int64_t i = 0; i < n; ++i) v[i] += add[i];
      llmserve::round_to<scalar_t>(v, n);
      llmserve::narrow(v, rr, n);
      rms_norm_row(v, w, n, eps, xr);
    }
  });
}

// Rotates each head's two halves by its token's angle: x1' = x1 cos - x2 sin,
// x2' = x2 cos + x1 sin (the "rotate half" form transformers uses). s: scratch
// for the head (2 * half floats).
template <typename scalar_t>
inline void rotate_head(scalar_t* x, const float* cos, const float* sin, int64_t half,
                        float* s) {
  llmserve::widen(x, s, 2 * half);
  float* x1 = s;
  float* x2 = s + half;
#pragma omp simd
  for (int64_t i = 0; i < half; ++i) {
    const float a1 = x1[i], a2 = x2[i], c = cos[i], sn = sin[i];
    // Two products then a sum, each rounded, as torch's x * cos + rotate_half(x) * sin.
    const float a = a1 * c, b = a2 * sn, e = a2 * c, f = a1 * sn;
    x1[i] = a - b;
    x2[i] = e + f;
  }
  llmserve::narrow(s, x, 2 * half);
}

template <typename scalar_t>
void rotary_impl(at::Tensor& q, at::Tensor& k, const at::Tensor& positions,
                 const at::Tensor& cos_sin) {
  const int64_t T = q.size(0), H = q.size(1), KV = k.size(1), D = q.size(2), half = D / 2;
  const int64_t q_stride = q.stride(0), k_stride = k.stride(0);
  scalar_t* qp = q.data_ptr<scalar_t>();
  scalar_t* kp = k.data_ptr<scalar_t>();
  const int64_t* pos = positions.data_ptr<int64_t>();
  const float* table = cos_sin.data_ptr<float>();  // [max_positions, 2, half]
  at::parallel_for(0, T, 16, [&](int64_t begin, int64_t end) {
    llmserve::FlushDenormals flush;
    float* s = llmserve::scratch(0, D);
    for (int64_t t = begin; t < end; ++t) {
      const float* cos = table + pos[t] * 2 * half;
      const float* sin = cos + half;
      for (int64_t h = 0; h < H; ++h) rotate_head(qp + t * q_stride + h * D, cos, sin, half, s);
      for (int64_t h = 0; h < KV; ++h) rotate_head(kp + t * k_stride + h * D, cos, sin, half, s);
    }
  });
}

// silu(gate) rounded to the model dtype, times up (as F.silu(gate) * up rounds),
// 16 lanes in registers: the same arithmetic as silu() then round_to() on a row
// of scratch, so the same bits as gemm_silu_and_mul's, in one pass where the
// rows through scratch took five.
template <typename scalar_t>
inline llmserve::vf16 silu_mul16(llmserve::vf16 gate, llmserve::vf16 up) {
  return llmserve::round16<scalar_t>(llmserve::silu16(gate)) * up;
}

template <typename scalar_t>
void silu_and_mul_impl(const at::Tensor& gate_up, at::Tensor& out) {
  const int64_t rows = out.size(0), n = out.size(1);
  const scalar_t* in = gate_up.data_ptr<scalar_t>();
  scalar_t* op = out.data_ptr<scalar_t>();
  at::parallel_for(0, rows, 4, [&](int64_t begin, int64_t end) {
    llmserve::FlushDenormals flush;
    for (int64_t r = begin; r < end; ++r) {
      const scalar_t* g = in + r * 2 * n;
      const scalar_t* u = g + n;
      scalar_t* o = op + r * n;
      int64_t i = 0;
      for (; i + 16 <= n; i += 16)
        llmserve::store16(o + i,
                          silu_mul16<scalar_t>(llmserve::load16(g + i), llmserve::load16(u + i)));
      if (i < n) {  // the tail through zero-padded vectors
        float gt[16] = {}, ut[16] = {};
        llmserve::widen(g + i, gt, n - i);
        llmserve::widen(u + i, ut, n - i);
        llmserve::store16(gt, silu_mul16<scalar_t>(llmserve::load16(gt), llmserve::load16(ut)));
        llmserve::narrow(gt, o + i, n - i);
      }
    }
  });
}

void check_rows(const at::Tensor& x, const char* name) {
  TORCH_CHECK(x.is_contiguous(), name, " must be contiguous");
}

}  // namespace

at::Tensor rms_norm(at::Tensor x, at::Tensor weight, double eps) {
  x = x.contiguous();
  auto out = at::empty_like(x);
  AT_DISPATCH_FLOATING_TYPES_AND2(at::kBFloat16, at::kHalf, x.scalar_type(), "rms_norm",
                                  [&] { rms_norm_impl<scalar_t>(x, weight.contiguous(), eps, out); });
  return out;
}

void fused_add_rms_norm(at::Tensor x, at::Tensor residual, at::Tensor weight, double eps) {
  check_rows(x, "x");
  check_rows(residual, "residual");
  AT_DISPATCH_FLOATING_TYPES_AND2(at::kBFloat16, at::kHalf, x.scalar_type(),
                                  "fused_add_rms_norm", [&] {
    add_rms_norm_impl<scalar_t>(x, residual, weight.contiguous(), eps);
  });
}

void rotary_embedding(at::Tensor q, at::Tensor k, at::Tensor positions, at::Tensor cos_sin) {
  TORCH_CHECK(q.stride(2) == 1 && q.stride(1) == q.size(2), "q: heads must be contiguous");
  TORCH_CHECK(k.stride(2) == 1 && k.stride(1) == k.size(2), "k: heads must be contiguous");
  TORCH_CHECK(cos_sin.scalar_type() == at::kFloat && cos_sin.is_contiguous(),
              "cos_sin: contiguous fp32 [max_positions, 2, head_dim / 2]");
  positions = positions.to(at::kLong).contiguous();
  AT_DISPATCH_FLOATING_TYPES_AND2(at::kBFloat16, at::kHalf, q.scalar_type(), "rotary_embedding",
                                  [&] { rotary_impl<scalar_t>(q, k, positions, cos_sin); });
}

at::Tensor silu_and_mul(at::Tensor gate_up) {
  gate_up = gate_up.contiguous();
  auto out = at::empty({gate_up.size(0), gate_up.size(1) / 2}, gate_up.options());
  AT_DISPATCH_FLOATING_TYPES_AND2(at::kBFloat16, at::kHalf, gate_up.scalar_type(),
                                  "silu_and_mul", [&] { silu_and_mul_impl<scalar_t>(gate_up, out); });
  return out;
}
