"""A PEFT LoRA adapter read from its directory: per (layer, projection), A and B
with the adapter's scaling folded into B."""
from __future__ import annotations

import json
import math
import os
import re
from dataclasses import dataclass

import torch
from safetensors.torch import load_file

# The projections an adapter may target (the Llama family's names).
SUPPORTED_MODULES = ("q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj",
                     "down_proj")
_KEY = re.compile(r"layers\.(\d+)\.(?:self_attn|mlp)\.(\w+)\.lora_([AB])\.weight$")


@dataclass
class LoRAAdapter:
    rank: int
    # (layer index, projection) -> (A [rank, in], B [out, rank] * scaling)
    weights: dict[tuple[int, str], tuple[torch.Tensor, torch.Tensor]]


def load_adapter(path: str, max_rank: int) -> LoRAAdapter:
    """Raises ValueError saying what in the adapter llmserve cannot apply."""
    config = _read_config(path)
    rank = int(config["r"])
    if not 0 < rank <= max_rank:
        raise ValueError(f"adapter rank {rank} is above --max-lora-rank {max_rank}")
    alpha = float(config.get("lora_alpha", rank))
    scaling = alpha / math.sqrt(rank) if config.get("use_rslora") else alpha / rank
    tensors = load_file(os.path.join(path, "adapter_model.safetensors"))
    pairs: dict[tuple[int, str], dict[str, torch.Tensor]] = {}
    for key, tensor in tensors.items():
        match = _KEY.search(key)
        if match is None or match.group(2) not in SUPPORTED_MODULES:
            raise ValueError(f"adapter tensor {key!r} is not a LoRA A/B of a supported "
                             f"projection ({', '.join(SUPPORTED_MODULES)})")
        pairs.setdefault((int(match.group(1)), match.group(2)), {})[match.group(3)] = tensor
    weights = {}
    for where, pair in pairs.items():
        if set(pair) != {"A", "B"}:
            raise ValueError(f"adapter has lora_A without lora_B (or the reverse) at {where}")
        weights[where] = (pair["A"].float(), pair["B"].float() * scaling)
    return LoRAAdapter(rank, weights)


def _read_config(path: str) -> dict:
    try:
        with open(os.path.join(path, "adapter_config.json")) as f:
            config = json.load(f)
    except OSError as e:
        raise ValueError(f"{path} is not a PEFT adapter directory: {e}") from None
    unsupported = {"use_dora": bool(config.get("use_dora")),
                   "modules_to_save": bool(config.get("modules_to_save")),
                   "bias": config.get("bias", "none") != "none",
                   "fan_in_fan_out": bool(config.get("fan_in_fan_out"))}
    if config.get("peft_type", "LORA") != "LORA" or any(unsupported.values()):
        named = [k for k, v in unsupported.items() if v] or [config.get("peft_type")]
        raise ValueError(f"adapter uses {', '.join(map(str, named))}, which llmserve does not "
                         "support (plain LoRA on the attention and MLP projections only)")
    return config
