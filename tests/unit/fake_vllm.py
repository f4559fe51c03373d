"""bench/vllm_runner.py loaded against a stand-in `vllm` package, so its tasks are
tested without vLLM (the runner imports nothing else of ours)."""
from __future__ import annotations

import importlib.util
import sys
import types

from bench import vllm_baseline


def load_runner(monkeypatch, llm_class, **submodules: dict):
    """The runner module, with vllm.LLM = llm_class and each keyword a submodule
    (`sampling_params={"BeamSearchParams": ...}` is vllm.sampling_params)."""
    vllm = types.ModuleType("vllm")
    vllm.LLM, vllm.__version__ = llm_class, "0.32.0"
    monkeypatch.setitem(sys.modules, "vllm", vllm)
    for name, attributes in submodules.items():
        module = types.ModuleType(f"vllm.{name}")
        for key, value in attributes.items():
            setattr(module, key, value)
        monkeypatch.setitem(sys.modules, f"vllm.{name}", module)
    spec = importlib.util.spec_from_file_location("vllm_runner", vllm_baseline.RUNNER)
    runner = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(runner)
    return runner
