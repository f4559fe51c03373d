"""Per-request timings (time to first token, inter-token latency, end to end) and
their summary; the same code measures llmserve and the baseline."""
from __future__ import annotations

import statistics
import time
from dataclasses import dataclass, field

import numpy as np


@dataclass
class RequestTiming:
    start: float = field(default_factory=time.perf_counter)
    # (arrival time, tokens) of every message or step that brought tokens.
    chunks: list[tuple[float, int]] = field(default_factory=list)
    end: float | None = None

    def add(self, num_tokens: int) -> None:
        if num_tokens:
            self.chunks.append((time.perf_counter(), num_tokens))

    def finish(self) -> None:
        self.end = time.perf_counter()

    @property
    def output_tokens(self) -> int:
        return sum(n for _, n in self.chunks)

    @property
    def ttft(self) -> float:
        return self.chunks[0][0] - self.start

    @property
    def e2e(self) -> float:
        return self.end - self.start

    def itls(self) -> list[float]:
        """One sample per token after the first: the gap before its message,
        shared among the message's tokens."""
        return [(t1 - t0) / n for (t0, _), (t1, n) in zip(self.chunks, self.chunks[1:])
                for _ in range(n)]

    def decode_tok_s(self) -> float:
        """Tokens after the first per second after the first."""
        return (self.output_tokens - self.chunks[0][1]) / (self.end - self.chunks[0][0])


def percentile(values: list[float], q: float) -> float:
    return float(np.percentile(values, q)) if values else float("nan")


def summarize(timings: list[RequestTiming], wall_s: float) -> dict:
    """Throughput over the wall time and latency percentiles over the requests."""
    ttfts = [t.ttft for t in timings]
    itls = [x for t in timings for x in t.itls()]
    output_tokens = sum(t.output_tokens for t in timings)
    return {
        "requests": len(timings), "output_tokens": output_tokens, "seconds": wall_s,
        "output_tok_s": output_tokens / wall_s,
        "ttft_p50_s": percentile(ttfts, 50), "ttft_p99_s": percentile(ttfts, 99),
        "itl_p50_s": percentile(itls, 50), "itl_p99_s": percentile(itls, 99),
        "e2e_p50_s": percentile([t.e2e for t in timings], 50),
    }


def median_summary(runs: list[dict]) -> dict:
    """Each figure's median over repeated runs of one measurement."""
    return {key: statistics.median(run[key] for run in runs) for key in runs[0]}


def single_stream_summary(timing: RequestTiming) -> dict:
    """One request: tokens/s end to end and after the first token."""
    return {"output_tokens": timing.output_tokens, "seconds": timing.e2e,
            "output_tok_s": timing.output_tokens / timing.e2e,
            "decode_tok_s": timing.decode_tok_s(), "ttft_s": timing.ttft,
            "itl_p50_s": percentile(timing.itls(), 50)}
