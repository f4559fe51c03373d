"""Builds the CPU kernels (csrc/*.cpp) into one extension on first use, for the
host CPU (-march=native: AVX-512 code where the CPU has it, AVX2 elsewhere), and
registers them as torch.ops.llmserve.*. torch caches the build under
~/.cache/torch_extensions and rebuilds when a source changes."""
from __future__ import annotations

import contextlib
import fcntl
import functools
import hashlib
import logging
import os
import time
from pathlib import Path
from typing import Iterator

import torch

logger = logging.getLogger(__name__)
_CSRC = Path(__file__).parent / "csrc"
# The CPU the kernels are built for, as GCC's -march: this host's by default.
# LLMSERVE_KERNELS_MARCH=x86-64-v3 builds the AVX2 code on an AVX-512 host, which
# the tests do to run the AVX2 paths such a host would never take, and which an
# image for a fleet of mixed CPUs can do to run on all of them.
_MARCH = os.environ.get("LLMSERVE_KERNELS_MARCH", "native")
# 512-bit vectors where the target has them (GCC prefers 256 on Intel by default).
# -fno-trapping-math and -fno-math-errno let floor, conversions and sqrt vectorize;
# unlike -ffast-math they keep the order of every sum. -fopenmp compiles
# at::parallel_for's OpenMP path in; libgomp.so.1 then resolves to the copy torch
# has loaded (one runtime).
_CFLAGS = ["-O3", f"-march={_MARCH}", "-mprefer-vector-width=512", "-fno-trapping-math",
           "-fno-math-errno", "-fopenmp"]
# One build per checkout and target: torch keys its cache by the extension's name,
# and its ninja file holds the sources' absolute paths, so two checkouts sharing a
# name rebuild everything (about 100 s on two cores) each time the other ran.
_BUILD_KEY = str(_CSRC.resolve()) + ("" if _MARCH == "native" else f" -march={_MARCH}")
_EXTENSION_NAME = "llmserve_cpu_ops_" + hashlib.sha1(_BUILD_KEY.encode()).hexdigest()[:8]


def _sources() -> list[str]:
    """csrc/*.cpp, the attention kernels' files first. Ninja starts them in this order,
    and theirs are the long compiles (an instantiation per dtype, block size and head
    dim): started last, as sorted names put them, one core sat idle at the end."""
    return sorted((str(p) for p in _CSRC.glob("*.cpp")),
                  key=lambda p: (not Path(p).name.startswith("paged_"), p))


@functools.cache
def cpu_ops_available() -> bool:
    """Builds and loads the extension once; False (and a warning) when it cannot be
    built here, and callers then use the torch reference of each op."""
    try:
        import ninja  # the PyPI package: its binary is not on PATH inside a venv
        os.environ["PATH"] = f"{ninja.BIN_DIR}{os.pathsep}{os.environ.get('PATH', '')}"
        from torch.utils.cpp_extension import load

        build_dir = build_directory()
        start = time.perf_counter()
        with exclusive_build(build_dir):
            load(name=_EXTENSION_NAME, sources=_sources(),
                 extra_cflags=_CFLAGS, extra_ldflags=["-fopenmp"], is_python_module=False,
                 verbose=False, build_directory=str(build_dir))
        logger.info("CPU kernels ready in %.1f s", time.perf_counter() - start)
        return True
    except Exception as e:  # no compiler, headers or ninja: fall back, loudly
        logger.warning("CPU kernels unavailable (%s); using the torch reference ops", e)
        return False


@functools.cache
def kernels_built_for_avx512() -> bool:
    """Whether the kernels here were built for AVX-512 (32 vector registers, which
    some of them size their work by); False where they were not built at all."""
    return cpu_ops_available() and bool(torch.ops.llmserve.built_for_avx512())


def build_directory() -> Path:
    """Where torch builds and caches the extension: its own choice of folder (a
    private function, stable in the pinned torch), named here so that the build's
    lock sits beside it."""
    from torch.utils.cpp_extension import _get_build_directory

    return Path(_get_build_directory(_EXTENSION_NAME, verbose=False))


@contextlib.contextmanager
def exclusive_build(build_dir: Path) -> Iterator[None]:
    """Runs the block as the only build of this extension on the machine. torch
    guards a build with a `lock` file that a build stopped midway (Ctrl-C, a killed
    `make`) leaves behind, and every later build then waits on it forever, silently.
    An flock dies with its process: whoever holds this one is the only builder, so
    a `lock` file found then is stale and goes."""
    build_dir.mkdir(parents=True, exist_ok=True)
    with open(build_dir / "llmserve.flock", "w") as held:
        try:
            fcntl.flock(held, fcntl.LOCK_EX | fcntl.LOCK_NB)
        except BlockingIOError:
            logger.info("waiting for another process building the CPU kernels in %s", build_dir)
            fcntl.flock(held, fcntl.LOCK_EX)
        stale = build_dir / "lock"
        if stale.exists():
            logger.warning("removing %s, left by a build stopped midway", stale)
            stale.unlink(missing_ok=True)
        yield


def use_cpu_ops(x: torch.Tensor, *others: torch.Tensor) -> bool:
    """Whether the C++ kernels serve these tensors: all on the CPU. (Runs for
    every op of every layer: no generator, cached build check.)"""
    return x.is_cpu and all(t.is_cpu for t in others) and cpu_ops_available()


def main() -> None:
    """`python -m kernels.cpu_build` (make kernels): builds the kernels now; a
    machine that cannot build them is told so, and serves with the torch ops."""
    logging.basicConfig(level=logging.INFO, format="llmserve kernels: %(message)s")
    logger.info("building the CPU kernels for this CPU (minutes the first time) ...")
    cpu_ops_available()


if __name__ == "__main__":
    main()
