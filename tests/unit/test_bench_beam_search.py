"""bench/beam_search.py without running an engine: figures, the block count of
unshared beams, the section's text, and the runner's beam path against a
stand-in `vllm` module (nothing here runs vLLM)."""
import json
import types

import pytest

from bench import beam_search
from tests.unit.fake_vllm import load_runner


def _results(vllm) -> dict:
    ours = {**beam_search.figures(8.0, 16, 4, 64), "peak_blocks": 300, "block_size": 16,
            "preemptions": 0, "unshared_blocks": beam_search.unshared_blocks(16, 4, 128, 64, 16)}
    section = {"requests": 16, "prompt_len": 128, "beam_width": 4, "max_tokens": 64,
               "dtype": "float32", "llmserve": ours}
    if vllm is not None:
        section["vllm"] = vllm
        if "error" not in vllm:
            section["ratio_vllm"] = vllm["seconds"] / ours["seconds"]
            section["same_best_beam"] = 15
    return {"beam_search": section}


def test_figures_and_unshared_blocks():
    f = beam_search.figures(8.0, 16, 4, 64)
    assert f["prompts_s"] == 2.0 and f["beam_tok_s"] == 16 * 4 * 64 / 8
    assert beam_search.unshared_blocks(16, 4, 128, 64, 16) == 16 * 4 * 12


def test_section_has_the_ratio_the_agreement_and_the_blocks():
    lines = "\n".join(beam_search.beam_search_section(
        _results(beam_search.figures(24.0, 16, 4, 64))))
    assert ("## Beam search: `LLM.beam_search`, 16 prompts × 128 tokens, beam_width 4, "
            "64 tokens, float32") in lines
    assert "llmserve is 3.00× as fast as vLLM-CPU" in lines
    assert "identical for 15 of 16 prompts" in lines
    assert "peak KV blocks in use: **300** of 16 tokens, against 768" in lines and "(39%)" in lines
    assert "| wall time s | 8.00 | 24.00 |" in lines


def test_section_says_why_vllm_is_missing():
    failed = "\n".join(beam_search.beam_search_section(_results({"error": "no venv"})))
    assert "vLLM-CPU not measured: no venv" in failed and "| wall time s | 8.00 |" in failed
    assert "vLLM-CPU was not run." in "\n".join(beam_search.beam_search_section(_results(None)))
    assert beam_search.beam_search_section({}) == []


class _FakeLLM:
    """vllm.LLM as the runner uses it: each prompt's best beam is the prompt reversed."""
    made: list[dict] = []

    def __init__(self, **kwargs):
        _FakeLLM.made.append(kwargs)
        self.llm_engine = None  # describe() records the error and goes on

    def beam_search(self, prompts, params):
        assert params.kwargs == {"beam_width": 2, "max_tokens": 3, "ignore_eos": True}
        return [types.SimpleNamespace(sequences=[types.SimpleNamespace(
            tokens=p["prompt_token_ids"][::-1])]) for p in prompts]


@pytest.fixture
def fake_vllm(monkeypatch):
    _FakeLLM.made.clear()
    return load_runner(monkeypatch, _FakeLLM, sampling_params={
        "BeamSearchParams": lambda **kwargs: types.SimpleNamespace(kwargs=kwargs)})


def test_runner_beam_searches_with_prefix_caching_on(fake_vllm, tmp_path):
    spec = {"task": "beam", "model": "/m", "dtype": "float32", "max_model_len": 64, "seed": 0,
            "prompts": [[5, 6, 7], [8, 9]], "warmup": [[1, 2]], "beam_width": 2,
            "max_tokens": 3}
    (tmp_path / "spec.json").write_text(json.dumps(spec))
    fake_vllm.main([str(tmp_path / "spec.json"), str(tmp_path / "out.json")])
    [kwargs] = _FakeLLM.made
    assert kwargs["enable_prefix_caching"] is True
    out = json.loads((tmp_path / "out.json").read_text())
    assert out["seconds"] >= 0 and out["best"] == [[7, 6, 5], [9, 8]]
    assert "beam search, 2 prompts" in out["phases"]
