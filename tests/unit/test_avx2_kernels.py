"""The CPU kernels built for AVX2 (LLMSERVE_KERNELS_MARCH=x86-64-v3), on a host with
AVX-512: its own build never runs their AVX2 code (vf16 as two registers, the
register budgets of 16), which most x86 servers in use would run. The kernels'
tests run again in a child pytest against that build: every kernel against its
torch reference, and the default model's greedy tokens against transformers."""
import os
import subprocess
import sys
from pathlib import Path

import pytest

from kernels.cpu_build import cpu_ops_available
from services.worker.cpu_info import cpu_flags

REPO = Path(__file__).resolve().parents[2]
AVX2_FLAGS = {"avx2", "fma", "f16c"}  # what -march=x86-64-v3 builds for
KERNEL_TESTS = ["tests/unit/test_cpu_paged_attention.py",
                "tests/unit/test_cpu_prefill_attention.py", "tests/unit/test_cpu_layers.py",
                "tests/unit/test_cpu_matmul.py", "tests/integration/test_cpu_decode_layers.py"]

pytestmark = pytest.mark.skipif(
    not (AVX2_FLAGS <= cpu_flags() and "avx512f" in cpu_flags() and cpu_ops_available()),
    reason="needs a host with AVX-512 that builds the kernels: elsewhere its own build is "
    "the AVX2 one (or none runs), and the suite tests that")


def _avx2_env() -> dict:
    return {**os.environ, "LLMSERVE_KERNELS_MARCH": "x86-64-v3"}


def test_the_kernels_built_for_avx2_match_their_references():
    built = subprocess.run(
        [sys.executable, "-c", "from kernels.cpu_build import kernels_built_for_avx512 as b; "
         "print('avx512' if b() else 'avx2')"],
        cwd=REPO, env=_avx2_env(), capture_output=True, text=True, timeout=1200)
    assert built.returncode == 0 and built.stdout.split()[-1] == "avx2", built.stderr[-3000:]
    run = subprocess.run([sys.executable, "-m", "pytest", "-q", "-p", "no:cacheprovider",
                          *KERNEL_TESTS], cwd=REPO, env=_avx2_env(), capture_output=True,
                         text=True, timeout=1200)
    summary = run.stdout.strip().splitlines()[-1] if run.stdout.strip() else ""
    assert run.returncode == 0, run.stdout[-6000:] + run.stderr[-2000:]
    assert " passed" in summary and "failed" not in summary, summary
