"""What /proc/cpuinfo says about this machine's CPU (the first one listed)."""
from __future__ import annotations

import functools


@functools.cache
def cpuinfo_field(name: str) -> str:
    """The first CPU's value for `name` ('vendor_id', 'flags', ...); '' where the
    file or the field is missing."""
    try:
        with open("/proc/cpuinfo") as f:
            for line in f:
                key, _, value = line.partition(":")
                if key.strip() == name:
                    return value.strip()
    except OSError:
        pass
    return ""


def cpu_flags() -> set[str]:
    return set(cpuinfo_field("flags").split())


def cpu_is_intel() -> bool:
    return cpuinfo_field("vendor_id") == "GenuineIntel"


# AMD's first family whose cores run AVX-512 on 512-bit units (Zen 5); Zen 4
# (family 25) runs each 512-bit operation as two 256-bit halves.
AMD_FULL_WIDTH_AVX512_FAMILY = 26


def avx512_full_width() -> bool:
    """Whether this CPU runs AVX-512 at full width: Intel's AVX-512 cores and AMD's
    from Zen 5. There a GEMV over 16-bit weights stays bound by reading them up to
    8 rows; on Zen 4 its widening and multiply-adds bound it from 2 or 3 rows
    (bench/NOTES.md)."""
    if "avx512f" not in cpu_flags():
        return False
    if cpu_is_intel():
        return True
    family = cpuinfo_field("cpu family")
    return (cpuinfo_field("vendor_id") == "AuthenticAMD" and family.isdigit()
            and int(family) >= AMD_FULL_WIDTH_AVX512_FAMILY)


# The classes speed figures are filed under, most capable first: (name, flags it needs).
CPU_CLASSES = (("AMX", {"amx_tile", "amx_bf16"}), ("AVX512-BF16", {"avx512f", "avx512_bf16"}),
               ("AVX-512", {"avx512f"}), ("AVX2", {"avx2", "fma"}))


def cpu_class(flags: set[str] | None = None) -> str:
    """The instruction-set class of this CPU (or of `flags`): AMX, AVX512-BF16,
    AVX-512, AVX2, or `older than AVX2`."""
    flags = cpu_flags() if flags is None else flags
    return next((name for name, needs in CPU_CLASSES if needs <= flags), "older than AVX2")
