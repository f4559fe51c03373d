"""EngineArgs: the offline API's engine settings (vLLM's EngineArgs, with the
options llmserve has), turned into the per-layer config dataclasses."""
from __future__ import annotations

from dataclasses import dataclass

from services.common.config import (DEFAULT_MODEL, CacheConfig, EngineConfig, LoRAConfig,
                                    ModelConfig, SchedulerConfig)


@dataclass
class EngineArgs:
    model: str = DEFAULT_MODEL
    dtype: str = "auto"
    # Opt-in speed modes (see ModelConfig.weight_dtype, CacheConfig.kv_cache_dtype).
    weight_dtype: str = ""
    kv_cache_dtype: str = ""
    max_model_len: int = 2048
    seed: int = 0
    # CPU: memory for the KV cache (vLLM-CPU's VLLM_CPU_KVCACHE_SPACE).
    kv_cache_gib: float = 1.0
    block_size: int = 16
    enable_prefix_caching: bool = True
    max_num_seqs: int = 256
    max_num_batched_tokens: int = 2048
    # Offline, throughput is what counts: no cap on a step while requests decode
    # (the server caps it to bound inter-token latency; see SchedulerConfig).
    max_step_tokens_while_decoding: int = 0
    # "fcfs", or "priority" (lower values first).
    scheduling_policy: str = "fcfs"
    max_waiting_requests: int = 1024
    # LoRA adapters (see LoRAConfig).
    enable_lora: bool = False
    max_loras: int = 1
    max_lora_rank: int = 16

    def create_engine_config(self) -> EngineConfig:
        return EngineConfig(
            model=ModelConfig(model=self.model, dtype=self.dtype,
                              max_model_len=self.max_model_len, seed=self.seed,
                              weight_dtype=self.weight_dtype),
            cache=CacheConfig(block_size=self.block_size,
                              kv_cache_bytes=int(self.kv_cache_gib * (1 << 30)),
                              enable_prefix_caching=self.enable_prefix_caching,
                              kv_cache_dtype=self.kv_cache_dtype),
            scheduler=SchedulerConfig(max_num_seqs=self.max_num_seqs,
                                      max_num_batched_tokens=self.max_num_batched_tokens,
                                      max_step_tokens_while_decoding=(
                                          self.max_step_tokens_while_decoding),
                                      policy=self.scheduling_policy,
                                      max_waiting_requests=self.max_waiting_requests),
            lora=LoRAConfig(enable_lora=self.enable_lora, max_loras=self.max_loras,
                            max_lora_rank=self.max_lora_rank))
