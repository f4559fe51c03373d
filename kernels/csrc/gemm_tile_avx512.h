// The fp32 GEMM tile with AVX-512 (gemm.cpp), written in assembly: c[r][0:48] =
// a[r] . panel for MR <= 8 rows, the 8 x 48 sums in zmm0-23, the panel's row of
// three vectors in zmm24-26, each row's broadcast value in zmm27 or zmm28.
//
// Why assembly: GCC's loop for the same tile had the last row's FMAs write into
// the panel's registers and moved four registers back every K step, beside the
// prefetch's arithmetic; those took the FMA ports' slots. On an Intel Xeon (Ice
// Lake), one thread, this loop ran at 1.2-1.3x GCC's from panels in L2 to the
// whole panel in L1, about 90% of the core's FMA peak, with the same bits
// (bench/NOTES.md). The sums are the same FMAs in the same order as the C++
// tile's, so the output is too.
#pragma once

#include <cstdint>

namespace llmserve::gemm_asm {

#define LLMSERVE_FMA3(B, S0, S1, S2)                \
  "vfmadd231ps %%zmm" B ", %%zmm24, %%zmm" S0 "\n\t" \
  "vfmadd231ps %%zmm" B ", %%zmm25, %%zmm" S1 "\n\t" \
  "vfmadd231ps %%zmm" B ", %%zmm26, %%zmm" S2 "\n\t"
// Row r's value at this K step (byte offset O), broadcast, times the panel's row.
// Rows 0-2 are addressed from a0, 3-5 from a3, 6-7 from a6 (L: a row's bytes).
#define LLMSERVE_ROW0(O) "vbroadcastss " O "(%[a0]), %%zmm27\n\t" LLMSERVE_FMA3("27", "0", "1", "2")
#define LLMSERVE_ROW1(O) "vbroadcastss " O "(%[a0],%[L],1), %%zmm28\n\t" LLMSERVE_FMA3("28", "3", "4", "5")
#define LLMSERVE_ROW2(O) "vbroadcastss " O "(%[a0],%[L],2), %%zmm27\n\t" LLMSERVE_FMA3("27", "6", "7", "8")
#define LLMSERVE_ROW3(O) "vbroadcastss " O "(%[a3]), %%zmm28\n\t" LLMSERVE_FMA3("28", "9", "10", "11")
#define LLMSERVE_ROW4(O) "vbroadcastss " O "(%[a3],%[L],1), %%zmm27\n\t" LLMSERVE_FMA3("27", "12", "13", "14")
#define LLMSERVE_ROW5(O) "vbroadcastss " O "(%[a3],%[L],2), %%zmm28\n\t" LLMSERVE_FMA3("28", "15", "16", "17")
#define LLMSERVE_ROW6(O) "vbroadcastss " O "(%[a6]), %%zmm27\n\t" LLMSERVE_FMA3("27", "18", "19", "20")
#define LLMSERVE_ROW7(O) "vbroadcastss " O "(%[a6],%[L],1), %%zmm28\n\t" LLMSERVE_FMA3("28", "21", "22", "23")
#define LLMSERVE_ROWS1(O) LLMSERVE_ROW0(O)
#define LLMSERVE_ROWS2(O) LLMSERVE_ROWS1(O) LLMSERVE_ROW1(O)
#define LLMSERVE_ROWS3(O) LLMSERVE_ROWS2(O) LLMSERVE_ROW2(O)
#define LLMSERVE_ROWS4(O) LLMSERVE_ROWS3(O) LLMSERVE_ROW3(O)
#define LLMSERVE_ROWS5(O) LLMSERVE_ROWS4(O) LLMSERVE_ROW4(O)
#define LLMSERVE_ROWS6(O) LLMSERVE_ROWS5(O) LLMSERVE_ROW5(O)
#define LLMSERVE_ROWS7(O) LLMSERVE_ROWS6(O) LLMSERVE_ROW6(O)
#define LLMSERVE_ROWS8(O) LLMSERVE_ROWS7(O) LLMSERVE_ROW7(O)

// One K step at byte offsets AO (into a's rows) and PO (into the panel): the
// panel's row, then each row's FMAs; first one prefetch of the next panel, at
// line t >> 16 (t advancing by `rate` a step, as the C++ tile's k * rate).
#define LLMSERVE_STEP(ROWS, AO, PO)                                                     \
  "mov %[t], %%rax\n\t"                                                                  \
  "sar $16, %%rax\n\t"                                                                   \
  "shl $6, %%rax\n\t"                                                                    \
  "prefetcht1 (%[pf],%%rax,1)\n\t"                                                       \
  "add %[rate], %[t]\n\t"                                                                \
  "vmovups " PO "(%[p]), %%zmm24\n\t"                                                    \
  "vmovups " PO "+64(%[p]), %%zmm25\n\t"                                                 \
  "vmovups " PO "+128(%[p]), %%zmm26\n\t" ROWS(AO)

#define LLMSERVE_STORE_ROW(S0, S1, S2)                                             \
  "vmovups %%zmm" S0 ", (%%rax)\n\t"                                               \
  "vmovups %%zmm" S1 ", 64(%%rax)\n\t"                                             \
  "vmovups %%zmm" S2 ", 128(%%rax)\n\t"                                            \
  "add %[ldcb], %%rax\n\t"
#define LLMSERVE_STORE1 LLMSERVE_STORE_ROW("0", "1", "2")
#define LLMSERVE_STORE2 LLMSERVE_STORE1 LLMSERVE_STORE_ROW("3", "4", "5")
#define LLMSERVE_STORE3 LLMSERVE_STORE2 LLMSERVE_STORE_ROW("6", "7", "8")
#define LLMSERVE_STORE4 LLMSERVE_STORE3 LLMSERVE_STORE_ROW("9", "10", "11")
#define LLMSERVE_STORE5 LLMSERVE_STORE4 LLMSERVE_STORE_ROW("12", "13", "14")
#define LLMSERVE_STORE6 LLMSERVE_STORE5 LLMSERVE_STORE_ROW("15", "16", "17")
#define LLMSERVE_STORE7 LLMSERVE_STORE6 LLMSERVE_STORE_ROW("18", "19", "20")
#define LLMSERVE_STORE8 LLMSERVE_STORE7 LLMSERVE_STORE_ROW("21", "22", "23")

// The whole tile: zero the sums, K steps two at a time (then the odd one), store
// MR rows. n counts the steps left.
#define LLMSERVE_TILE(ROWS, STORE)                                                         \
  asm volatile(                                                                            \
      "vpxord %%zmm0, %%zmm0, %%zmm0\n\t"                                                  \
      "vmovaps %%zmm0, %%zmm1\n\t" "vmovaps %%zmm0, %%zmm2\n\t" "vmovaps %%zmm0, %%zmm3\n\t"  \
      "vmovaps %%zmm0, %%zmm4\n\t" "vmovaps %%zmm0, %%zmm5\n\t" "vmovaps %%zmm0, %%zmm6\n\t"  \
      "vmovaps %%zmm0, %%zmm7\n\t" "vmovaps %%zmm0, %%zmm8\n\t" "vmovaps %%zmm0, %%zmm9\n\t"  \
      "vmovaps %%zmm0, %%zmm10\n\t" "vmovaps %%zmm0, %%zmm11\n\t" "vmovaps %%zmm0, %%zmm12\n\t" \
      "vmovaps %%zmm0, %%zmm13\n\t" "vmovaps %%zmm0, %%zmm14\n\t" "vmovaps %%zmm0, %%zmm15\n\t" \
      "vmovaps %%zmm0, %%zmm16\n\t" "vmovaps %%zmm0, %%zmm17\n\t" "vmovaps %%zmm0, %%zmm18\n\t" \
      "vmovaps %%zmm0, %%zmm19\n\t" "vmovaps %%zmm0, %%zmm20\n\t" "vmovaps %%zmm0, %%zmm21\n\t" \
      "vmovaps %%zmm0, %%zmm22\n\t" "vmovaps %%zmm0, %%zmm23\n\t"                            \
      "sub $2, %[n]\n\t"                                                                   \
      "jl 2f\n"                                                                            \
      "1:\n\t" LLMSERVE_STEP(ROWS, "0", "0") LLMSERVE_STEP(ROWS, "4", "192")               \
      "add $8, %[a0]\n\t"                                                                  \
      "add $8, %[a3]\n\t"                                                                  \
      "add $8, %[a6]\n\t"                                                                  \
      "add $384, %[p]\n\t"                                                                 \
      "sub $2, %[n]\n\t"                                                                   \
      "jge 1b\n"                                                                           \
      "2:\n\t"                                                                             \
      "add $2, %[n]\n\t"                                                                   \
      "jz 3f\n\t" LLMSERVE_STEP(ROWS, "0", "0")                                            \
      "3:\n\t"                                                                             \
      "mov %[c], %%rax\n\t" STORE                                                          \
      : [a0] "+r"(a0), [a3] "+r"(a3), [a6] "+r"(a6), [p] "+r"(p), [n] "+r"(n), [t] "+r"(t)  \
      : [L] "r"(L), [pf] "r"(pf), [rate] "r"(rate), [c] "r"(c), [ldcb] "r"(ldcb)            \
      : "rax", "memory", "cc", "xmm0", "xmm1", "xmm2", "xmm3", "xmm4", "xmm5", "xmm6",       \
        "xmm7", "xmm8", "xmm9", "xmm10", "xmm11", "xmm12", "xmm13", "xmm14", "xmm15",      \
        "xmm16", "xmm17", "xmm18", "xmm19", "xmm20", "xmm21", "xmm22", "xmm23", "xmm24",   \
        "xmm25", "xmm26", "xmm27", "xmm28")

// c[r][0:48] = a[r][0:K] . panel[0:K][0:48] for r < MR (1 <= MR <= 8); a's
// rows lda floats apart, c's ldc. Each K step prefetches line (k * rate) >> 16 of
// `next` into L2, or, without a next panel (next == nullptr), this panel's first.
template <int MR>
inline void tile(const float* a, int64_t lda, const float* panel, int64_t K, float* c,
                 int64_t ldc, const char* next, int64_t rate) {
  static_assert(1 <= MR && MR <= 8);
  const int64_t L = lda * 4, ldcb = ldc * 4;
  const char* a0 = reinterpret_cast<const char*>(a);
  // Never dereferenced past row MR - 1: rows 3-7 are read only by larger tiles.
  const char* a3 = a0 + 3 * L;
  const char* a6 = a0 + 6 * L;
  const char* p = reinterpret_cast<const char*>(panel);
  const char* pf = next != nullptr ? next : p;
  if (next == nullptr) rate = 0;
  int64_t t = 0, n = K;
  if constexpr (MR == 1) LLMSERVE_TILE(LLMSERVE_ROWS1, LLMSERVE_STORE1);
  if constexpr (MR == 2) LLMSERVE_TILE(LLMSERVE_ROWS2, LLMSERVE_STORE2);
  if constexpr (MR == 3) LLMSERVE_TILE(LLMSERVE_ROWS3, LLMSERVE_STORE3);
  if constexpr (MR == 4) LLMSERVE_TILE(LLMSERVE_ROWS4, LLMSERVE_STORE4);
  if constexpr (MR == 5) LLMSERVE_TILE(LLMSERVE_ROWS5, LLMSERVE_STORE5);
  if constexpr (MR == 6) LLMSERVE_TILE(LLMSERVE_ROWS6, LLMSERVE_STORE6);
  if constexpr (MR == 7) LLMSERVE_TILE(LLMSERVE_ROWS7, LLMSERVE_STORE7);
  if constexpr (MR == 8) LLMSERVE_TILE(LLMSERVE_ROWS8, LLMSERVE_STORE8);
}

}  // namespace llmserve::gemm_asm
