"""bench/spec_decode.py without running an engine: a stream's figures, the
section's table, and the runner's "spec" task against a stand-in `vllm` module
(a method it refuses, and one it runs, with its acceptance counters)."""
import json
import types

import pytest

from bench import spec_decode
from tests.unit.fake_vllm import load_runner


def test_stream_figures_share_a_steps_gap_among_its_tokens():
    f = spec_decode.stream_figures([(1.0, 1), (1.1, 2), (1.3, 1)], start=0.9)
    assert f["tokens"] == 4 and f["ttft_s"] == pytest.approx(0.1)
    assert f["itl_s"] == pytest.approx(0.3 / 3)


def _figures(copy_ms: float, salad_ms: float) -> dict:
    return {"copy-heavy": {"itl_s": copy_ms / 1e3, "ttft_s": 0.05},
            "word salad": {"itl_s": salad_ms / 1e3, "ttft_s": 0.05}}


def test_section_compares_each_method_with_off_vllm_and_the_floor():
    ours = {"off": _figures(20, 20), "ngram": {**_figures(8, 20.5), "acceptance_length": 3.2},
            "suffix": _figures(6, 20), "draft_model": _figures(21, 21)}
    theirs = {"off": _figures(30, 30), "ngram": {**_figures(15, 31), "acceptance_length": 3.0},
              "suffix": {"error": "ImportError: Arctic Inference is required"},
              "draft_model": {"error": "boom"}}
    results = {"spec_decode": {"tokens": 128, "dtype": "float32",
                               "num_speculative_tokens": {"ngram": 8, "suffix": 8,
                                                          "draft_model": 4},
                               "draft_layers": 4, "llmserve": ours, "vllm": theirs,
                               "floor_itl_s": 0.016,
                               "batch": {"requests": 64, "off": 100.0, "ngram": 99.0}}}
    text = "\n".join(spec_decode.spec_decode_section(results))
    assert ("| ngram (8) | copy-heavy | 8.0 | 0.40× | 15.0 | 0.53× | 0.27× | 0.50× | "
            "3.20 (vLLM 3.00) |") in text
    assert "| suffix (8) | copy-heavy | 6.0 | 0.30× | refused | - | 0.20× |" in text
    assert "| off | word salad | 20.0 | 1.00× | 30.0 |" in text
    assert "ngram on 99.0 out tok/s against off 100.0 (**0.990×**)" in text
    assert "first 4 layers" in text
    assert spec_decode.spec_decode_section({}) == []


class _Engine:
    """llm.llm_engine: each step returns two tokens (a draft accepted each step)."""

    def __init__(self):
        self.left = 0

    def add_request(self, request_id, prompt, params):
        self.left = params.kwargs["max_tokens"]

    def has_unfinished_requests(self):
        return self.left > 0

    def step(self):
        n = min(2, self.left)
        self.left -= n
        return [types.SimpleNamespace(outputs=[types.SimpleNamespace(token_ids=[7] * n)])]


class _FakeLLM:
    made: list[dict] = []

    def __init__(self, **kwargs):
        _FakeLLM.made.append(kwargs)
        if (kwargs.get("speculative_config") or {}).get("method") == "suffix":
            raise ImportError("Arctic Inference is required for suffix decoding")
        self.llm_engine = _Engine()

    def get_metrics(self):
        return [types.SimpleNamespace(name="vllm:spec_decode_num_drafts", value=10),
                types.SimpleNamespace(name="vllm:spec_decode_num_accepted_tokens", value=15)]


@pytest.fixture
def fake_vllm(monkeypatch):
    _FakeLLM.made.clear()
    return load_runner(monkeypatch, _FakeLLM,
                       sampling_params={"RequestOutputKind": types.SimpleNamespace(
                           DELTA="delta", FINAL_ONLY="final")})


@pytest.mark.parametrize("method", ["ngram", "suffix"])
def test_runner_spec_task_runs_each_stream_or_says_why_not(fake_vllm, monkeypatch, tmp_path,
                                                           method):
    monkeypatch.setattr(fake_vllm, "greedy", lambda n, delta=False: types.SimpleNamespace(
        kwargs={"max_tokens": n}))
    spec = {"task": "spec", "model": "/m", "dtype": "float32", "max_model_len": 64, "seed": 0,
            "speculative_config": {"method": method, "num_speculative_tokens": 4},
            "warmup": [1, 2], "workloads": {"copy-heavy": [[5, 6], [7, 8]]}, "max_tokens": 6}
    (tmp_path / "spec.json").write_text(json.dumps(spec))
    fake_vllm.main([str(tmp_path / "spec.json"), str(tmp_path / "out.json")])
    out = json.loads((tmp_path / "out.json").read_text())
    assert _FakeLLM.made[0]["speculative_config"]["method"] == method
    if method == "suffix":
        assert out["error"].startswith("ImportError: Arctic Inference")
        return
    streams = out["workloads"]["copy-heavy"]
    assert len(streams) == 2 and [n for _, n in streams[0]["chunks"]] == [2, 2, 2]
    assert out["acceptance_length"] == 2.5
