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


# The classes speed figures are filed under, most capable first: (name, flags it needs).
CPU_CLASSES = (("AMX", {"amx_tile", "amx_bf16"}), ("AVX512-BF16", {"avx512f", "avx512_bf16"}),
               ("AVX-512", {"avx512f"}), ("AVX2", {"avx2", "fma"}))


def cpu_class(flags: set[str] | None = None) -> str:
    """The instruction-set class of this CPU (or of `flags`): AMX, AVX512-BF16,
    AVX-512, AVX2, or `older than AVX2`."""
    flags = cpu_flags() if flags is None else flags
    return next((name for name, needs in CPU_CLASSES if needs <= flags), "older than AVX2")
