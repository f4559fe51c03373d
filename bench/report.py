"""Ratios to the baseline, the Markdown table, and the files under bench/results/.

Every ratio is llmserve ÷ baseline: above 1 is better for tokens/s, below 1 is
better for latencies."""
from __future__ import annotations

import json
import math
import os
from pathlib import Path

THROUGHPUT_KEYS = ("output_tok_s", "total_tok_s", "decode_tok_s")
SERVING_LATENCY_KEYS = ("ttft_p50_s", "ttft_p99_s", "itl_p50_s", "itl_p99_s", "e2e_p50_s")


def _ratio(value: float | None, base: float | None) -> float | None:
    if value is None or not base or math.isnan(base) or math.isnan(value):
        return None
    return value / base


def _ratios(row: dict, base: dict | None, keys: tuple[str, ...]) -> dict:
    return {k: _ratio(row.get(k), (base or {}).get(k)) for k in keys if k in row}


def serving_baseline_name(row: dict) -> str:
    """Throughput at one client is compared with batch 1, otherwise with the batched run."""
    return "hf_batch1" if row.get("concurrency") == 1 else "hf_batched"


def add_ratios(results: dict) -> None:
    """Adds a `ratio` dict (and the baseline's name) to every llmserve figure."""
    base = results.get("baseline", {})
    if "offline" in results:
        results["offline"]["baseline"] = "hf_batched"
        results["offline"]["ratio"] = _ratios(results["offline"], base.get("hf_batched"),
                                              THROUGHPUT_KEYS)
    if "single_stream" in results:
        single = results["single_stream"]
        single["baseline"] = "hf_single_stream"
        single["ratio"] = _ratios(single, base.get("hf_single_stream"),
                                  THROUGHPUT_KEYS + ("ttft_s", "itl_p50_s"))
    for row in results.get("serving", []):
        row["baseline"] = serving_baseline_name(row)
        row["ratio"] = {**_ratios(row, base.get(row["baseline"]), ("output_tok_s",)),
                        **_ratios(row, base.get("hf_batch1"), SERVING_LATENCY_KEYS)}


def _fmt(value: float | None, scale: float = 1.0, digits: int = 1) -> str:
    return "-" if value is None or math.isnan(value) else f"{value * scale:,.{digits}f}"


def _cell(row: dict, key: str, scale: float = 1.0, digits: int = 1) -> str:
    """A value with its ratio to the baseline, e.g. `512.3 (2.05×)`."""
    text = _fmt(row.get(key), scale, digits)
    ratio = row.get("ratio", {}).get(key)
    return text if ratio is None else f"{text} ({ratio:.2f}×)"


def _header(results: dict) -> list[str]:
    m, s = results["meta"], results["settings"]
    return [
        "# llmserve benchmark", "",
        f"`{m['command']}`", "",
        f"{m['started_at']} · model `{m['model_name']}` · {s['dtype']} · {m['cpu']}, "
        f"{m['cores']} cores · torch {m['torch']} ({m['torch_threads']} threads) · "
        f"transformers {m['transformers']} · OMP_WAIT_POLICY {m['omp_wait_policy']} · "
        f"load average {m['load_before']:.2f} → {m['load_after']:.2f}", "",
        "Ratios in parentheses are llmserve ÷ baseline, measured in the same run on the "
        "same prompts and dtype: above 1 is better for tok/s, below 1 for latencies. "
        "Prompts are random ordinary token ids; decoding is greedy with ignore_eos.", ""]


def _offline(results: dict) -> list[str]:
    s, row = results["settings"], results["offline"]
    base = results.get("baseline", {}).get("hf_batched", {})
    return [
        f"## Offline throughput: `LLM.generate`, {s['requests']} requests × "
        f"{s['prompt_len']} prompt + {s['output_len']} output tokens", "",
        "| figure | llmserve | transformers batched (left padding) |", "|---|---:|---:|",
        f"| output tok/s | {_cell(row, 'output_tok_s')} | {_fmt(base.get('output_tok_s'))} |",
        f"| total tok/s | {_cell(row, 'total_tok_s')} | {_fmt(base.get('total_tok_s'))} |",
        f"| wall time s | {_fmt(row['seconds'])} | {_fmt(base.get('seconds'))} |", ""]


