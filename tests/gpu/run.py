"""make test-gpu: the GPU suite on a bare NVIDIA machine, from a bundle made by
tests/gpu/bundle.py, with no network.

Steps, each one command (--dry-run prints them and runs none):
1. the bundle's wheels into <bundle>/site (what the machine's image lacks), first on
   PYTHONPATH; the machine's own python3, torch, Triton and CUDA serve the rest;
2. the protos compiled (make protos, with that python3);
3. the default model converted from the bundle's GGUF into <bundle>/cache;
4. pytest tests/gpu, one line per check;
5. the throughput figure (tests/gpu/throughput.py).
Then one summary line per check, and the report file (--report).
"""
from __future__ import annotations

import argparse
import os
import shlex
import subprocess
import sys
import time
from pathlib import Path

REPO = Path(__file__).resolve().parents[2]
GGUF_NAME = "SmolLM2-135M-Instruct.Q4_1.gguf"


def steps(bundle: Path, record: Path) -> list[tuple[str, list[str]]]:
    """(name, argv) of every command the suite runs, in order."""
    py = sys.executable
    return [
        ("install wheels", [py, "-m", "pip", "install", "-q", "--no-index", "--no-deps",
                            "--no-compile", "--upgrade", "--target", str(bundle / "site"),
                            *sorted(str(w) for w in (bundle / "wheels").glob("*.whl"))]),
        ("compile protos", ["make", "-o", ".venv/.installed", "protos", f"PY={py}"]),
        ("convert model", [py, "-m", "services.common.model_store"]),
        ("pytest tests/gpu", [py, "-m", "pytest", "tests/gpu", "-p", "no:cacheprovider",
                              "-rA", "-q", "-o", "addopts="]),
        ("throughput", [py, "-m", "tests.gpu.throughput", "--record", str(record)]),
    ]


def environment(bundle: Path, record: Path) -> dict[str, str]:
    env = dict(os.environ)
    env["PYTHONPATH"] = os.pathsep.join([str(bundle / "site"), str(REPO)])
    env["LLMSERVE_CACHE"] = str(bundle / "cache")
    env["LLMSERVE_GPU_RECORD"] = str(record)
    env["PYTHONUNBUFFERED"] = "1"
    env.pop("TRITON_INTERPRET", None)
    return env


def place_model(bundle: Path, dry_run: bool) -> None:
    """The bundle's GGUF where model_store looks for the downloaded file."""
    target = bundle / "cache" / "gguf" / GGUF_NAME
    print(f"$ ln -sf {bundle / 'model' / GGUF_NAME} {target}", flush=True)
    if not dry_run and not target.exists():
        target.parent.mkdir(parents=True, exist_ok=True)
        target.symlink_to(bundle / "model" / GGUF_NAME)


def run_steps(bundle: Path, record: Path, dry_run: bool, log) -> list[tuple[str, int, float]]:
    results = []
    env = environment(bundle, record)
    place_model(bundle, dry_run)
    for name, argv in steps(bundle, record):
        print(f"$ {shlex.join(argv)}", flush=True)
        if dry_run:
            continue
        start = time.monotonic()
        proc = subprocess.run(argv, cwd=REPO, env=env, stdout=subprocess.PIPE,
                              stderr=subprocess.STDOUT, text=True)
        log.write(f"\n### {name}: exit {proc.returncode}\n{proc.stdout}")
        print(proc.stdout[-6000:] if proc.returncode else _pytest_lines(name, proc.stdout),
              flush=True)
        results.append((name, proc.returncode, time.monotonic() - start))
        if proc.returncode and name != "pytest tests/gpu":
            break  # the steps after need this one
    return results


def _pytest_lines(name: str, output: str) -> str:
    """For pytest, its per-test lines (PASSED/FAILED/SKIPPED) and summary; else nothing."""
    if name != "pytest tests/gpu":
        return ""
    keep = ("PASSED", "FAILED", "SKIPPED", "ERROR", "passed", "failed")
    return "\n".join(line for line in output.splitlines() if line.startswith(keep)
                     or " passed" in line or " failed" in line)


def report(results, record: Path, report_path: Path) -> str:
    when = time.strftime("%Y-%m-%d %H:%M UTC", time.gmtime())
    lines = [f"# make test-gpu on {_gpu_name()}, {when}", ""]
    lines += [f"- {'ok  ' if rc == 0 else 'FAIL'} {name} ({seconds:.0f} s)"
              for name, rc, seconds in results]
    if record.exists():
        lines += ["", "## Figures"]
        lines += [f"- {line.strip()}" for line in record.read_text().splitlines()]
    text = "\n".join(lines) + "\n"
    report_path.write_text(text)
    return text


def _gpu_name() -> str:
    try:
        out = subprocess.run(["nvidia-smi", "--query-gpu=name,driver_version",
                              "--format=csv,noheader"], capture_output=True, text=True)
        return out.stdout.strip() or "an unknown GPU"
    except FileNotFoundError:
        return "a machine without nvidia-smi"


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__,
                                     formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--bundle", type=Path, required=True,
                        help="the unpacked bundle (tests/gpu/receive.py)")
    parser.add_argument("--report", type=Path, default=Path("gpu-report.md"))
    parser.add_argument("--dry-run", action="store_true", help="print the commands only")
    args = parser.parse_args()
    bundle, report_path = args.bundle.resolve(), args.report.resolve()
    record = report_path.with_suffix(".jsonl")
    if not args.dry_run:
        record.unlink(missing_ok=True)
    with open(report_path.with_suffix(".log"), "w") as log:
        results = run_steps(bundle, record, args.dry_run, log)
    if args.dry_run:
        return 0
    print(report(results, record, report_path), flush=True)
    return 0 if results and all(rc == 0 for _, rc, _ in results) and len(results) == len(
        steps(bundle, record)) else 1


if __name__ == "__main__":
    sys.exit(main())
