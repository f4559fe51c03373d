"""Builds our model for an HF directory and loads its safetensors weights."""
from __future__ import annotations

import glob
import logging
import os
from typing import Iterator

import torch
from safetensors import safe_open
from transformers import AutoConfig

from services.worker.models import model_class_for

logger = logging.getLogger(__name__)

_DTYPES = {"float32": torch.float32, "bfloat16": torch.bfloat16, "float16": torch.float16}


def cpu_has_bf16() -> bool:
    """True when the CPU computes bf16 natively (AMX or AVX512-BF16)."""
    try:
        with open("/proc/cpuinfo") as f:
            flags = next((line for line in f if line.startswith("flags")), "").split()
    except OSError:
        return False
    return "amx_bf16" in flags or "avx512_bf16" in flags


def resolve_dtype(name: str, device: torch.device) -> torch.dtype:
    """'auto' is bf16 on CUDA and on CPUs with native bf16, fp32 elsewhere."""
    if name == "auto":
        return torch.bfloat16 if device.type == "cuda" or cpu_has_bf16() else torch.float32
    if name not in _DTYPES:
        raise ValueError(f"unknown dtype {name!r}; choose one of {sorted(_DTYPES)} or 'auto'")
    return _DTYPES[name]


def iterate_safetensors(model_dir: str) -> Iterator[tuple[str, torch.Tensor]]:
    files = sorted(glob.glob(os.path.join(model_dir, "*.safetensors")))
    if not files:
        raise FileNotFoundError(f"no *.safetensors files in {model_dir}")
    for path in files:
        with safe_open(path, framework="pt") as f:
            for name in f.keys():
                yield name, f.get_tensor(name)


def load_model(model_dir: str, dtype: torch.dtype, max_positions: int,
               device: torch.device) -> torch.nn.Module:
    config = AutoConfig.from_pretrained(model_dir)
    model_class = model_class_for(config)
    default_dtype = torch.get_default_dtype()
    torch.set_default_dtype(dtype)
    try:
        with device:
            model = model_class(config, max_positions)
    finally:
        torch.set_default_dtype(default_dtype)
    model.load_weights(iterate_safetensors(model_dir))
    logger.info("loaded %s from %s (%s, %s)", model_class.__name__, model_dir, dtype, device)
    return model.eval()