def _single(results: dict) -> list[str]:
    s, row = results["settings"], results["single_stream"]
    base = results.get("baseline", {}).get("hf_single_stream", {})
    return [
        f"## Single-stream decode: 1 request, {s['prompt_len']} prompt + "
        f"{s['single_stream_len']} output tokens, in process", "",
        "| figure | llmserve | transformers batch 1 |", "|---|---:|---:|",
        f"| output tok/s (end to end) | {_cell(row, 'output_tok_s')} "
        f"| {_fmt(base.get('output_tok_s'))} |",
        f"| decode tok/s (after the first token) | {_cell(row, 'decode_tok_s')} "
        f"| {_fmt(base.get('decode_tok_s'))} |",
        f"| time to first token ms | {_cell(row, 'ttft_s', 1e3)} "
        f"| {_fmt(base.get('ttft_s'), 1e3)} |",
        f"| inter-token latency p50 ms | {_cell(row, 'itl_p50_s', 1e3)} "
        f"| {_fmt(base.get('itl_p50_s'), 1e3)} |", ""]


def _serving_row(name: str, row: dict) -> str:
    return (f"| {name} | {row['requests']} | {_cell(row, 'output_tok_s')} "
            f"| {_cell(row, 'ttft_p50_s', 1e3, 0)} | {_cell(row, 'ttft_p99_s', 1e3, 0)} "
            f"| {_cell(row, 'itl_p50_s', 1e3)} | {_cell(row, 'itl_p99_s', 1e3)} "
            f"| {_cell(row, 'e2e_p50_s', 1, 2)} |")


def _serving(results: dict) -> list[str]:
    s, base = results["settings"], results.get("baseline", {})
    lines = [
        f"## Serving: three-process gRPC stack, streaming clients, {s['prompt_len']} prompt + "
        f"{s['output_len']} output tokens", "",
        "Closed loop: each client sends its next request when the last one ends. Throughput "
        "is compared with transformers batch 1 at concurrency 1 and with transformers batched "
        "above; latencies with transformers batch 1 (requests one after another).", "",
        "| load | requests | output tok/s | TTFT p50 ms | TTFT p99 ms | ITL p50 ms "
        "| ITL p99 ms | e2e p50 s |", "|---|---:|---:|---:|---:|---:|---:|---:|"]
    lines += [_serving_row(row["load"], row) for row in results["serving"]]
    if "hf_batch1" in base:
        lines.append(_serving_row("baseline: transformers batch 1", base["hf_batch1"]))
    if "hf_batched" in base:
        b = base["hf_batched"]
        lines.append(f"| baseline: transformers batched ({b['batch_size']}) | {b['requests']} "
                     f"| {_fmt(b['output_tok_s'])} | - | - | - | - | - |")
    return lines + [""]


def _phases(results: dict) -> list[str]:
    lines = ["## Phase times", "", "| phase | seconds |", "|---|---:|"]
    lines += [f"| {name} | {seconds:.1f} |" for name, seconds in results["phases"].items()]
    return lines + [f"| **whole run** | {results['meta']['wall_s']:.1f} |", ""]


def to_markdown(results: dict) -> str:
    lines = _header(results)
    if "offline" in results:
        lines += _offline(results)
    if "single_stream" in results:
        lines += _single(results)
    if results.get("serving"):
        lines += _serving(results)
    return "\n".join(lines + _phases(results))


def _write_atomic(path: Path, text: str) -> None:
    tmp = path.with_name(path.name + ".tmp")
    tmp.write_text(text)
    os.replace(tmp, path)


def write_results(results: dict, markdown: str, out_dir: str) -> tuple[Path, Path]:
    """latest.json and latest.md in out_dir."""
    out = Path(out_dir)
    out.mkdir(parents=True, exist_ok=True)
    json_path, md_path = out / "latest.json", out / "latest.md"
    _write_atomic(json_path, json.dumps(results, indent=2) + "\n")
    _write_atomic(md_path, markdown)
    return json_path, md_path
