"""The machine floor, measured in the same run: GEMM rates at the model's linear
shapes (the fastest of the ways we know to multiply by a weight here: torch's, and
our GEMV for a few rows), memory copy bandwidth and GEMV weight streaming, and
from them the fastest any engine could run the benchmark's workloads on this
machine.

Floors count only the linear layers (attention, norms and sampling are left out),
so every measured throughput is below its floor; the fraction says how close. Each
workload's floor also has a `with_kv_reads` figure: the linears plus the decode
attention's reads of the KV cache, the bound of an engine (vLLM's or ours) that runs
a layer's linears and its attention one after the other."""
from __future__ import annotations

import json
import time
from dataclasses import asdict, dataclass
from pathlib import Path

# The cap on prefill rows timed: prefills run in chunks of hundreds to thousands
# of rows, where the GEMM rate has long stopped growing with M.
PREFILL_ROWS = 256
COPY_BYTES = 256 << 20  # well past the last-level cache


@dataclass(frozen=True)
class ModelShape:
    """The dimensions that set a Llama-family model's linear layers (defaults: SmolLM2-135M)."""
    hidden: int = 576
    intermediate: int = 1536
    heads: int = 9
    kv_heads: int = 3
    head_dim: int = 64
    layers: int = 30
    vocab: int = 49152

    @classmethod
    def from_model_dir(cls, model_dir: str) -> ModelShape:
        c = json.loads((Path(model_dir) / "config.json").read_text())
        heads = c["num_attention_heads"]
        return cls(hidden=c["hidden_size"], intermediate=c["intermediate_size"], heads=heads,
                   kv_heads=c.get("num_key_value_heads", heads),
                   head_dim=c.get("head_dim") or c["hidden_size"] // heads,
                   layers=c["num_hidden_layers"], vocab=c["vocab_size"])

    def linears(self) -> list[tuple[str, int, int, int]]:
        """(name, in features, out features, count) of every linear a token goes through."""
        qkv = (self.heads + 2 * self.kv_heads) * self.head_dim
        return [("qkv", self.hidden, qkv, self.layers),
                ("o", self.heads * self.head_dim, self.hidden, self.layers),
                ("gate_up", self.hidden, 2 * self.intermediate, self.layers),
                ("down", self.intermediate, self.hidden, self.layers),
                ("lm_head", self.hidden, self.vocab, 1)]

    def params(self, with_head: bool = True) -> int:
        """Weight parameters one token uses (the embedding lookup reads one row: left out)."""
        return sum(k * n * count for name, k, n, count in self.linears()
                   if with_head or name != "lm_head")

    def kv_values_per_token(self) -> int:
        """K and V values one token keeps in every layer's cache."""
        return 2 * self.layers * self.kv_heads * self.head_dim


@dataclass
class Measured:
    """What the machine did: GFLOP/s of a whole pass over the linears per M, and the
    fastest weight streaming measured (GB/s)."""
    gflop_s: dict[int, float]
    stream_gb_s: float
    bytes_per_param: int

    def rate(self, m: int) -> float:
        """GFLOP/s at m rows: the best measured at any M <= m, since m rows can always be
        run in chunks of fewer (this also keeps one noisy sample from lowering the bar)."""
        return max(v for k, v in self.gflop_s.items() if k <= m)


def prefill_rows(requests: int, prompt_len: int) -> int:
    return min(PREFILL_ROWS, requests * prompt_len)


def prefill_seconds(shape: ModelShape, m: Measured, prompt_tokens: int, rows: int) -> float:
    """Prompt tokens through the body at the prefill rate (the LM head runs on sampled
    rows only, counted with the output tokens)."""
    return prompt_tokens * 2 * shape.params(with_head=False) / (m.rate(rows) * 1e9)


def decode_seconds(shape: ModelShape, m: Measured, output_tokens: int, batch: int) -> float:
    """Output tokens decoded `batch` at a time: GEMM-bound at the measured rate for a
    batch, weight-streaming-bound (every weight read once per token) for one stream."""
    if batch == 1:
        return output_tokens * shape.params() * m.bytes_per_param / (m.stream_gb_s * 1e9)
    return output_tokens * 2 * shape.params() / (m.rate(batch) * 1e9)


