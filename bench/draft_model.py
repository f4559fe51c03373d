"""A draft model for speculative decoding when none ships with the target: the
target's first layers, with its embeddings, final norm, head and tokenizer (a
layer-skipping self-draft). SmolLM2-135M is the smallest model of its family, so
no smaller trained model shares its tokenizer."""
from __future__ import annotations

from pathlib import Path

import torch


def write_layer_draft(target_dir: str, out_dir: str | Path, num_layers: int) -> str:
    """Writes the draft (fp32 safetensors and the target's tokenizer) into out_dir."""
    from transformers import AutoModelForCausalLM, AutoTokenizer

    model = AutoModelForCausalLM.from_pretrained(target_dir, dtype=torch.float32)
    model.model.layers = model.model.layers[:num_layers]
    model.config.num_hidden_layers = num_layers
    if getattr(model.config, "layer_types", None):
        model.config.layer_types = model.config.layer_types[:num_layers]
    model.save_pretrained(out_dir)
    AutoTokenizer.from_pretrained(target_dir).save_pretrained(out_dir)
    return str(out_dir)
