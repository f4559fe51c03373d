// Math the compiler can vectorize without -ffast-math (which would also let it
// reorder the sums of the norm kernels).
#pragma once

#include <c10/util/BFloat16.h>
#include <c10/util/Half.h>

#include <cstdint>
#include <cstring>
#include <memory>
#include <type_traits>
#if defined(__x86_64__)
#include <immintrin.h>
#endif

namespace llmserve {

// Whether this is an Intel CPU: AMD takes the prefetch hints alike, into L1, so
// kernels that ask for their data ahead decide by vendor (paged_attention.h,
// gemv.cpp), as the worker's Python does (cpu_info.cpu_is_intel).
inline bool cpu_is_intel() {
  static const bool intel = __builtin_cpu_is("intel");
  return intel;
}

// Flush-to-zero and denormals-are-zero for a kernel's duration, on the thread
// that runs it: an operation on a denormal (masked-off lanes can hold stale
// ones) costs a microcode assist of ~100 cycles, which made SiLU 9x slower.
// Values below 1e-38 change nothing an LLM computes.
class FlushDenormals {
 public:
#if defined(__x86_64__)
  FlushDenormals() : saved_(_mm_getcsr()) { _mm_setcsr(saved_ | 0x8040); }
  ~FlushDenormals() { _mm_setcsr(saved_); }

