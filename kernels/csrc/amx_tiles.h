// Intel AMX's tiles as the kernels use them (amx_linear.cpp, paged_prefill.cpp):
// eight tiles of 16 rows of 64 bytes each. A tile holds 16 x 32 bf16 of a left
// operand, 16 pairs of K x 16 columns of a right one (the VNNI layout
// tdpbf16ps multiplies: B[k][n] and B[k + 1][n] side by side in row k / 2), or
// 16 x 16 fp32 sums. Compiled only where the build host has AMX-BF16
// (-march=native); elsewhere LLMSERVE_AMX is undefined and callers take their
// AVX paths.
#pragma once

#if defined(__AMX_BF16__) && defined(__AMX_TILE__) && defined(__AVX512BF16__)
#define LLMSERVE_AMX 1
#include <immintrin.h>
#include <sys/syscall.h>
#include <unistd.h>

#include <cstdint>
#include <cstring>

namespace llmserve {

// Elements of bf16 in one tile.
constexpr int64_t kTileElems = 16 * 32;

struct TileConfig {
  uint8_t palette_id, start_row, reserved[14];
  uint16_t colsb[16];
  uint8_t rows[16];
};

// Configures all eight tiles as 16 rows of 64 bytes. The configuration belongs
// to the thread, so each worker thread loads its own.
class ThreadTiles {
 public:
  ThreadTiles() {
    TileConfig cfg;
    std::memset(&cfg, 0, sizeof(cfg));
    cfg.palette_id = 1;
    for (int t = 0; t < 8; ++t) {
      cfg.colsb[t] = 64;
      cfg.rows[t] = 16;
    }
    // GCC's _tile_loadconfig tells the compiler it reads 8 bytes of the 64, so
    // without this barrier it dropped the stores of rows and colsb as dead,
    // and ldtilecfg faulted on the stack's garbage (SIGSEGV).
    asm volatile("" : : "r"(&cfg) : "memory");
    _tile_loadconfig(&cfg);
  }
  ~ThreadTiles() { _tile_release(); }
};

// Linux hands out AMX state only on request (ARCH_REQ_XCOMP_PERM for
// XFEATURE_XTILEDATA), once per process.
inline bool amx_permitted() {
  static const bool ok = syscall(SYS_arch_prctl, 0x1023, 18) == 0;
  return ok;
}

}  // namespace llmserve

#endif  // AMX-BF16
