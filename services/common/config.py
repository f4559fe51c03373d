"""Configuration dataclasses, one per concern, built from command-line flags."""
from __future__ import annotations

import argparse
from dataclasses import dataclass, field

DEFAULT_MODEL = "SmolLM2-135M-Instruct"


@dataclass
class ModelConfig:
    """Which model to serve and how."""

    model: str = DEFAULT_MODEL  # a known model name or an HF directory
    dtype: str = "auto"  # "auto" picks bf16 where the CPU has it, else fp32
    max_model_len: int = 2048
    seed: int = 0
    # "auto": flash_attn on CUDA when flash-attn is installed, torch_sdpa otherwise.
    attention_backend: str = "auto"
    # CUDA: run every step eagerly instead of replaying CUDA graphs for decodes.
    enforce_eager: bool = False
    # Opt-in, for fp32 models on CPUs without bf16 units: "bfloat16" or "float16"
    # keeps the weights in 16 bits too, read so by steps of a few rows (fp32
    # activations and sums). "": as dtype.
    weight_dtype: str = ""


@dataclass
class CacheConfig:
    """The paged KV cache."""

    block_size: int = 16
    kv_cache_bytes: int = 1 << 30  # CPU: memory given to the KV cache
    # CUDA: the share of GPU memory for weights, activations and KV cache.
    gpu_memory_utilization: float = 0.9
    enable_prefix_caching: bool = True
    # Opt-in: "bfloat16" or "float16" stores K/V in 16 bits (half the memory and
    # the bytes decode attention reads). "": as the model's dtype.
    kv_cache_dtype: str = ""


@dataclass
class SchedulerConfig:
    """Limits of one scheduler step."""

    max_num_seqs: int = 256
    max_num_batched_tokens: int = 2048
    # While any request is decoding, a step carries at most this many tokens: all
    # its decodes, then prompt tokens in what is left (at least a quarter of this
    # many), so a burst of arrivals delays each decode by a bounded step instead
    # of a whole token budget of prefill. 0: no cap (best throughput, the offline
    # API's default). A step without decodes always uses the whole budget.
    max_step_tokens_while_decoding: int = 256
    # "fcfs", or "priority": lowest priority value first, then earliest arrival.
    policy: str = "fcfs"
    # Schedule step N+1 while the workers run step N (vLLM's async scheduling), so
    # that the scheduling and the hop to the workers leave no gap between their
    # steps. Costs one more token's compute for a request that stops on EOS or a
    # stop token. Off while a structured-outputs request runs (its bitmask needs
    # the token in flight), and with in-process workers (the offline API), which
    # run each step inside the call.
    async_scheduling: bool = True
    # New requests beyond this many waiting are refused (RESOURCE_EXHAUSTED).
    max_waiting_requests: int = 1024


@dataclass
class ParallelConfig:
    """How the model is split across worker processes."""

    tensor_parallel_size: int = 1
    # Where the workers' torch.distributed group meets (tcp://host:port); the
    # engine core picks one when empty.
    distributed_init_method: str = ""


@dataclass
class LoRAConfig:
    """LoRA adapters (vLLM's enable_lora, max_loras, max_lora_rank)."""

    enable_lora: bool = False
    # Distinct adapters in one step (each takes a slot in every LoRA layer).
    max_loras: int = 1
    max_lora_rank: int = 16

    @property
    def num_slots(self) -> int:
        """Adapter slots the workers hold: max_loras, or 0 with LoRA off."""
        return self.max_loras if self.enable_lora else 0


@dataclass
class EngineConfig:
    model: ModelConfig = field(default_factory=ModelConfig)
    cache: CacheConfig = field(default_factory=CacheConfig)
    scheduler: SchedulerConfig = field(default_factory=SchedulerConfig)
    parallel: ParallelConfig = field(default_factory=ParallelConfig)
    lora: LoRAConfig = field(default_factory=LoRAConfig)


