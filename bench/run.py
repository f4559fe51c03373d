"""One benchmark run: the machine floor, the transformers and vLLM-CPU baselines,
offline throughput, single-stream decode and serving, in that order; served
against served over HTTP (vLLM's server and ours, vLLM's client); then the
floor, vLLM-CPU, offline, single stream and serving (at the highest concurrency)
again in each extra dtype, then the opt-in numeric modes; each a timed phase.
Returns the results as a dict."""
from __future__ import annotations

import contextlib
import dataclasses
import datetime
import functools
import gc
import os
import sys
import time

from bench import prompts as P
from bench.machine import bf16_native, load_average, machine_info
from bench.metrics import median_summary
from bench.progress import Phases
from bench.ratios import add_ratios
from bench.settings import Settings
from services.common.config import DEFAULT_MODEL
from services.common.model_store import resolve_model


def _tok_s(row: dict) -> str:
    return f"{row['output_tok_s']:.1f} output tok/s"


def run_baseline(s: Settings, model_dir: str, phases: Phases, results: dict) -> None:
    from bench.baseline import HFBaseline

    vocab = P.vocab_size(model_dir)
    offline = P.make_prompts(s.requests, s.prompt_len, vocab, s.seed, P.OFFLINE)
    single = P.make_prompts(1, s.prompt_len, vocab, s.seed, P.SINGLE_STREAM)[0]
    base = results["baseline"] = {}
    with phases("baseline: load transformers"):
        hf = HFBaseline(model_dir, s.dtype)
        hf.batch1(offline[:1], 2)  # warm-up
    with phases(f"baseline: transformers batched, {s.requests} requests"):
        base["hf_batched"] = hf.batched(offline, s.output_len)
        phases.note = _tok_s(base["hf_batched"])
    n = min(s.baseline_b1_requests, s.requests)
    with phases(f"baseline: transformers batch 1, {n} requests"):
        base["hf_batch1"] = hf.batch1(offline[:n], s.output_len)
        phases.note = _tok_s(base["hf_batch1"])
    with phases(f"baseline: transformers single stream, {s.single_stream_len} tokens"):
        base["hf_single_stream"] = hf.single_stream(single, s.single_stream_len)
        phases.note = _tok_s(base["hf_single_stream"])


def run_floor(s: Settings, model_dir: str, phases: Phases, results: dict) -> None:
    from bench.floor import run_floor as measure_floor

    with phases("floor: GEMM rates, copy bandwidth"):
        floor = results["floor"] = measure_floor(model_dir, s)
        phases.note = (f"{floor['gflop_s'][str(s.requests)]:.0f} GFLOP/s at M={s.requests}, "
                       f"copy {floor['copy_gb_s']:.1f} GB/s")


def run_vllm(s: Settings, model_dir: str, phases: Phases, results: dict) -> None:
    """vLLM-CPU in its own venv and process; on any failure says why and goes on."""
    from bench.vllm_baseline import run_vllm as run_runner
    from bench.vllm_env import VllmUnavailable, ensure_vllm_env

    try:
        with phases("vllm: its venv (built on first use)"):
            env = ensure_vllm_env(s.vllm_venv)
            phases.note = f"vllm {env.vllm}, torch {env.torch}"
        with phases("vllm: load, warm up, offline and single stream (its own process)"):
            results["vllm"] = run_runner(env, s, model_dir)
            phases.note = _tok_s(results["vllm"]["offline"])
    except Exception as e:  # whatever breaks in the baseline must not cost the run
        reason = str(e) if isinstance(e, VllmUnavailable) else repr(e)
        results["vllm"] = {"error": reason}
        print(f"[bench] vLLM-CPU baseline skipped (no ratios to it): {reason}",
              file=sys.stderr, flush=True)
        return
    for name, seconds in results["vllm"]["phases"].items():
        phases.record(f"vllm runner: {name}", seconds)  # its own timing of each part


