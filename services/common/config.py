"""The engine's settings: one dataclass per layer, each setting declared once
(setting.py says what is derived from these declarations)."""
from __future__ import annotations

from dataclasses import dataclass, field

from services.common.pooling_params import POOLING_TYPES
from services.common.setting import CLI, setting

DEFAULT_MODEL = "SmolLM2-135M-Instruct"
ATTENTION_BACKENDS = ("auto", "cpu_paged", "flash_attn", "triton_attn")
DEVICES = ("auto", "cpu", "cuda")
# Opt-in 16-bit storage for fp32 models ("auto": as the model's dtype).
STORAGE_DTYPES = ("auto", "bfloat16", "float16")
RUNNERS = ("generate", "pooling")


@dataclass
class ModelConfig:
    """Which model to serve and how."""

    model: str = setting(DEFAULT_MODEL, "model name, HF directory or GGUF file", vllm=True)
    dtype: str = setting(
        "auto", "the model's dtype; auto: bf16 on CUDA and on CPUs with native bf16, else fp32",
        vllm=True, choices=("auto", "float32", "bfloat16", "float16"),
        value_aliases={"float": "float32", "half": "float16"})
    max_model_len: int = setting(2048, "the longest sequence (prompt and output) served",
                                 vllm=True)
    seed: int = setting(0, "the seed of every sampler's random numbers (a request's own "
                        "seed overrides it)", vllm=True)
    attention_backend: str = setting(
        "auto", "cpu_paged: our C++ paged-attention kernels (torch references off the CPU); "
        "flash_attn: flash-attn 2 on CUDA (16-bit, blocks of a multiple of 256 tokens); "
        "triton_attn: our Triton FlashAttention kernel on CUDA (any block size, fp32 too); "
        "auto: flash_attn on CUDA where it is installed and suits the dtype and block size, "
        "else triton_attn on CUDA, cpu_paged on the CPU", vllm=True, choices=ATTENTION_BACKENDS,
        # torch_sdpa: this backend's old name; the others are vLLM's names.
        value_aliases={"torch_sdpa": "cpu_paged", "CPU_ATTN": "cpu_paged",
                       "FLASH_ATTN": "flash_attn", "TRITON_ATTN": "triton_attn"})
    enforce_eager: bool = setting(False, "CUDA: run every step eagerly, without replaying "
                                  "CUDA graphs for decodes", vllm=True)
    weight_dtype: str = setting(
        "auto", "fp32 models on CPUs without bf16 units: also keep the weights in 16 bits, "
        "read so by decodes of a few sequences (faster, slightly different outputs; opt-in); "
        "auto: as dtype", choices=STORAGE_DTYPES, value_aliases={"": "auto"})
    runner: str = setting(
        "generate", "what the model is served for: generate (Generate, /v1/completions, "
        "/v1/chat/completions, LLM.generate and chat) or pooling (Embed, /v1/embeddings, "
        "/v1/score, LLM.embed, encode and score: an embedding model); the engine itself "
        "runs both kinds of request (LLMEngine)", vllm=True, choices=RUNNERS)
    pooling_type: str = setting(
        "LAST", "how a pooling request's last-layer hidden states become one vector: LAST "
        "(the last prompt token's, as decoder embedding models pool), MEAN or CLS (the first "
        "token's); vLLM's pooler_config pooling_type", choices=POOLING_TYPES)
    pooling_normalize: bool = setting(
        True, "scale pooled vectors to length 1 unless a request says otherwise; vLLM's "
        "pooler_config normalize")


@dataclass
class CacheConfig:
    """The paged KV cache."""

    block_size: int = setting(16, "tokens per KV cache block", vllm=True)
    kv_cache_bytes: int = setting(1 << 30, "CPU: memory for the KV cache, in GiB",
                                  arg="kv_cache_gib", scale=1 << 30)
    gpu_memory_utilization: float = setting(
        0.9, "CUDA: the share of GPU memory for weights, activations and KV cache", vllm=True)
    enable_prefix_caching: bool = setting(
        True, "reuse the KV blocks of prompt prefixes already computed", vllm=True,
        flag_aliases=("--no-prefix-caching",))
    kv_cache_dtype: str = setting(
        "auto", "store the KV cache in 16 bits (half the memory and the bytes decode "
        "attention reads; opt-in); auto: as the model's dtype", vllm=True,
        choices=STORAGE_DTYPES, value_aliases={"": "auto"})


