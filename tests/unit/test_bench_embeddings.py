"""The embedding section of the bench on made-up figures, and the vLLM runner's
embedding path against a stand-in `vllm` module (nothing here runs vLLM; the
harness test runs llmserve's side at a tiny size)."""
import json
import types

import pytest

from bench import embeddings
from tests.unit.fake_vllm import load_runner


def test_figures_are_the_median_rounds():
    row = embeddings.figures([4.0, 2.0, 8.0], requests=8, prompt_len=16)
    assert row["seconds"] == 4.0 and row["round_seconds"] == [4.0, 2.0, 8.0]
    assert row["prompts_s"] == 2.0 and row["tok_s"] == 32.0


def test_min_cosine_is_the_worst_prompt():
    a = [[1.0, 0.0], [0.0, 2.0]]
    b = [[3.0, 0.0], [1.0, 1.0]]
    assert embeddings.min_cosine(a, b) == pytest.approx(2 ** -0.5)
    assert embeddings.min_cosine(a, a) == pytest.approx(1.0)


def _results(vllm: dict | None, with_floor: bool = True) -> dict:
    section = {"requests": 64, "prompt_len": 128, "rounds": 3, "pooling_type": "LAST",
               "normalize": True, "dtype": "float32",
               "llmserve": embeddings.figures([8.0, 8.0, 8.0], 64, 128)}
    if vllm is not None:
        section["vllm"] = vllm
    if vllm and "error" not in vllm:
        section["ratio_vllm"] = section["llmserve"]["prompts_s"] / vllm["prompts_s"]
        section["min_cosine"] = 0.9999991
    floors = {"embeddings": {"seconds": 4.0, "prompts_s": 16.0, "tok_s": 2048.0}}
    return {"embeddings": section, "floor": {"floors": floors} if with_floor else None}


def test_section_has_the_ratio_the_agreement_and_the_floor_shares():
    lines = "\n".join(embeddings.embeddings_section(
        _results(embeddings.figures([16.0, 16.0, 16.0], 64, 128))))
    assert "## Embeddings: `LLM.embed`, 64 prompts × 128 tokens, LAST pooling, normalized" in lines
    assert "llmserve ÷ vLLM-CPU: 2.00×" in lines and "0.999999" in lines
    assert "| prompts/s | 8.00 [50%] | 4.00 [25%] | 16.00 |" in lines
    assert "| prompt tokens/s | 1024.0 [50%] | 512.0 [25%] | 2048.0 |" in lines


def test_section_says_why_vllm_is_missing():
    failed = "\n".join(embeddings.embeddings_section(_results({"error": "no venv"})))
    assert "vLLM-CPU not measured: no venv" in failed and "| prompts/s | 8.00 [50%] | - |" in failed
    skipped = "\n".join(embeddings.embeddings_section(_results(None, with_floor=False)))
    assert "vLLM-CPU was not run." in skipped and "| prompts/s | 8.00 |" in skipped
    assert embeddings.embeddings_section({}) == []


class _FakeLLM:
    """vllm.LLM as the runner uses it: records its arguments, embeds every prompt as
    [its length, its first id]."""
    made: list[dict] = []

    def __init__(self, **kwargs):
        _FakeLLM.made.append(kwargs)
        self.llm_engine = None  # describe() records the error and goes on

    def embed(self, prompts, use_tqdm):
        assert use_tqdm is False
        ids = [p["prompt_token_ids"] for p in prompts]
        return [types.SimpleNamespace(outputs=types.SimpleNamespace(
            embedding=[float(len(p)), float(p[0])])) for p in ids]


@pytest.fixture
def fake_vllm(monkeypatch):
    _FakeLLM.made.clear()
    return load_runner(monkeypatch, _FakeLLM,
                       config={"PoolerConfig": lambda **kwargs: kwargs})


def test_runner_embeds_with_the_pooling_runner_and_the_specs_pooler(fake_vllm, tmp_path):
    spec = {"task": "embed", "model": "/m", "dtype": "float32", "max_model_len": 64, "seed": 0,
            "pooling_type": "LAST", "normalize": True, "prompts": [[5, 6, 7], [8, 9]],
            "warmup": [[1, 2]], "rounds": 2}
    (tmp_path / "spec.json").write_text(json.dumps(spec))
    fake_vllm.main([str(tmp_path / "spec.json"), str(tmp_path / "out.json")])
    [kwargs] = _FakeLLM.made
    assert kwargs["runner"] == "pooling" and kwargs["enable_prefix_caching"] is False
    # vLLM 0.32 names normalization use_activation.
    assert kwargs["pooler_config"] == {"pooling_type": "LAST", "use_activation": True}
    out = json.loads((tmp_path / "out.json").read_text())
    assert len(out["seconds"]) == 2 and all(s >= 0 for s in out["seconds"])
    assert out["embeddings"] == [[3.0, 5.0], [2.0, 8.0]]
    assert "embed 2 prompts, round 2" in out["phases"]
