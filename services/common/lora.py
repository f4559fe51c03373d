"""LoRARequest: which adapter a request runs with (vLLM's vllm.lora.request.LoRARequest)."""
from __future__ import annotations

from dataclasses import dataclass


@dataclass(frozen=True)
class LoRARequest:
    # The name requests and the HTTP API's `model` know it by.
    lora_name: str
    # Unique and > 0 (0 means "no adapter" inside the engine).
    lora_int_id: int
    # A PEFT adapter directory: adapter_config.json + adapter_model.safetensors.
    lora_path: str
