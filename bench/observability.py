"""What tracing and metrics cost: served throughput with them on (spans and
metrics exported over OTLP to a receiver in this process, every /metrics scraped
each second) against off, on two stacks started side by side and measured in
alternation, so that both see the same machine."""
from __future__ import annotations

import contextlib
import statistics
import threading
import urllib.request
from typing import Iterator

from bench import prompts as P
from bench.progress import Phases
from bench.report import table
from bench.settings import Settings

# Alternating off/on rounds: the machine drifts by 10-20% between runs, and three
# rounds gave costs from 2.5% to 6.2% on one machine in an afternoon (bench/NOTES.md).
ROUNDS = 5


def run_observability(s: Settings, model_dir: str, phases: Phases, results: dict) -> None:
    from bench import serving
    from bench.otlp_receiver import OtlpReceiver
    from bench.stack import frontend_address, serving_stack

    concurrency = max(s.concurrency)
    prompts = P.make_prompts(s.level_requests(concurrency), s.prompt_len, P.vocab_size(model_dir),
                             s.seed, P.SERVING + 100)
    receiver = OtlpReceiver()
    rows: dict[str, list[dict]] = {"off": [], "on": []}
    with contextlib.ExitStack() as running:
        running.callback(receiver.stop)
        with phases("observability: start a stack without, and one with, tracing and metrics"):
            stacks = {"off": running.enter_context(serving_stack(
                model_dir, s.dtype, s.kv_cache_gib, s.max_model_len)),
                      "on": running.enter_context(serving_stack(
                model_dir, s.dtype, s.kv_cache_gib, s.max_model_len,
                env=_otlp_env(receiver.endpoint), metrics_port=0))}
            # A whole unmeasured round each: the first burst through a stack meets
            # step shapes (oneDNN primitives) for the first time, and a 4-request
            # warm-up left round 1 of the stack measured first up to 14% slower.
            for stack in stacks.values():
                serving.run_closed_loop(frontend_address(stack), prompts, s.output_len,
                                        concurrency)
        for round_ in range(ROUNDS):
            for name, stack in stacks.items():
                with phases(f"observability {name}: concurrency {concurrency}, round {round_ + 1}"):
                    with _scraping(list(stack.metrics_addresses.values())):
                        rows[name].append(serving.run_closed_loop(
                            frontend_address(stack), prompts, s.output_len, concurrency))
                    phases.note = f"{rows[name][-1]['output_tok_s']:.1f} output tok/s"
    off, on = (statistics.median(r["output_tok_s"] for r in rows[k]) for k in ("off", "on"))
    results["observability"] = {
        "concurrency": concurrency, "requests": len(prompts), "rounds": ROUNDS,
        "off_output_tok_s": off, "on_output_tok_s": on, "cost_pct": 100 * (1 - on / off),
        "round_costs_pct": [100 * (1 - b["output_tok_s"] / a["output_tok_s"])
                            for a, b in zip(rows["off"], rows["on"])],
        "spans_received": len(receiver.spans)}


def _otlp_env(endpoint: str) -> dict[str, str]:
    return {"OTEL_EXPORTER_OTLP_ENDPOINT": endpoint, "OTEL_EXPORTER_OTLP_INSECURE": "true",
            "OTEL_TRACES_EXPORTER": "otlp", "OTEL_METRICS_EXPORTER": "otlp",
            "OTEL_METRIC_EXPORT_INTERVAL": "5000"}


@contextlib.contextmanager
def _scraping(addresses: list[str], interval_s: float = 1.0) -> Iterator[None]:
    """Scrapes every address's /metrics each interval, as a demanding Prometheus would."""
    stop = threading.Event()

    def scrape() -> None:
        while not stop.wait(interval_s):
            for address in addresses:
                urllib.request.urlopen(f"http://{address}/metrics", timeout=5).read()

    thread = threading.Thread(target=scrape, name="bench-scraper", daemon=True)
    thread.start()
    try:
        yield
    finally:
        stop.set()
        thread.join()


def observability_section(results: dict) -> list[str]:
    row = results.get("observability")
    if not row:
        return []
    return [f"## Cost of tracing and metrics (served, concurrency {row['concurrency']})", "",
            f"Median of {row['rounds']} alternating rounds of {row['requests']} requests each. "
            "On: spans and metrics exported over OTLP to a receiver in the benchmark "
            f"({row['spans_received']} spans received), every /metrics scraped each second."
            + _round_costs(row), "",
            *table(["tracing and metrics", "output tok/s"], [
                ["off", f"{row['off_output_tok_s']:.1f}"],
                ["on", f"{row['on_output_tok_s']:.1f}"],
                ["cost", f"{row['cost_pct']:.1f}% (goal: under 3%)"]]), ""]


def _round_costs(row: dict) -> str:
    """Each round's cost, on against the off run just before it: the swing to read
    the median against (absent from results saved before it was recorded)."""
    costs = row.get("round_costs_pct")
    return f" Each round's cost: {', '.join(f'{c:.1f}%' for c in costs)}." if costs else ""