def kv_read_seconds(shape: ModelShape, m: Measured, requests: int, prompt_len: int,
                    output_len: int) -> float:
    """The decode steps' attention reading the KV cache (in the model's dtype) at the
    weight-streaming rate: the first output token comes from the prefill; the i-th
    after it attends to prompt_len + i cached tokens, each read once per step. Any
    engine that keeps K and V in that dtype reads these bytes; a batch's GEMMs and
    these reads follow each other within a layer, so they add up."""
    steps = max(0, output_len - 1)
    tokens_read = requests * (steps * prompt_len + steps * (steps + 1) // 2)
    bytes_read = tokens_read * shape.kv_values_per_token() * m.bytes_per_param
    return bytes_read / (m.stream_gb_s * 1e9)


def workload_floor(shape: ModelShape, m: Measured, requests: int, prompt_len: int,
                   output_len: int, batch: int) -> dict:
    """The fastest `requests` requests of prompt_len + output_len tokens could run,
    decoded `batch` at a time: seconds and tok/s; `with_kv_reads` adds the decode
    attention's reads of the KV cache to the linears."""
    prompt_tokens, output_tokens = requests * prompt_len, requests * output_len

    def rates(seconds: float) -> dict:
        return {"seconds": seconds, "output_tok_s": output_tokens / seconds,
                "total_tok_s": (prompt_tokens + output_tokens) / seconds}

    seconds = (prefill_seconds(shape, m, prompt_tokens, prefill_rows(requests, prompt_len))
               + decode_seconds(shape, m, output_tokens, batch))
    with_kv = seconds + kv_read_seconds(shape, m, requests, prompt_len, output_len)
    out = {**rates(seconds), "with_kv_reads": rates(with_kv)}
    if batch == 1:
        per_token = decode_seconds(shape, m, 1, 1)
        out.update(decode_tok_s=1 / per_token, itl_s=per_token)
    return out


def embed_floor(shape: ModelShape, m: Measured, requests: int, prompt_len: int) -> dict:
    """The fastest `requests` prompts could be embedded: their tokens through the body
    at the prefill rate (a pooling request runs no LM head)."""
    tokens = requests * prompt_len
    seconds = prefill_seconds(shape, m, tokens, prefill_rows(requests, prompt_len))
    return {"seconds": seconds, "prompts_s": requests / seconds, "tok_s": tokens / seconds}


def batch_sizes(s) -> list[int]:
    """Every M a floor needs: one stream, each decode batch, the prefill rows."""
    ms = {1, s.requests, s.large_requests, prefill_rows(s.requests, s.prompt_len),
          prefill_rows(s.embed_requests, s.prompt_len),
          prefill_rows(1, s.prompt_len), *s.concurrency}
    return sorted(m for m in ms if m > 0)  # --large-requests 0: no larger run


def floors(shape: ModelShape, m: Measured, s) -> dict:
    """The floor of every workload the settings run (Settings from bench.settings)."""
    out = {"offline": workload_floor(shape, m, s.requests, s.prompt_len, s.output_len,
                                     s.requests),
           "single_stream": workload_floor(shape, m, 1, s.prompt_len, s.single_stream_len, 1),
           # transformers at batch 1: requests one after another, each a single stream.
           "batch1": workload_floor(shape, m, 1, s.prompt_len, s.output_len, 1),
           "serving": {}}
    if s.large_requests:
        out["offline_large"] = workload_floor(shape, m, s.large_requests, s.prompt_len,
                                              s.output_len, s.large_requests)
    if s.embed_requests:
        out["embeddings"] = embed_floor(shape, m, s.embed_requests, s.prompt_len)
    for c in s.concurrency:
        n = s.level_requests(c)
        out["serving"][str(c)] = workload_floor(shape, m, n, s.prompt_len, s.output_len, c)
    return out


def measure(shape: ModelShape, dtype: str, ms: list[int]) -> dict:
    """Times the model's linears at each M and a large copy, in this process's threads."""
    import torch

    from bench import floor_measure as fm

    torch_dtype = getattr(torch, dtype)
    paths = fm.prepare(fm.make_weights(shape.linears(), torch_dtype))
    # JSON keys are strings: M as a string from the start, the same in memory and on disk.
    passes = {str(m): fm.time_pass(paths, torch_dtype, m) for m in ms}
    path_names = list(paths)
    del paths
    per_param = torch.empty((), dtype=torch_dtype).element_size()
    return {"dtype": dtype, "torch_threads": torch.get_num_threads(),
            "shape": asdict(shape), "params_per_token": shape.params(),
            "body_params_per_token": shape.params(with_head=False),
            "weight_bytes": shape.params() * per_param, "bytes_per_param": per_param,
            **pass_rates(shape, {k: p["seconds"] for k, p in passes.items()}, per_param),
            "passes": passes, "paths": path_names, "copy_gb_s": fm.copy_bandwidth(COPY_BYTES)}


def pass_rates(shape: ModelShape, seconds: dict[str, float], bytes_per_param: int) -> dict:
    """From a pass's seconds at each M (keys as strings): `gflop_s` at each M, and
    `gemv_gb_s`, the one-row pass's weight-streaming rate (0 without M=1)."""
    one = seconds.get("1", float("inf"))
    return {"gflop_s": {k: 2 * int(k) * shape.params() / t / 1e9 for k, t in seconds.items()},
            "gemv_gb_s": shape.params() * bytes_per_param / one / 1e9}


def stream_rate(result: dict) -> float:
    """GB/s a decode step can read weights at: the faster of the copy and the fastest
    one-row pass (a copy's traffic understates what reads alone reach: each written
    line is read for ownership first, uncounted)."""
    return max(result["copy_gb_s"], result["gemv_gb_s"])


def measured_from(result: dict) -> Measured:
    """The Measured of a measure() result (also after a JSON round trip: keys as strings)."""
    return Measured(gflop_s={int(k): v for k, v in result["gflop_s"].items()},
                    stream_gb_s=stream_rate(result), bytes_per_param=result["bytes_per_param"])


def run_floor(model_dir: str, s) -> dict:
    """Measures the machine and derives the floors of this run's workloads."""
    start = time.perf_counter()
    shape = ModelShape.from_model_dir(model_dir)
    result = measure(shape, s.dtype, batch_sizes(s))
    measured = measured_from(result)
    result["stream_gb_s"] = measured.stream_gb_s
    result["floor_gflop_s"] = {str(k): measured.rate(k) for k in sorted(measured.gflop_s)}
    result["floors"] = floors(shape, measured, s)
    result["measure_s"] = time.perf_counter() - start
    return result
