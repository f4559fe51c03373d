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
import torch

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


# x W^T through our packed GEMM for every tile height (1-8 rows, and a block of
# several tiles), K even and odd; saved to the path in argv[1].
_GEMM_OUTPUTS = """
import sys, torch
from kernels.cpu_build import cpu_ops_available
assert cpu_ops_available()
gen = torch.Generator().manual_seed(0)
out = {}
for k, n in ((576, 960), (33, 100), (1536, 576)):
    packed = torch.ops.llmserve.pack_gemm_weight(torch.randn(n, k, generator=gen))
    for rows in [*range(1, 18), 64, 300]:
        out[(k, n, rows)] = torch.ops.llmserve.gemm(torch.randn(rows, k, generator=gen), packed, n)
torch.save(out, sys.argv[1])
"""


def test_the_avx512_gemm_tile_in_assembly_gives_the_c_loops_bits(tmp_path):
    """With AVX-512 our GEMM's fp32 tile is assembly (gemm_tile_avx512.h); the AVX2
    build runs the C++ loop it replaced. Both sum each output's K products in order
    with FMAs, whatever their tile's shape, so every bit must agree."""
    outputs = {}
    for build, env in (("avx512", os.environ), ("avx2", _avx2_env())):
        path = tmp_path / f"{build}.pt"
        run = subprocess.run([sys.executable, "-c", _GEMM_OUTPUTS, str(path)], cwd=REPO, env=env,
                             capture_output=True, text=True, timeout=1200)
        assert run.returncode == 0, run.stderr[-3000:]
        outputs[build] = torch.load(path)
    assert outputs["avx512"].keys() == outputs["avx2"].keys()
    differ = [key for key, got in outputs["avx512"].items()
              if not torch.equal(got, outputs["avx2"][key])]
    assert not differ, differ