 private:
  unsigned int saved_;
#endif
};

// GCC's vector types of N lanes (8: an AVX2 register, 16: an AVX-512 one), for
// the functions below that are written once for either width.
template <int N>
struct Lanes {
  typedef float f __attribute__((vector_size(4 * N)));
  typedef int32_t i __attribute__((vector_size(4 * N)));
  typedef uint32_t u __attribute__((vector_size(4 * N)));
  typedef uint16_t u16 __attribute__((vector_size(2 * N), aligned(2)));
  typedef _Float16 h __attribute__((vector_size(2 * N), aligned(2)));
};

// 16 floats: one AVX-512 register; on AVX2 two (vf16_pair.h). Arithmetic on
// these is element-wise, so the hot loops state their vector work directly.
#if defined(__AVX512F__)
typedef float vf16 __attribute__((vector_size(64), aligned(4)));
// The same 16 floats as memory: unaligned, and allowed to alias any float*.
// Loads and stores go through a dereference of this type, which is one vector
// move. memcpy of 64 bytes compiled (GCC 12, Intel tuning) to two 256-bit moves
// through the stack, and the 512-bit reload after them missed store forwarding:
// SiLU ran 2.7x slower than torch's for it.
typedef float vf16_mem __attribute__((vector_size(64), aligned(4), may_alias));

inline vf16 load16(const float* p) { return *reinterpret_cast<const vf16_mem*>(p); }
// Vector registers, and how many of them one vf16 takes: the kernels size their
// sets of sums (GQA heads per pass, rows per GEMV pass) to fit.
constexpr int kVectorRegisters = 32, kRegistersPerVf16 = 1;
#else
}  // namespace llmserve
#include "vf16_pair.h"
namespace llmserve {

inline vf16 load16(const float* p) { return {load8(p), load8(p + 8)}; }
constexpr int kVectorRegisters = 16, kRegistersPerVf16 = 2;
#endif

// A loaded vector kept in a register: GCC otherwise folds the load into each
// multiply-add that uses it, so a K or V vector serving three query heads was
// loaded three times, and attention ran short of load slots (bench/NOTES.md).
inline vf16 in_register(vf16 v) {
#if defined(__AVX512F__)
  asm volatile("" : "+v"(v));
#elif defined(__AVX2__)
  asm volatile("" : "+x"(v.lo), "+x"(v.hi));
#endif
  return v;
}

// Any other element type (double) is widened to fp32 on load.
template <typename T>
inline vf16 load16(const T* p) {
  float v[16];
  for (int i = 0; i < 16; ++i) v[i] = static_cast<float>(p[i]);
  return load16(v);
}

// bf16 is the top half of an fp32: widen and shift, 16 at a time with AVX-512,
// 8 at a time (widen8) without.
#if defined(__AVX512F__)
template <>
inline vf16 load16(const c10::BFloat16* p) {
  const __m256i half = _mm256_loadu_si256(reinterpret_cast<const __m256i*>(p));
  return (vf16)_mm512_slli_epi32(_mm512_cvtepu16_epi32(half), 16);
}

// fp16 through the CPU's conversion instruction, by name: where the CPU has
// AVX512-FP16, GCC 12 compiles __builtin_convertvector from 16 halves into 16
// scalar conversions, and an fp16 GEMV ran 4x slower than a bf16 one
// (bench/NOTES.md).
template <>
inline vf16 load16(const c10::Half* p) {
  return (vf16)_mm512_cvtph_ps(_mm256_loadu_si256(reinterpret_cast<const __m256i*>(p)));
}
#else
inline vf8 widen8(const c10::BFloat16* p) {
  typedef uint16_t vu16 __attribute__((vector_size(16), aligned(2)));
  typedef uint32_t vu32 __attribute__((vector_size(32)));
  vu16 half;
  std::memcpy(&half, p, sizeof(half));
  const vu32 wide = __builtin_convertvector(half, vu32) << 16;
  vf8 v;
  std::memcpy(&v, &wide, sizeof(v));
  return v;
}

// fp16 through F16C's conversion instruction (part of every AVX2 CPU), by name
// as with AVX-512 above.
inline vf8 widen8(const c10::Half* p) {
#if defined(__F16C__)
  return (vf8)_mm256_cvtph_ps(_mm_loadu_si128(reinterpret_cast<const __m128i*>(p)));
#else
  typedef _Float16 vh8 __attribute__((vector_size(16), aligned(2)));
  vh8 half;
  std::memcpy(&half, p, sizeof(half));
  return __builtin_convertvector(half, vf8);
#endif
}

template <>
inline vf16 load16(const c10::BFloat16* p) { return {widen8(p), widen8(p + 8)}; }
template <>
inline vf16 load16(const c10::Half* p) { return {widen8(p), widen8(p + 8)}; }
#endif

// Narrows 16 floats to T and stores them, rounding to nearest even as c10's
// scalar conversions do, but 16 at a time: c10::BFloat16's conversion (a NaN
// branch, then integer rounding) does not vectorize, and ran bf16 SiLU at
// ~7 ns an element.
template <typename T>
inline void store16(T* p, vf16 v) {
  for (int i = 0; i < 16; ++i) p[i] = static_cast<T>(v[i]);
}

// N floats to bf16, rounding to nearest even; NaN stays NaN.
template <int N>
inline void narrow_bf16(c10::BFloat16* p, typename Lanes<N>::f v) {
  using vu32 = typename Lanes<N>::u;
  using vi32 = typename Lanes<N>::i;
  vu32 bits;
  std::memcpy(&bits, &v, sizeof(bits));
  const vu32 rounded = (bits + (0x7fffu + ((bits >> 16) & 1u))) >> 16;
  const vi32 nan = (bits & 0x7fffffffu) > 0x7f800000u;  // all ones where NaN
  const vu32 out = (rounded & ~(vu32)nan) | (0x7fc0u & (vu32)nan);
  const typename Lanes<N>::u16 half = __builtin_convertvector(out, typename Lanes<N>::u16);
  std::memcpy(p, &half, sizeof(half));
}

template <int N>
inline void narrow_half(c10::Half* p, typename Lanes<N>::f v) {
  const typename Lanes<N>::h half = __builtin_convertvector(v, typename Lanes<N>::h);
  std::memcpy(p, &half, sizeof(half));
}

#if defined(__AVX512F__)
template <>
inline void store16(float* p, vf16 v) {
  *reinterpret_cast<vf16_mem*>(p) = v;
}
// bf16 through the CPU's own conversion where it has AVX512-BF16: one
// instruction where narrow_bf16 takes eleven, and the norms and SiLU in bf16
// spent more time rounding than computing. It also rounds to nearest even; it
// reads an fp32 denormal as zero (the kernels flush them anyway) and keeps a
// NaN's sign, where narrow_bf16 gives 0x7fc0.
#if defined(__AVX512BF16__)
inline __m256i bf16_bits(vf16 v) { return (__m256i)_mm512_cvtneps_pbh((__m512)v); }
template <>
inline void store16(c10::BFloat16* p, vf16 v) {
  _mm256_storeu_si256(reinterpret_cast<__m256i*>(p), bf16_bits(v));
}
#else
template <>
inline void store16(c10::BFloat16* p, vf16 v) { narrow_bf16<16>(p, v); }
#endif
template <>
inline void store16(c10::Half* p, vf16 v) { narrow_half<16>(p, v); }
#else
template <>
inline void store16(float* p, vf16 v) { store8(p, v.lo), store8(p + 8, v.hi); }
template <>
inline void store16(c10::BFloat16* p, vf16 v) {
  narrow_bf16<8>(p, v.lo), narrow_bf16<8>(p + 8, v.hi);
}
template <>
inline void store16(c10::Half* p, vf16 v) { narrow_half<8>(p, v.lo), narrow_half<8>(p + 8, v.hi); }
#endif

// Rows in fp32 scratch: widen() a row of T into floats, compute there with
// plain `#pragma omp simd` loops (which vectorize as fp32 code does), and
// narrow() the result back; round_to<T>() rounds in place to T's precision,
// where the reference rounds an intermediate to the model dtype.
template <typename T>
inline void widen(const T* in, float* out, int64_t n) {
  int64_t i = 0;
  for (; i + 16 <= n; i += 16) {
    store16(out + i, load16(in + i));
  }
  for (; i < n; ++i) out[i] = static_cast<float>(in[i]);
}

template <typename T>
inline void narrow(const float* in, T* out, int64_t n) {
  int64_t i = 0;
  for (; i + 16 <= n; i += 16) store16(out + i, load16(in + i));
  for (; i < n; ++i) out[i] = static_cast<T>(in[i]);
}

// N floats rounded to bf16's precision in registers: the bits narrow_bf16 then a
// widening give (to nearest even; NaN to narrow_bf16's quiet NaN).
template <int N>
inline typename Lanes<N>::f round_bf16(typename Lanes<N>::f v) {
  using vu32 = typename Lanes<N>::u;
  using vi32 = typename Lanes<N>::i;
  vu32 bits;
  std::memcpy(&bits, &v, sizeof(bits));
  const vu32 rounded = (bits + (0x7fffu + ((bits >> 16) & 1u))) & 0xffff0000u;
  const vi32 nan = (bits & 0x7fffffffu) > 0x7f800000u;  // all ones where NaN
  const vu32 out = (rounded & ~(vu32)nan) | (0x7fc00000u & (vu32)nan);
  std::memcpy(&v, &out, sizeof(v));
  return v;
}

// v rounded to T's precision: through T and back, bf16 in registers (through
// memory, the 16-bit store and the wider reload missed store forwarding, and
// SiLU's one pass ran no faster than its five through scratch).
template <typename T>
inline vf16 round16(vf16 v) {
  if constexpr (std::is_same_v<T, float>) {
    return v;
  } else if constexpr (std::is_same_v<T, c10::BFloat16>) {
#if defined(__AVX512BF16__)
    return (vf16)_mm512_slli_epi32(_mm512_cvtepu16_epi32(bf16_bits(v)), 16);
#elif defined(__AVX512F__)
    return round_bf16<16>(v);
#else
    return {round_bf16<8>(v.lo), round_bf16<8>(v.hi)};
#endif
  } else {
    T tmp[16];
    store16(tmp, v);
    return load16(tmp);
  }
}

template <typename T>
inline void round_to(float* x, int64_t n) {
  if constexpr (!std::is_same_v<T, float>) {
    int64_t i = 0;
    for (; i + 16 <= n; i += 16) store16(x + i, round16<T>(load16(x + i)));
    for (; i < n; ++i) x[i] = static_cast<float>(static_cast<T>(x[i]));
  }
}

// Room for a work item's values that only grows, and leaves what it holds as it
// was: std::vector's resize writes every element it adds (bf16 ones one at a
// time), and items of alternating reach (Prefill::run) made each long item
// clear most of its buffers again, ~30% of a short prompt's prefill
// attention (bench/NOTES.md). Each user writes what it then reads.
template <typename T>
class Buffer {
 public:
  // Room for n values (what it held is lost if it grows); their start.
  T* ensure(int64_t n) {
    if (n > capacity_) {
      data_.reset(new T[n]);
      capacity_ = n;
    }
    return data_.get();
  }
  T* data() const { return data_.get(); }
  T& operator[](int64_t i) const { return data_[i]; }

