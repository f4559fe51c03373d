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