@dataclass
class SchedulerConfig:
    """Limits of one scheduler step."""

    max_num_seqs: int = setting(256, "requests in one step", vllm=True)
    max_num_batched_tokens: int = setting(2048, "tokens in one step", vllm=True)
    # Offline, throughput is what counts: no cap (the server caps steps to bound
    # inter-token latency).
    max_step_tokens_while_decoding: int = setting(
        256, "while any request decodes, a step carries at most this many tokens: its "
        "decodes, then prompt tokens in what is left (at least a quarter), so a burst of "
        "arrivals delays each decode by a bounded step (0: no cap; a step without decodes "
        "always uses the whole budget)", offline_default=0)
    policy: str = setting("fcfs", "fcfs, or priority: lower priority values first, then "
                          "earliest arrival", vllm=True, arg="scheduling_policy",
                          choices=("fcfs", "priority"))
    # Costs one more token's compute for a request that stops on EOS or a stop
    # token. Off while a structured-outputs request runs (its bitmask needs the
    # token in flight), and with in-process workers (the offline API), which run
    # each step inside the call.
    async_scheduling: bool = setting(
        True, "schedule step N+1 while the workers run step N, so that scheduling and the "
        "hop to the workers leave no gap between their steps", vllm=True)
    max_waiting_requests: int = setting(
        1024, "refuse new requests (RESOURCE_EXHAUSTED) beyond this many waiting")


@dataclass
class ParallelConfig:
    """How the model is split across worker processes."""

    tensor_parallel_size: int = setting(1, "worker processes each stage's layers are split "
                                        "across (sharding every weight)", vllm=True,
                                        flag_aliases=("-tp",))
    pipeline_parallel_size: int = setting(
        1, "stages the decoder layers are split into, each a worker process (or a "
        "tensor-parallel group of them) holding only its layers' weights and KV cache",
        vllm=True, flag_aliases=("-pp",))
    pp_layer_partition: str = setting(
        "", "layers per stage, comma-separated (vLLM's VLLM_PP_LAYER_PARTITION); empty: even "
        "shares, the remainder to the stages before the last")
    device: str = setting("auto", "where the workers run: cuda (rank i on GPU i) or cpu; "
                          "auto: cuda when torch sees a GPU, else cpu", choices=DEVICES)
    # Not offline: in-process workers form no group.
    distributed_init_method: str = setting(
        "", "where the workers' torch.distributed group meets, tcp://host:port (default: "
        "rank 0's host and a port free on the engine core's)", scopes=(CLI,))


@dataclass
class LoRAConfig:
    """LoRA adapters."""

    enable_lora: bool = setting(False, "serve LoRA adapters", vllm=True)
    max_loras: int = setting(1, "distinct LoRA adapters in one step (each takes a slot in "
                             "every LoRA layer)", vllm=True)
    max_lora_rank: int = setting(16, "the highest adapter rank accepted", vllm=True)

    @property
    def num_slots(self) -> int:
        """Adapter slots the workers hold: max_loras, or 0 with LoRA off."""
        return self.max_loras if self.enable_lora else 0


@dataclass
class StructuredOutputsConfig:
    """Compiling structured-outputs constraints (services/engine_core/grammar.py)."""

    compile_timeout_s: float = setting(
        10.0, "seconds a constraint may take to compile; a slower one is stopped and its "
        "request refused (INVALID_ARGUMENT)", arg="structured_outputs_compile_timeout")


@dataclass
class EngineConfig:
    model: ModelConfig = field(default_factory=ModelConfig)
    cache: CacheConfig = field(default_factory=CacheConfig)
    scheduler: SchedulerConfig = field(default_factory=SchedulerConfig)
    parallel: ParallelConfig = field(default_factory=ParallelConfig)
    lora: LoRAConfig = field(default_factory=LoRAConfig)
    structured_outputs: StructuredOutputsConfig = field(default_factory=StructuredOutputsConfig)