 private:
  std::unique_ptr<T[]> data_;
  int64_t capacity_ = 0;
};

// Per-thread scratch rows that outlive a call, so a one-row kernel call (a
// decode step) allocates nothing. slot: which of a kernel's rows (0-3); what a
// row held is lost when it grows.
inline float* scratch(int slot, int64_t n) {
  thread_local Buffer<float> rows[4];
  return rows[slot].ensure(n);
}

// Halving sum: four dependent adds, not sixteen (without -ffast-math the
// compiler keeps a loop's order). The GEMV ends every output with one: a
// one-row pass over SmolLM2's bf16 weights took 2-3% less time with it.
inline float sum8(Lanes<8>::f eight) {
  typedef float vf4 __attribute__((vector_size(16)));
  const vf4 four = __builtin_shufflevector(eight, eight, 0, 1, 2, 3) +
                   __builtin_shufflevector(eight, eight, 4, 5, 6, 7);
  return (four[0] + four[2]) + (four[1] + four[3]);
}

inline float sum16(vf16 v) {
#if defined(__AVX512F__)
  return sum8(__builtin_shufflevector(v, v, 0, 1, 2, 3, 4, 5, 6, 7) +
              __builtin_shufflevector(v, v, 8, 9, 10, 11, 12, 13, 14, 15));
#else
  return sum8(v.lo + v.hi);
#endif
}

// e^(x - n ln2) for n = floor(x / ln2 + 1/2): Cephes' expf polynomial, fast_exp's
// body for any vector of floats.
template <typename vf>
inline vf exp_of_remainder(vf x, vf n) {
  const vf r = x - n * 0.693359375f + n * 2.12194440e-4f;
  vf p = r * 1.9875691500e-4f + 1.3981999507e-3f;
  p = p * r + 8.3334519073e-3f;
  p = p * r + 4.1665795894e-2f;
  p = p * r + 1.6666665459e-1f;
  p = p * r + 5.0000001201e-1f;
  return p * r * r + r + 1.0f;
}

// e^x within 2 ulp for x in [-87, 88] (clamped outside: e^-87 is ~0 and e^88
// ~fp32's max), N lanes at once: Cephes' expf polynomial on x - n ln2, scaled
// by 2^n through the exponent bits. Written on vectors because GCC left a scalar
// version scalar inside reduction loops (the softmax's sum).
template <int N>
inline typename Lanes<N>::f fast_exp(typename Lanes<N>::f x) {
  using vf = typename Lanes<N>::f;
  using vi = typename Lanes<N>::i;
  x = x < -87.0f ? -87.0f : (x > 88.0f ? 88.0f : x);
  const vf t = x * 1.44269504088896341f + 0.5f;
  vf n = __builtin_convertvector(__builtin_convertvector(t, vi), vf);
  n = n > t ? n - 1.0f : n;  // truncation to floor
  const vi bits = (__builtin_convertvector(n, vi) + 127) << 23;
  return exp_of_remainder(x, n) * (vf)bits;
}

#if defined(__AVX512F__)
// fast_exp<16> with the clamp, the floor and the scaling one instruction each
// (min/max, VRNDSCALEPS, VSCALEFPS) where the generic code takes two to four:
// the same values. A decode's softmax was a sixth of its attention's time
// warm, and SiLU runs in the gate_up GEMM's pass (bench/NOTES.md).
inline vf16 fast_exp16(vf16 x) {
  // max(-87, x), then min(88, .): a NaN x stays NaN, as fast_exp's comparisons keep it.
  x = (vf16)_mm512_min_ps(_mm512_set1_ps(88.0f), _mm512_max_ps(_mm512_set1_ps(-87.0f), (__m512)x));
  const __m512 t = (__m512)(x * 1.44269504088896341f + 0.5f);
  const vf16 n = (vf16)_mm512_roundscale_ps(t, _MM_FROUND_TO_NEG_INF | _MM_FROUND_NO_EXC);
  return (vf16)_mm512_scalef_ps((__m512)exp_of_remainder(x, n), (__m512)n);
}

// where_greater: lane-wise, where a > b, x; elsewhere y.
inline vf16 where_greater(vf16 a, vf16 b, vf16 x, vf16 y) { return a > b ? x : y; }
#else
inline vf16 fast_exp16(vf16 x) { return {fast_exp<8>(x.lo), fast_exp<8>(x.hi)}; }
// where_greater: lane-wise, where a > b, x; elsewhere y.
inline vf16 where_greater(vf16 a, vf16 b, vf16 x, vf16 y) {
  return {a.lo > b.lo ? x.lo : y.lo, a.hi > b.hi ? x.hi : y.hi};
}
#endif

// Lane-wise max (where either is NaN: b).
inline vf16 max16(vf16 a, vf16 b) { return where_greater(a, b, a, b); }

// x * sigmoid(x), 16 lanes.
inline vf16 silu16(vf16 v) { return v / (1.f + fast_exp16(-v)); }

// x * sigmoid(x) in place over n floats.
inline void silu(float* x, int64_t n) {
  int64_t i = 0;
  for (; i + 16 <= n; i += 16) store16(x + i, silu16(load16(x + i)));
  if (i < n) {  // the tail through a zero-padded vector
    float tail[16] = {};
    std::memcpy(tail, x + i, (n - i) * sizeof(float));
    store16(tail, silu16(load16(tail)));
    std::memcpy(x + i, tail, (n - i) * sizeof(float));
  }
}

#if defined(__AVX512BF16__)
// bf16 pairs, as VDPBF16PS and AMX's tiles multiply them: two rows of 16 values
// interleaved, value i of the first row in word 2i, of the second in 2i + 1
// (indices from 32 on name the second operand).
inline __m512i pair_interleave() {
  alignas(64) static const uint16_t idx[32] = {0,  32, 1,  33, 2,  34, 3,  35, 4,  36, 5,
                                               37, 6,  38, 7,  39, 8,  40, 9,  41, 10, 42,
                                               11, 43, 12, 44, 13, 45, 14, 46, 15, 47};
  return _mm512_load_si512(idx);
}

inline __m256i load_bf16x16(const c10::BFloat16* p) {
  return _mm256_loadu_si256(reinterpret_cast<const __m256i*>(p));
}

inline __m512i interleave_pairs(__m256i a, __m256i b, __m512i interleave) {
  return _mm512_permutex2var_epi16(_mm512_castsi256_si512(a), interleave,
                                   _mm512_castsi256_si512(b));
}

inline void store_pairs(c10::BFloat16* p, __m256i a, __m256i b, __m512i interleave) {
  _mm512_storeu_si512(p, interleave_pairs(a, b, interleave));
}
#endif

}  // namespace llmserve
