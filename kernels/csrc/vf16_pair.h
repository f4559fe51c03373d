// vf16 where the CPU has no 16-float register (AVX2): two 8-float ones.
//
// Why not GCC's 64-byte vector type, as on AVX-512: GCC 12 keeps a variable of
// a vector type wider than any register in memory, and copies it through
// general-purpose registers at every update. Built so, a GEMV sum took ~20
// instructions per multiply-add, and every loop that carries a vector from one
// iteration to the next (GEMV, attention, softmax, argmax) ran at that pace
// (bench/NOTES.md, "The AVX2 build"). A struct of two native vectors stays in
// two registers. Included by vector_math.h only; the kernels use vf16 the same
// way either way: arithmetic, element reads, and vector_math.h's functions.
#pragma once

namespace llmserve {

typedef float vf8 __attribute__((vector_size(32)));
typedef float vf8_mem __attribute__((vector_size(32), aligned(4), may_alias));

struct vf16 {
  vf8 lo, hi;

  float operator[](int i) const { return i < 8 ? lo[i] : hi[i - 8]; }
};

// Each operator on both halves, with a float on either side broadcast, as GCC's
// vector types do.
#define LLMSERVE_VF16_OPERATOR(op)                                                   \
  inline vf16 operator op(vf16 a, vf16 b) { return {a.lo op b.lo, a.hi op b.hi}; } \
  inline vf16 operator op(float a, vf16 b) { return {a op b.lo, a op b.hi}; }      \
  inline vf16 operator op(vf16 a, float b) { return {a.lo op b, a.hi op b}; }      \
  inline vf16& operator op##=(vf16& a, vf16 b) { return a = a op b; }              \
  inline vf16& operator op##=(vf16& a, float b) { return a = a op b; }
LLMSERVE_VF16_OPERATOR(+)
LLMSERVE_VF16_OPERATOR(-)
LLMSERVE_VF16_OPERATOR(*)
LLMSERVE_VF16_OPERATOR(/)
#undef LLMSERVE_VF16_OPERATOR

inline vf16 operator-(vf16 a) { return {-a.lo, -a.hi}; }

inline vf8 load8(const float* p) { return *reinterpret_cast<const vf8_mem*>(p); }
inline void store8(float* p, vf8 v) { *reinterpret_cast<vf8_mem*>(p) = v; }

}  // namespace llmserve
