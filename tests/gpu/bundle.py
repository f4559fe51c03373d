"""Makes the bundle a bare NVIDIA machine needs for make test-gpu, with no network there:
the wheels its image lacks, the default model's GGUF file, split into parts that each fit one
transfer to the machine together with the project's source.

python -m tests.gpu.bundle [--out .gpu-bundle] [--limit-mib 64]

Each part is a folder (part-1, part-2, ...) to carry in one call; tests/gpu/receive.py on the
machine collects the parts, checks the whole against its sha256 and unpacks it.
"""
from __future__ import annotations

import argparse
import hashlib
import importlib.metadata
import json
import shutil
import subprocess
import sys
import tarfile
from pathlib import Path

REPO = Path(__file__).resolve().parents[2]
MIB = 1 << 20
# What the GPU machines' image ('cuda', with python3 3.12, torch, Triton, transformers,
# grpcio, peft) lacks or holds in a version older than our generated code needs; pinned to
# the versions installed here. The image's transformers and tokenizers serve as they are.
WHEELS = [
    "grpcio", "grpcio-tools", "grpcio-health-checking", "grpcio-reflection", "protobuf",
    "opentelemetry-api", "opentelemetry-sdk", "opentelemetry-exporter-otlp-proto-grpc",
    "opentelemetry-exporter-otlp-proto-common", "opentelemetry-proto",
    "opentelemetry-exporter-otlp-common", "opentelemetry-semantic-conventions",
    "googleapis-common-protos", "fastapi", "starlette", "annotated-doc", "pydantic",
    "pydantic-core", "annotated-types", "typing-inspection", "uvicorn", "dnspython", "gguf",
    "xgrammar", "apache-tvm-ffi",
]
PLATFORM = ["--python-version", "3.12", "--implementation", "cp", "--only-binary=:all:",
            *[arg for tag in ("manylinux_2_28_x86_64", "manylinux_2_27_x86_64",
                              "manylinux_2_24_x86_64", "manylinux_2_17_x86_64",
                              "manylinux2014_x86_64") for arg in ("--platform", tag)]]


def pinned(names: list[str]) -> list[str]:
    return [f"{name}=={importlib.metadata.version(name)}" for name in names]


def download_wheels(target: Path) -> list[Path]:
    target.mkdir(parents=True, exist_ok=True)
    subprocess.run([sys.executable, "-m", "pip", "download", "-q", "--no-deps",
                    "--disable-pip-version-check", *PLATFORM, "-d", str(target),
                    *pinned(WHEELS)], check=True)
    return sorted(target.glob("*.whl"))


def tree_bytes() -> int:
    """What travels besides the bundle: tracked and untracked, not ignored, files."""
    names = subprocess.run(["git", "ls-files", "-z", "--cached", "--others", "--exclude-standard"],
                           cwd=REPO, capture_output=True, check=True).stdout.split(b"\0")
    return sum((REPO / n.decode()).stat().st_size for n in names
               if n and (REPO / n.decode()).is_file())


def make_bundle(wheels: list[Path], gguf: Path, out: Path, part_bytes: int) -> list[Path]:
    """bundle.tar (wheels/, model/) split into parts of at most part_bytes, each in a folder
    with the manifest; returns the part folders."""
    if out.exists():
        shutil.rmtree(out)
    out.mkdir(parents=True)
    whole = out / "bundle.tar"
    with tarfile.open(whole, "w") as tar:  # not compressed: wheels and Q4 weights are already
        for wheel in wheels:
            tar.add(wheel, f"wheels/{wheel.name}")
        tar.add(gguf, f"model/{gguf.name}")
    data = whole.read_bytes()
    whole.unlink()
    chunks = [data[i:i + part_bytes] for i in range(0, len(data), part_bytes)]
    manifest = {"parts": len(chunks), "bytes": len(data),
                "sha256": hashlib.sha256(data).hexdigest()}
    parts = []
    for i, chunk in enumerate(chunks, 1):
        part = out / f"part-{i}"
        part.mkdir()
        (part / f"bundle.tar.{i}").write_bytes(chunk)
        (part / "manifest.json").write_text(json.dumps(manifest))
        parts.append(part)
    return parts


def part_limit(limit_bytes: int, tree: int, margin: int = 2 * MIB) -> int:
    room = limit_bytes - tree - margin
    if room < 8 * MIB:
        raise SystemExit(f"the source tree ({tree / MIB:.1f} MiB) leaves too little of the "
                         f"{limit_bytes / MIB:.0f} MiB transfer for the bundle")
    return room


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__,
                                     formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--out", type=Path, default=REPO / ".gpu-bundle")
    parser.add_argument("--limit-mib", type=int, default=64,
                        help="one transfer's limit: the source tree plus one part")
    parser.add_argument("--wheel-cache", type=Path, default=REPO / ".gpu-wheels")
    args = parser.parse_args()
    from services.common.model_store import ensure_default_gguf
    wheels = download_wheels(args.wheel_cache)
    tree = tree_bytes()
    parts = make_bundle(wheels, ensure_default_gguf(), args.out,
                        part_limit(args.limit_mib * MIB, tree))
    for part in parts:
        size = sum(f.stat().st_size for f in part.iterdir())
        print(f"{part.relative_to(REPO)}: {size / MIB:.1f} MiB (+ {tree / MIB:.1f} MiB of "
              f"source = {(size + tree) / MIB:.1f} of {args.limit_mib} MiB)")
    print("on the machine, one call per part: python3 -m tests.gpu.receive <part>; "
          "then: make test-gpu")


if __name__ == "__main__":
    main()
