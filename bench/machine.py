"""Where and with what a run happened: CPU, cores, library versions, load."""
from __future__ import annotations

import os
import platform

import torch
import transformers


def cpu_model() -> str:
    from services.worker.cpu_info import cpuinfo_field

    return cpuinfo_field("model name") or platform.processor() or "unknown"


def bf16_native() -> bool:
    """Whether this CPU computes bf16 natively (what `--dtype auto` checks)."""
    from services.worker.model_loader import cpu_has_bf16

    return cpu_has_bf16()


def default_dtypes() -> list[str]:
    """float32, and bfloat16 too where the CPU computes it natively (elsewhere it is
    emulated and slow, so no one would choose it)."""
    return ["float32", "bfloat16"] if bf16_native() else ["float32"]


def load_average() -> float:
    return os.getloadavg()[0]


def machine_info() -> dict:
    from services.worker.cpu_info import cpu_class

    return {"cpu": cpu_model(), "cpu_class": cpu_class(), "cores": len(os.sched_getaffinity(0)),
            "torch": torch.__version__, "torch_threads": torch.get_num_threads(),
            "transformers": transformers.__version__, "python": platform.python_version(),
            "platform": platform.platform()}
