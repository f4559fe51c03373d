"""Pipeline parallelism on this machine: the offline batch (`requests` × (prompt +
output) tokens) and one stream's decode, with the model in one worker on every
core (PP=1), in two stages of one core each (PP=2), and in two stages with the
batch queue off (one batch in the pipeline at a time). For the stages, each
one's idle share of the batch's wall time (the pipeline bubble): the wall time
less what its worker computed (its forward time, less the time it waited for the
previous stage's tensors), both read from the worker's metrics."""
from __future__ import annotations

import time
import types
import urllib.request

from prometheus_client.parser import text_string_to_metric_families

from bench import prompts as P
from bench.progress import Phases
from bench.report import fmt, table
from bench.settings import Settings

# (label, stages, batch queue on)
VARIANTS = (("PP=1: one worker, every core", 1, True),
            ("PP=2: a core per stage", 2, True),
            ("PP=2, batch queue off", 2, False))


def run_pipeline(s: Settings, model_dir: str, phases: Phases, results: dict) -> None:
    vocab = P.vocab_size(model_dir)
    batch = P.make_prompts(s.requests, s.prompt_len, vocab, s.seed, P.OFFLINE)
    single = P.make_prompts(1, s.prompt_len, vocab, s.seed, P.SINGLE_STREAM)[0]
    results["pipeline"] = {"requests": s.requests, "dtype": s.dtype, "rows": [
        _variant(s, model_dir, phases, variant, batch, single) for variant in VARIANTS]}


def _variant(s: Settings, model_dir: str, phases: Phases, variant: tuple, batch: list,
             single: list[int]) -> dict:
    from bench import offline

    label, stages, queue = variant
    with phases(f"pipeline: {label}: load"):
        engine, stack = _engine(s, model_dir, stages)
        if not queue:  # one batch in flight, as a pipeline without the queue runs
            engine.engine_core.queue_depth = lambda: 1
        run_batch(engine, batch[:4], 4)  # warm-up
    try:
        with phases(f"pipeline: {label}: offline, {len(batch)} requests"):
            before = stage_seconds(stack)
            start = time.perf_counter()
            run_batch(engine, batch, s.output_len)
            wall = time.perf_counter() - start
            busy = [b - a for a, b in zip(before, stage_seconds(stack))]
            phases.note = f"{len(batch) * s.output_len / wall:.1f} output tok/s"
        with phases(f"pipeline: {label}: single stream, {s.single_stream_len} tokens"):
            stream = offline.run_single_stream(types.SimpleNamespace(llm_engine=engine),
                                               single, s.single_stream_len)
    finally:
        if stack is not None:
            engine.engine_core.shutdown()  # the step streams end before the workers
            stack.stop(grace_s=10.0)
    return {"label": label, "stages": stages, "batch_queue": queue, "seconds": wall,
            "output_tok_s": len(batch) * s.output_len / wall,
            "stage_idle": [max(0.0, 1 - b / wall) for b in busy],
            "itl_p50_s": stream["itl_p50_s"], "ttft_s": stream["ttft_s"]}


def _engine(s: Settings, model_dir: str, stages: int):
    """An LLMEngine with its worker in this process (one stage), or over a worker
    process per stage whose metrics are served (the LocalStack, to stop after)."""
    from llmserve.engine_args import EngineArgs
    from llmserve.launcher import LocalStack
    from llmserve.llm_engine import LLMEngine, engine_core_over_workers

    config = EngineArgs(model=model_dir, dtype=s.dtype, kv_cache_gib=s.kv_cache_gib,
                        max_model_len=s.max_model_len, enable_prefix_caching=False,
                        pipeline_parallel_size=stages).create_engine_config()
    if stages == 1:
        return LLMEngine(config), None
    stack = LocalStack(config, metrics_port=0)
    return LLMEngine(config, engine_core_over_workers(stack)), stack


def run_batch(engine, prompts: list[list[int]], output_len: int) -> None:
    """Every prompt added, then steps until all are done (as LLM.generate)."""
    for i, prompt in enumerate(prompts):
        engine.add_request(f"batch-{time.monotonic_ns()}-{i}", {"prompt_token_ids": prompt},
                           P.greedy(output_len))
    while engine.has_unfinished_requests():
        for output in engine.step():
            assert not output.finished or len(output.outputs[0].token_ids) == output_len


def stage_seconds(stack) -> list[float]:
    """What each stage's worker has computed so far, in seconds: its forward time
    less its waits for the stage before ([] without worker processes)."""
    if stack is None:
        return []
    out = []
    for name in sorted(n for n in stack.metrics_addresses if n.startswith("worker")):
        text = urllib.request.urlopen(f"http://{stack.metrics_addresses[name]}/metrics",
                                      timeout=10).read().decode()
        samples = {s.name: s.value for f in text_string_to_metric_families(text)
                   for s in f.samples}
        out.append(samples["llmserve:worker_forward_time_seconds_sum"]
                   - samples["llmserve:worker_pipeline_wait_seconds_total"])
    return out


def pipeline_section(results: dict) -> list[str]:
    section = results.get("pipeline")
    if not section:
        return []
    s = results["settings"]
    rows = [[r["label"], f"{r['output_tok_s']:.1f}", fmt(r["itl_p50_s"], 1e3),
             fmt(r["ttft_s"], 1e3),
             ", ".join(f"{x:.0%}" for x in r["stage_idle"]) or "-"] for r in section["rows"]]
    return [f"## Pipeline parallelism: offline, {section['requests']} requests × "
            f"{s['prompt_len']} prompt + {s['output_len']} output tokens; one stream of "
            f"{s['single_stream_len']}, {section['dtype']}", "",
            "The offline API with the model in one worker on every core, then in two "
            "stages, a worker process of one core each (`LLM(pipeline_parallel_size=2)`), "
            "with the batch queue on and off. A stage's idle share is the batch's wall "
            "time less what its worker computed (forward time less waits for the stage "
            "before, from its metrics): the pipeline bubble the queue removes.", "",
            *table(["variant", "output tok/s", "one stream ITL p50 ms", "TTFT ms",
                    "idle share per stage"], rows)]