def run_offline(s: Settings, model_dir: str, phases: Phases, results: dict) -> None:
    from bench import offline
    from bench.floor import prefill_rows
    from bench.floor_beside import FloorBeside

    vocab = P.vocab_size(model_dir)
    with phases("offline: load llmserve"):
        llm = offline.load_llm(model_dir, s.dtype, s.kv_cache_gib, s.max_model_len)
        offline.warm_up(llm, P.make_prompts(4, s.prompt_len, vocab, s.seed, P.WARMUP))
    # The floor read again beside these runs (bench/floor_beside.py).
    floors = FloorBeside.of(model_dir, results.get("floor"), max(
        s.requests, s.large_requests, prefill_rows(s.requests, s.prompt_len)))
    _offline_batches(s, vocab, llm, floors, phases, results)
    _single_stream(s, vocab, llm, floors, phases, results)


def _offline_batches(s: Settings, vocab: int, llm, floors, phases: Phases,
                     results: dict) -> None:
    """One LLM.generate of s.requests requests, and one of s.large_requests."""
    from bench import offline
    from bench.floor_beside import add_share_of_floor, runs_beside

    def batch(name: str, requests: int, kind: int):
        def run() -> dict:
            with phases(f"offline: LLM.generate, {requests} requests"):
                prompts = P.make_prompts(requests, s.prompt_len, vocab, s.seed, kind)
                row = results[name] = offline.run_offline(llm, prompts, s.output_len)
                phases.note = _tok_s(row)
            return row
        return run

    batches = [batch("offline", s.requests, P.OFFLINE)]
    if s.large_requests:
        batches.append(batch("offline_large", s.large_requests, P.OFFLINE_LARGE))
    rows, readings = runs_beside(floors, batches)
    for i, row in enumerate(rows):
        add_share_of_floor(row, floors, readings and readings[i:i + 2], s.prompt_len,
                           s.output_len)


def _single_stream(s: Settings, vocab: int, llm, floors, phases: Phases,
                   results: dict) -> None:
    """One request alone, s.single_stream_runs times; each figure the median."""
    from bench import offline
    from bench.floor_beside import add_itl_to_floor, runs_beside

    with phases(f"single stream: {s.single_stream_len} tokens, median of "
                f"{s.single_stream_runs} runs"):
        # One prompt per run, the runs' prompts as vLLM's (a repeated prompt would
        # hit the prefix cache).
        prompts = P.make_prompts(s.single_stream_runs, s.prompt_len, vocab, s.seed,
                                 P.SINGLE_STREAM)
        runs, readings = runs_beside(floors, [
            functools.partial(offline.run_single_stream, llm, prompt, s.single_stream_len)
            for prompt in prompts], ms=[1])
        results["single_stream"] = median_summary(runs)
        add_itl_to_floor(results["single_stream"], floors, readings)
        phases.note = _tok_s(results["single_stream"])


def run_serving(s: Settings, model_dir: str, phases: Phases, results: dict) -> None:
    from bench import serving
    from bench.floor_beside import FloorBeside, add_itl_to_floor, runs_beside
    from bench.stack import frontend_address, serving_stack

    vocab = P.vocab_size(model_dir)
    rows = results["serving"] = []
    with contextlib.ExitStack() as running:
        with phases("serving: start the stack"):
            stack = running.enter_context(
                serving_stack(model_dir, s.dtype, s.kv_cache_gib, s.max_model_len))
            address = frontend_address(stack)
            serving.warm_up(address, P.make_prompts(4, s.prompt_len, vocab, s.seed, P.WARMUP))
        for i, c in enumerate(s.concurrency):
            prompts = P.make_prompts(s.level_requests(c), s.prompt_len, vocab, s.seed,
                                     P.SERVING + i)
            run = functools.partial(serving.run_closed_loop, address, prompts, s.output_len, c)
            with phases(f"serving: concurrency {c}, {len(prompts)} requests"):
                # One stream's ITL is held against the floor read beside it too.
                floors = FloorBeside.of(model_dir, results.get("floor"), 1) if c == 1 else None
                [row], readings = runs_beside(floors, [run])
                add_itl_to_floor(row, floors, readings)
                rows.append(row)
                phases.note = _tok_s(row)
        if s.request_rate:
            prompts = P.make_prompts(s.rate_requests, s.prompt_len, vocab, s.seed,
                                     P.SERVING + len(s.concurrency))
            with phases(f"serving: Poisson {s.request_rate:g} req/s, {len(prompts)} requests"):
                rows.append(serving.run_poisson(address, prompts, s.output_len,
                                                s.request_rate, s.seed))
                phases.note = _tok_s(rows[-1])