def add_engine_args(parser: argparse.ArgumentParser) -> None:
    """Flags for EngineConfig; read back with engine_config_from_args."""
    d_model, d_cache, d_sched = ModelConfig(), CacheConfig(), SchedulerConfig()
    parser.add_argument("--model", default=d_model.model,
                        help="model name or HF directory (default: %(default)s)")
    parser.add_argument("--dtype", default=d_model.dtype,
                        choices=["auto", "float32", "bfloat16", "float16"])
    parser.add_argument("--max-model-len", type=int, default=d_model.max_model_len)
    parser.add_argument("--seed", type=int, default=d_model.seed)
    parser.add_argument("--attention-backend", default=d_model.attention_backend,
                        choices=["auto", "torch_sdpa", "flash_attn"])
    parser.add_argument("--weight-dtype", default=d_model.weight_dtype,
                        choices=["", "bfloat16", "float16"],
                        help="fp32 models: also keep 16-bit weights for decodes of few "
                             "sequences (faster, slightly different outputs; opt-in)")
    parser.add_argument("--kv-cache-dtype", default=d_cache.kv_cache_dtype,
                        choices=["", "bfloat16", "float16"],
                        help="store the KV cache in 16 bits (opt-in; default: the dtype)")
    parser.add_argument("--enforce-eager", action="store_true",
                        help="CUDA: no CUDA graphs for decode steps")
    parser.add_argument("--gpu-memory-utilization", type=float,
                        default=d_cache.gpu_memory_utilization)
    parser.add_argument("--block-size", type=int, default=d_cache.block_size)
    parser.add_argument("--kv-cache-gib", type=float, default=d_cache.kv_cache_bytes / (1 << 30),
                        help="KV cache size on CPU, in GiB (default: %(default)s)")
    parser.add_argument("--tensor-parallel-size", "-tp", type=int, default=1,
                        help="worker processes the model is split across")
    parser.add_argument("--no-prefix-caching", dest="enable_prefix_caching",
                        action="store_false", help="turn prefix caching off")
    parser.add_argument("--max-num-seqs", type=int, default=d_sched.max_num_seqs)
    parser.add_argument("--max-num-batched-tokens", type=int,
                        default=d_sched.max_num_batched_tokens)
    parser.add_argument("--max-step-tokens-while-decoding", type=int,
                        default=d_sched.max_step_tokens_while_decoding,
                        help="cap on a step's tokens while requests decode (decodes first, "
                             "prompts in the rest), which bounds inter-token latency under "
                             "bursts (0: no cap)")
    parser.add_argument("--scheduling-policy", dest="policy", default=d_sched.policy,
                        choices=["fcfs", "priority"],
                        help="priority: lower priority values are served first")
    parser.add_argument("--max-waiting-requests", type=int, default=d_sched.max_waiting_requests,
                        help="refuse new requests (RESOURCE_EXHAUSTED) beyond this many waiting")
    parser.add_argument("--no-async-scheduling", dest="async_scheduling", action="store_false",
                        help="schedule each step only after the last one's output is back")
    d_lora = LoRAConfig()
    parser.add_argument("--enable-lora", action="store_true", help="serve LoRA adapters")
    parser.add_argument("--max-loras", type=int, default=d_lora.max_loras,
                        help="distinct LoRA adapters in one step (default: %(default)s)")
    parser.add_argument("--max-lora-rank", type=int, default=d_lora.max_lora_rank,
                        help="the highest adapter rank accepted (default: %(default)s)")


def engine_config_from_args(args: argparse.Namespace) -> EngineConfig:
    return EngineConfig(
        model=ModelConfig(model=args.model, dtype=args.dtype,
                          max_model_len=args.max_model_len, seed=args.seed,
                          attention_backend=args.attention_backend,
                          enforce_eager=args.enforce_eager, weight_dtype=args.weight_dtype),
        cache=CacheConfig(block_size=args.block_size,
                          kv_cache_bytes=int(args.kv_cache_gib * (1 << 30)),
                          gpu_memory_utilization=args.gpu_memory_utilization,
                          enable_prefix_caching=args.enable_prefix_caching,
                          kv_cache_dtype=args.kv_cache_dtype),
        scheduler=SchedulerConfig(max_num_seqs=args.max_num_seqs,
                                  max_num_batched_tokens=args.max_num_batched_tokens,
                                  max_step_tokens_while_decoding=(
                                      args.max_step_tokens_while_decoding),
                                  policy=args.policy,
                                  max_waiting_requests=args.max_waiting_requests,
                                  async_scheduling=args.async_scheduling),
        parallel=ParallelConfig(tensor_parallel_size=args.tensor_parallel_size),
        lora=LoRAConfig(enable_lora=args.enable_lora, max_loras=args.max_loras,
                        max_lora_rank=args.max_lora_rank),
    )


def engine_args_to_argv(config: EngineConfig) -> list[str]:
    """The flags that rebuild `config` in another process."""
    m, c, s, p, lora = config.model, config.cache, config.scheduler, config.parallel, config.lora
    return ["--model", m.model, "--dtype", m.dtype, "--max-model-len", str(m.max_model_len),
            "--seed", str(m.seed), "--attention-backend", m.attention_backend,
            *(["--enforce-eager"] if m.enforce_eager else []),
            "--weight-dtype", m.weight_dtype, "--kv-cache-dtype", c.kv_cache_dtype,
            "--gpu-memory-utilization", repr(c.gpu_memory_utilization),
            "--block-size", str(c.block_size),
            "--kv-cache-gib", repr(c.kv_cache_bytes / (1 << 30)),
            "--max-num-seqs", str(s.max_num_seqs),
            "--max-num-batched-tokens", str(s.max_num_batched_tokens),
            "--max-step-tokens-while-decoding", str(s.max_step_tokens_while_decoding),
            "--scheduling-policy", s.policy,
            "--max-waiting-requests", str(s.max_waiting_requests),
            *([] if s.async_scheduling else ["--no-async-scheduling"]),
            "--tensor-parallel-size", str(p.tensor_parallel_size),
            *([] if c.enable_prefix_caching else ["--no-prefix-caching"]),
            *(["--enable-lora"] if lora.enable_lora else []),
            "--max-loras", str(lora.max_loras), "--max-lora-rank", str(lora.max_lora_rank)]
