"""The GPU suite's own pieces, on the CPU (make test-gpu itself needs an NVIDIA machine):
the bundle split into parts and put back together, the commands it runs (a dry run), and
tests/gpu collected and skipped cleanly without CUDA."""
import importlib.metadata
import json
import shlex
import subprocess
import sys

import pytest
import torch

from services.common.model_store import GGUF_IN_WHEEL
from tests.gpu import bundle, receive, run

MIB = 1 << 20


@pytest.fixture
def made(tmp_path):
    """A bundle of two small wheels and a model file, in parts of at most 1 MiB."""
    files = tmp_path / "files"
    files.mkdir()
    wheels = []
    for name, size in (("a-1.0-py3-none-any.whl", 700_000), ("b-2.0-py3-none-any.whl", 5)):
        (files / name).write_bytes(bytes(range(256)) * (size // 256) + b"x" * (size % 256))
        wheels.append(files / name)
    gguf = files / "model.gguf"
    gguf.write_bytes(b"GGUF" + b"\1" * 1_500_000)
    parts = bundle.make_bundle(wheels, gguf, tmp_path / "out", part_bytes=MIB)
    return parts, wheels, gguf


def test_parts_fit_the_limit_and_unpack_to_the_same_files(made, tmp_path):
    parts, wheels, gguf = made
    assert [p.name for p in parts] == ["part-1", "part-2", "part-3"]
    for part in parts:
        assert sum(f.stat().st_size for f in part.iterdir()) <= MIB + 4096  # + manifest
    into = tmp_path / "machine"
    # Parts arrive one call at a time, in any order; the last one unpacks the whole.
    assert [receive.receive(p, into) for p in (parts[2], parts[0], parts[1])] == [
        False, False, True]
    unpacked = into / "bundle"
    for wheel in wheels:
        assert (unpacked / "wheels" / wheel.name).read_bytes() == wheel.read_bytes()
    assert (unpacked / "model" / gguf.name).read_bytes() == gguf.read_bytes()
    assert not (into / "bundle.tar").exists()


def test_a_corrupted_part_is_refused(made, tmp_path):
    parts, _, _ = made
    chunk = next(parts[1].glob("bundle.tar.*"))
    data = bytearray(chunk.read_bytes())
    data[10] ^= 0xFF
    chunk.write_bytes(bytes(data))
    into = tmp_path / "machine"
    for part in parts[:2]:
        receive.receive(part, into)
    with pytest.raises(SystemExit, match="sha256 differs"):
        receive.receive(parts[2], into)


def test_part_limit_leaves_room_for_the_source_tree():
    assert bundle.part_limit(64 * MIB, 2 * MIB) == 60 * MIB
    with pytest.raises(SystemExit, match="leaves too little"):
        bundle.part_limit(64 * MIB, 60 * MIB)
    # The tree that travels now: well under the limit, so the parts keep most of it.
    assert bundle.tree_bytes() < 16 * MIB


def test_wheels_are_pinned_to_what_is_installed_here():
    pins = bundle.pinned(bundle.WHEELS)
    assert all("==" in pin for pin in pins)
    assert f"grpcio-tools=={importlib.metadata.version('grpcio-tools')}" in pins


def test_dry_run_prints_every_command_and_runs_none(tmp_path):
    out = subprocess.run([sys.executable, "-m", "tests.gpu.run", "--bundle", str(tmp_path),
                          "--report", str(tmp_path / "r.md"), "--dry-run"],
                         capture_output=True, text=True, check=True)
    commands = [line[2:] for line in out.stdout.splitlines() if line.startswith("$ ")]
    expected = [shlex.join(argv) for _, argv in run.steps(tmp_path, tmp_path / "r.jsonl")]
    assert commands[0].startswith("ln -sf ") and commands[1:] == expected
    assert [name for name, _ in run.steps(tmp_path, tmp_path / "r.jsonl")] == [
        "install wheels", "compile protos", "convert model", "pytest tests/gpu", "throughput"]
    assert "pytest tests/gpu" in out.stdout and "tests.gpu.throughput" in out.stdout
    assert not (tmp_path / "site").exists() and not (tmp_path / "r.md").exists()
    assert run.GGUF_NAME == GGUF_IN_WHEEL.rsplit("/", 1)[1]


def test_report_has_one_line_per_step_and_the_figures(tmp_path):
    record = tmp_path / "r.jsonl"
    record.write_text(json.dumps({"check": "throughput", "output_tok_s": 1.0}) + "\n")
    text = run.report([("pytest tests/gpu", 0, 3.0), ("throughput", 1, 2.0)], record,
                      tmp_path / "r.md")
    assert "- ok   pytest tests/gpu (3 s)" in text and "- FAIL throughput (2 s)" in text
    assert '"output_tok_s": 1.0' in text and (tmp_path / "r.md").read_text() == text


@pytest.mark.skipif(torch.cuda.is_available(), reason="this machine has a GPU")
def test_gpu_tests_collect_and_skip_without_cuda():
    out = subprocess.run([sys.executable, "-m", "pytest", "tests/gpu", "-q", "-rs",
                          "-p", "no:cacheprovider"], capture_output=True, text=True)
    assert out.returncode == 0, out.stdout[-3000:]
    assert " passed" not in out.stdout and " skipped" in out.stdout
    assert "error" not in out.stdout.lower()
