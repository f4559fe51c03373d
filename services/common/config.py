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

    block_size: int = setting(
        16, "tokens per KV cache block (on the CPU the worker warns at start of a size its "
        "attention kernels are not built for)", vllm=True)
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
    # A burst's ITL p99 is the length of the steps that admit its last prompts
    # beside its decodes: 160 tokens is 2.5x the 64 decodes of the bench's burst.
    # At 192 (256 before: over 3x on an AMX Xeon) its ITL p99 / p50 still reached
    # 3.00-3.13 on an AVX2 EPYC; 160 held 1.92-2.11 for 8% more TTFT p50
    # (bench/NOTES.md).
    max_step_tokens_while_decoding: int = setting(
        160, "while requests decode, a step carries at most this many tokens: its "
        "decodes, then prompt tokens in what is left (at least a quarter), so arrivals "
        "delay each decode by a bounded step (0: no cap; a step without decodes, or with "
        "more prompts waiting than requests decoding, as at a burst's start, uses the "
        "whole budget)", offline_default=0)
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


# vLLM's dict argument that holds the SpeculativeConfig settings.
SPECULATIVE_CONFIG = "speculative_config"
SPECULATIVE_METHODS = ("", "ngram", "suffix", "draft_model")


@dataclass
class SpeculativeConfig:
    """Speculative decoding (services/worker/spec_decode/), given as vLLM's
    speculative_config: {"method": "ngram", "num_speculative_tokens": 4, ...}."""

    method: str = setting(
        "", "how drafts are proposed: ngram (the latest earlier occurrence of the "
        "sequence's last tokens, in its prompt and output), suffix (suffix decoding: the most "
        "frequent continuation in this request and in earlier requests' outputs), "
        "draft_model (a smaller model sharing the tokenizer); empty: off", vllm=True,
        group=SPECULATIVE_CONFIG, choices=SPECULATIVE_METHODS)
    num_speculative_tokens: int = setting(
        0, "the most draft tokens a request verifies per step (0 with a method: 4)",
        vllm=True, group=SPECULATIVE_CONFIG)
    prompt_lookup_min: int = setting(
        0, "ngram: the shortest suffix matched (0: as prompt_lookup_max, else 5)", vllm=True,
        group=SPECULATIVE_CONFIG)
    prompt_lookup_max: int = setting(
        0, "ngram: the longest suffix matched (0: as prompt_lookup_min, else 5)", vllm=True,
        group=SPECULATIVE_CONFIG)
    model: str = setting(
        "", "draft_model: the draft's name, HF directory or GGUF file; it must share the "
        "target's tokenizer", vllm=True, group=SPECULATIVE_CONFIG)
    disable_by_batch_size: int = setting(
        8, "no drafts while this many requests or more are running: verifying drafts costs "
        "compute a busy batch has no spare of (0: never)", vllm=True, group=SPECULATIVE_CONFIG)
    suffix_decoding_max_cached_requests: int = setting(
        1000, "suffix: how many finished requests' outputs are kept to draft from", vllm=True,
        group=SPECULATIVE_CONFIG)
    suffix_decoding_min_token_prob: float = setting(
        0.1, "suffix: a draft ends at a token whose frequency among the matched "
        "continuations is below this", vllm=True, group=SPECULATIVE_CONFIG)

    @property
    def enabled(self) -> bool:
        return bool(self.method)

    @property
    def num_tokens(self) -> int:
        """Draft tokens per request and step, the default filled in."""
        return self.num_speculative_tokens or 4

    @property
    def lookup_range(self) -> tuple[int, int]:
        """ngram's (shortest, longest) suffix, vLLM's defaults filled in."""
        low, high = self.prompt_lookup_min, self.prompt_lookup_max
        return (low or high or 5, high or low or 5)

    def check(self) -> None:
        """ValueError naming the key to change, for values no method can run with."""
        name = SPECULATIVE_CONFIG
        for key in ("num_speculative_tokens", "prompt_lookup_min", "prompt_lookup_max",
                    "disable_by_batch_size", "suffix_decoding_max_cached_requests"):
            if getattr(self, key) < 0:
                raise ValueError(f"{name}.{key} must be >= 0; got {getattr(self, key)}")
        if not self.enabled:
            if self != SpeculativeConfig():
                raise ValueError(f"{name} needs a method ({', '.join(SPECULATIVE_METHODS[1:])})")
            return
        low, high = self.lookup_range
        if low > high:
            raise ValueError(f"{name}.prompt_lookup_min ({low}) must be <= prompt_lookup_max "
                             f"({high})")
        if (self.method == "draft_model") != bool(self.model):
            raise ValueError(f"{name}.model names the draft model, and only method "
                             f"'draft_model' takes one; got method {self.method!r}, model "
                             f"{self.model!r}")
        if not 0 <= self.suffix_decoding_min_token_prob <= 1:
            raise ValueError(f"{name}.suffix_decoding_min_token_prob must be in [0, 1]")


@dataclass
class EngineConfig:
    model: ModelConfig = field(default_factory=ModelConfig)
    cache: CacheConfig = field(default_factory=CacheConfig)
    scheduler: SchedulerConfig = field(default_factory=SchedulerConfig)
    parallel: ParallelConfig = field(default_factory=ParallelConfig)
    lora: LoRAConfig = field(default_factory=LoRAConfig)
    structured_outputs: StructuredOutputsConfig = field(default_factory=StructuredOutputsConfig)
    speculative: SpeculativeConfig = field(default_factory=SpeculativeConfig)
