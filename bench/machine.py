"""Where and with what a run happened: CPU, cores, library versions, load."""
from __future__ import annotations

import os
import platform
from pathlib import Path

import torch
import transformers


def cpu_model() -> str:
    try:
        for line in Path("/proc/cpuinfo").read_text().splitlines():
            if line.startswith("model name"):
                return line.split(":", 1)[1].strip()
    except OSError:
        pass
    return platform.processor() or "unknown"


def load_average() -> float:
    return os.getloadavg()[0]


def machine_info() -> dict:
    return {"cpu": cpu_model(), "cores": len(os.sched_getaffinity(0)),
            "torch": torch.__version__, "torch_threads": torch.get_num_threads(),
            "transformers": transformers.__version__, "python": platform.python_version(),
            "platform": platform.platform()}
