"""The GPU suite (make test-gpu): every test here needs CUDA and skips without it, so
`make test` collects it on the CPU; `record` keeps the figures the report prints."""
from __future__ import annotations

import json
import os

import pytest
import torch

from services.common.config import (CacheConfig, EngineConfig, LoRAConfig, ModelConfig,
                                    ParallelConfig, SchedulerConfig)

HAS_CUDA = torch.cuda.is_available()
NO_CUDA = "no CUDA GPU here: tests/gpu runs on an NVIDIA machine (make test-gpu)"
# tests/gpu checks compiled kernels: the interpreter would make every kernel check a CPU one.
assert not (HAS_CUDA and os.environ.get("TRITON_INTERPRET", "0") not in ("", "0")), \
    "unset TRITON_INTERPRET: tests/gpu checks the compiled Triton kernels"


def pytest_collection_modifyitems(config, items):
    if HAS_CUDA:
        return
    skip = pytest.mark.skip(reason=NO_CUDA)
    for item in items:
        if "tests/gpu/" in item.nodeid:
            item.add_marker(skip)


@pytest.fixture
def record(request):
    """record(**figures): figures of this check for the report (tests/gpu/run.py)."""
    path = os.environ.get("LLMSERVE_GPU_RECORD")

    def write(**figures):
        if path:
            with open(path, "a") as f:
                f.write(json.dumps({"check": request.node.nodeid, **figures}) + "\n")
    return write


def gpu_config(model_dir: str, dtype: str = "float32", utilization: float = 0.2,
               enforce_eager: bool = False, max_num_seqs: int = 64,
               enable_lora: bool = False) -> EngineConfig:
    """An engine on GPU 0 that takes `utilization` of its memory (several fit at once)."""
    return EngineConfig(
        model=ModelConfig(model=model_dir, dtype=dtype, enforce_eager=enforce_eager),
        cache=CacheConfig(gpu_memory_utilization=utilization),
        scheduler=SchedulerConfig(max_num_seqs=max_num_seqs),
        parallel=ParallelConfig(device="cuda"),
        lora=LoRAConfig(enable_lora=enable_lora, max_loras=2))
