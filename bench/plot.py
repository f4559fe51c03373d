"""The HTTP comparison as a picture: throughput, TTFT and ITL against concurrency,
one line per system, p50 solid and p99 dashed; a PNG beside latest.md."""
from __future__ import annotations

from pathlib import Path

# (key in results["http_serving"], legend label, colour)
SYSTEMS = (("vllm", "vLLM server, HTTP", "tab:red"),
           ("llmserve_http", "llmserve, HTTP", "tab:blue"),
           ("llmserve_grpc", "llmserve, gRPC", "tab:green"))
# (title, y label, keys and line styles, scale)
PANELS = (("Throughput", "output tok/s", (("output_tok_s", "-"),), 1.0),
          ("Time to first token", "seconds", (("ttft_p50_s", "-"), ("ttft_p99_s", "--")), 1.0),
          ("Inter-token latency", "ms (log scale)", (("itl_p50_s", "-"), ("itl_p99_s", "--")),
           1e3))


def _panel(ax, section: dict, title: str, ylabel: str, keys, scale: float) -> None:
    levels = section["levels"]
    for system, label, colour in SYSTEMS:
        for key, style in keys:
            suffix = "" if len(keys) == 1 else f" {key.split('_')[1]}"
            ax.plot(levels, [row[key] * scale for row in section[system]], style, marker="o",
                    color=colour, label=label + suffix)
    ax.set_xscale("log", base=2)
    ax.set_xticks(levels, [str(c) for c in levels])
    ax.minorticks_off()
    ax.set(title=title, xlabel="concurrent requests", ylabel=ylabel)
    ax.grid(True, alpha=0.3)
    ax.legend(fontsize=7)


def draw_http_serving(section: dict, path: Path, subtitle: str) -> Path:
    """Writes the PNG; matplotlib's Figure without pyplot: no global state, no display."""
    from matplotlib.figure import Figure
    from matplotlib.ticker import ScalarFormatter

    fig = Figure(figsize=(15, 4.6), layout="constrained")
    axes = fig.subplots(1, len(PANELS))
    for ax, (title, ylabel, keys, scale) in zip(axes, PANELS):
        _panel(ax, section, title, ylabel, keys, scale)
    axes[-1].set_yscale("log")
    # Plain numbers on the log axis (matplotlib would write 10^2 and 2x10^2).
    axes[-1].yaxis.set_major_formatter(ScalarFormatter())
    axes[-1].yaxis.set_minor_formatter(ScalarFormatter())
    fig.suptitle(f"Served against served, vLLM's benchmark client: {subtitle}")
    fig.savefig(path, dpi=100)
    return path