def run_extra_dtype(s: Settings, model_dir: str, phases: Phases, results: dict,
                    dtype: str) -> None:
    """The floor, vLLM-CPU, llmserve offline and single stream again, all in `dtype`,
    and the served stack at the highest concurrency only, into
    results["dtypes"][dtype] (no transformers run)."""
    sub = results.setdefault("dtypes", {})[dtype] = {"dtype": dtype}
    in_dtype = dataclasses.replace(s, dtype=dtype, concurrency=[max(s.concurrency)],
                                   request_rate=None)
    steps = [(s.skip_floor, run_floor), (s.skip_vllm, run_vllm), (s.skip_offline, run_offline),
             (s.skip_serving, run_serving)]
    with phases.prefixed(f"{dtype}: "):
        for skip, step in steps:
            if not skip:
                step(in_dtype, model_dir, phases, sub)
                gc.collect()


def _later_sections(s: Settings, model_dir: str, phases: Phases, results: dict,
                    alone: bool) -> None:
    """What follows the main steps: the HTTP comparison, the cost of observability,
    pipeline parallelism, embedding throughput, beam search, speculative decoding, the cost
    of structured outputs,
    the extra dtypes and the numeric modes."""
    if not (s.skip_serving or s.skip_http or s.skip_vllm or alone):
        from bench.http_serving import run_http_serving

        run_http_serving(s, model_dir, phases, results)
    if not (s.skip_serving or s.skip_observability or alone):
        from bench.observability import run_observability

        run_observability(s, model_dir, phases, results)
    if not (s.skip_offline or s.skip_pipeline or alone):
        from bench.pipeline import run_pipeline

        run_pipeline(s, model_dir, phases, results)
        gc.collect()
    if not (s.skip_embeddings or alone):
        from bench.embeddings import run_embeddings

        run_embeddings(s, model_dir, phases, results)
        gc.collect()
    if not (s.skip_beam_search or alone):
        from bench.beam_search import run_beam_search

        run_beam_search(s, model_dir, phases, results)
        gc.collect()
    if not (s.skip_spec_decode or alone):
        from bench.spec_decode import run_spec_decode

        run_spec_decode(s, model_dir, phases, results)
        gc.collect()
    if not (s.skip_offline or s.skip_structured_outputs or alone):
        from bench.structured_outputs import run_structured_outputs

        run_structured_outputs(s, model_dir, phases, results)
        gc.collect()
    for dtype in [] if alone else s.extra_dtypes:
        run_extra_dtype(s, model_dir, phases, results, dtype)
    if not (s.skip_modes or alone):
        from bench.modes import run_modes

        run_modes(s, model_dir, phases, results)
        gc.collect()


def run(s: Settings, command: str) -> dict:
    """Every phase the settings ask for, then the ratios to the baseline."""
    start = time.perf_counter()
    phases = Phases()
    model_dir = resolve_model(s.model or DEFAULT_MODEL)
    results: dict = {"meta": {
        "command": command, "model_name": os.path.basename(model_dir.rstrip("/")),
        "model_dir": model_dir, "load_before": load_average(),
        "omp_wait_policy": os.environ.get("OMP_WAIT_POLICY", "unset"),
        "bf16_native": bf16_native(),
        "started_at": datetime.datetime.now().astimezone().isoformat(timespec="seconds"),
        **machine_info()}, "settings": dataclasses.asdict(s)}
    steps = [(s.skip_floor, run_floor), (s.skip_baseline, run_baseline),
             (s.skip_vllm, run_vllm), (s.skip_offline, run_offline),
             (s.skip_serving, run_serving)]
    if s.soak_minutes:
        from bench.soak import run_soak

        steps = [(False, run_soak)]
    if s.http_only:
        from bench.http_serving import run_http_serving

        steps = [(False, run_http_serving)]
    alone = bool(s.soak_minutes or s.http_only)  # one section and nothing else
    for skip, step in steps:
        if not skip:
            step(s, model_dir, phases, results)
            gc.collect()  # drop one phase's model before the next loads its own
    _later_sections(s, model_dir, phases, results, alone)
    results["meta"]["load_after"] = load_average()
    results["meta"]["wall_s"] = time.perf_counter() - start
    results["phases"] = phases.seconds
    add_ratios(results)
    return results
