"""Builds our model for an HF directory (safetensors, sharded or not) or a GGUF file,
and loads its weights."""
from __future__ import annotations

import glob
import json
import logging
import math
import os
from typing import Callable, Iterator

import numpy as np
import torch
from safetensors import safe_open
from transformers import AutoConfig, PreTrainedConfig

from services.common.model_store import find_gguf
from services.worker.cpu_info import cpu_flags
from services.worker.host_memory import (HugePageArena, huge_pages_available,
                                         storage_on_huge_pages)
from services.worker.parallel import SINGLE, TensorParallel
from services.worker.pipeline import SINGLE_STAGE, PipelineStage
from services.worker.models import model_class_for

logger = logging.getLogger(__name__)

_DTYPES = {"float32": torch.float32, "bfloat16": torch.bfloat16, "float16": torch.float16}
_SAFETENSORS_INDEX = "model.safetensors.index.json"

Weights = Iterator[tuple[str, torch.Tensor]]
StageFor = Callable[[int], PipelineStage]


def whole_model(num_layers: int) -> PipelineStage:
    """The StageFor of a rank that holds every layer (no pipeline parallelism)."""
    return SINGLE_STAGE


def cpu_has_bf16() -> bool:
    """True when the CPU computes bf16 natively (AMX or AVX512-BF16)."""
    return bool({"amx_bf16", "avx512_bf16"} & cpu_flags())


def resolve_dtype(name: str, device: torch.device) -> torch.dtype:
    """'auto' is bf16 on CUDA and on CPUs with native bf16, fp32 elsewhere."""
    if name == "auto":
        return torch.bfloat16 if device.type == "cuda" or cpu_has_bf16() else torch.float32
    if name not in _DTYPES:
        raise ValueError(f"unknown dtype {name!r}; choose one of {sorted(_DTYPES)} or 'auto'")
    return _DTYPES[name]


def resolve_storage_dtypes(model_dtype: torch.dtype, weight_dtype: str,
                           kv_cache_dtype: str) -> tuple[torch.dtype | None, torch.dtype]:
    """(16-bit weight dtype or None, KV cache dtype) from the opt-in settings
    ("auto": as the model's dtype)."""
    weights = None
    if weight_dtype != "auto":
        if model_dtype != torch.float32:
            raise ValueError(f"--weight-dtype {weight_dtype} applies to float32 models; this "
                             f"one runs in {str(model_dtype).removeprefix('torch.')} already")
        weights = resolve_dtype(weight_dtype, torch.device("cpu"))
    return weights, (model_dtype if kv_cache_dtype == "auto"
                     else resolve_dtype(kv_cache_dtype, torch.device("cpu")))


# ---- HF directories ------------------------------------------------------------------


def safetensors_files(model_dir: str) -> list[str]:
    """The checkpoint's files: the shards its index names, else model.safetensors,
    else every *.safetensors (some repos also ship e.g. consolidated.safetensors in
    another naming scheme, which must not be read on top)."""
    index = os.path.join(model_dir, _SAFETENSORS_INDEX)
    if os.path.exists(index):
        with open(index) as f:
            shards = sorted(set(json.load(f)["weight_map"].values()))
        files = [os.path.join(model_dir, shard) for shard in shards]
        missing = [path for path in files if not os.path.exists(path)]
        if missing:
            raise FileNotFoundError(f"{_SAFETENSORS_INDEX} names missing shards: {missing}")
        return files
    single = os.path.join(model_dir, "model.safetensors")
    if os.path.exists(single):
        return [single]
    files = sorted(glob.glob(os.path.join(model_dir, "*.safetensors")))
    if not files:
        raise FileNotFoundError(f"no *.safetensors files in {model_dir}")
    return files


def checkpoint_arena(model_dir: str, dtype: torch.dtype) -> HugePageArena | None:
    """A HugePageArena with room for every tensor of the checkpoint in `dtype`,
    populated in the background from now: made before transformers' config, whose
    imports take seconds of one core (bench/NOTES.md). None without huge pages."""
    if not huge_pages_available():
        return None
    sizes = []
    for path in safetensors_files(model_dir):
        with safe_open(path, framework="pt") as f:
            sizes += [math.prod(f.get_slice(name).get_shape()) * dtype.itemsize
                      for name in f.keys()]
    return HugePageArena(HugePageArena.bytes_for_sizes(sizes), populate=True)


def iterate_safetensors(model_dir: str, wanted: Callable[[str], bool] = lambda name: True
                        ) -> Weights:
    """The checkpoint's tensors whose names are `wanted` (the others are not read)."""
    for path in safetensors_files(model_dir):
        with safe_open(path, framework="pt") as f:
            for name in f.keys():
                if wanted(name):
                    yield name, f.get_tensor(name)


# ---- GGUF files ----------------------------------------------------------------------


def gguf_config(path: str, reader) -> PreTrainedConfig:
    """transformers' config for the GGUF, completed from metadata it does not map."""
    directory, filename = os.path.split(os.path.abspath(path))
    config = AutoConfig.from_pretrained(directory, gguf_file=filename)
    arch = _gguf_field(reader, "general.architecture")
    # transformers maps head_dim for llama only (from rope.dimension_count); Qwen3's
    # head_dim differs from hidden_size / num_heads and is in key_length.
    key_length = _gguf_field(reader, f"{arch}.attention.key_length")
    if key_length is not None:
        config.head_dim = int(key_length)
    rope = _gguf_rope_parameters(reader, arch, config)
    if rope is not None:
        config.rope_parameters = rope
    return config


def _gguf_field(reader, key: str):
    from transformers.modeling_gguf_pytorch_utils import read_field

    value = read_field(reader, key)
    return value[0] if len(value) == 1 else (value or None)


def _gguf_rope_parameters(reader, arch: str, config: PreTrainedConfig) -> dict | None:
    """HF rope_parameters for llama.cpp's rope.scaling.* keys (transformers ignores them)."""
    field = lambda name: _gguf_field(reader, f"{arch}.rope.scaling.{name}")  # noqa: E731
    kind = field("type")
    if kind in (None, "none"):
        return None
    theta = config.rope_parameters["rope_theta"]
    if kind == "linear":
        return {"rope_type": "linear", "rope_theta": theta, "factor": float(field("factor"))}
    # llama.cpp folds these into its own yarn formula; HF has no equivalent for them.
    extras = [name for name in ("attn_factor", "yarn_log_multiplier", "yarn_ext_factor")
              if field(name) is not None]
    if kind != "yarn" or extras:
        raise NotImplementedError(f"GGUF rope scaling {kind!r} {extras or ''} is not supported")
    rope = {"rope_type": "yarn", "rope_theta": theta, "factor": float(field("factor")),
            "original_max_position_embeddings": int(field("original_context_length"))}
    for gguf_name, hf_name in (("yarn_beta_fast", "beta_fast"), ("yarn_beta_slow", "beta_slow")):
        if field(gguf_name) is not None:
            rope[hf_name] = float(field(gguf_name))
    return rope


def gguf_to_hf_names(arch: str, config: PreTrainedConfig) -> dict[str, str]:
    """GGUF tensor name -> HF checkpoint name, from gguf's own table.

    The GGUF's architecture picks the table: Mistral is stored by llama.cpp as
    "llama", and gguf has no "mistral" one. (transformers' get_gguf_hf_weights_map
    does the same, but builds the table once per submodule: seconds per load.)
    """
    from gguf import MODEL_ARCH_NAMES, get_tensor_name_map
    from transformers import AutoModelForCausalLM

    gguf_arch = next((key for key, name in MODEL_ARCH_NAMES.items() if name == arch), None)
    if gguf_arch is None:
        raise ValueError(f"unknown GGUF architecture {arch!r}")
    table = get_tensor_name_map(gguf_arch, config.num_hidden_layers)
    with torch.device("meta"):  # only the parameter names are wanted
        skeleton = AutoModelForCausalLM.from_config(config)
    names = {}
    for hf_name in skeleton.state_dict():
        base, suffix = hf_name.rsplit(".", 1)
        gguf_name = table.get_name(base)
        if gguf_name is not None:
            names[f"{gguf_name}.{suffix}"] = hf_name
    return names


def iterate_gguf(reader, config: PreTrainedConfig,
                 wanted: Callable[[str], bool] = lambda name: True) -> Weights:
    """Dequantized tensors, one at a time, under their HF checkpoint names (those
    `wanted`; the others are not dequantized).

    gguf dequantizes; transformers' tensor processor reverses llama.cpp's q/k
    permutation.
    """
    from gguf import dequantize
    from transformers.modeling_gguf_pytorch_utils import TENSOR_PROCESSORS, TensorProcessor

    arch = _gguf_field(reader, "general.architecture")
    processor = TENSOR_PROCESSORS.get(arch, TensorProcessor)(config=config.to_dict())
    names = gguf_to_hf_names(arch, config)
    for tensor in reader.tensors:
        if tensor.name.startswith(("rope_freqs", "rope_factors")):
            raise NotImplementedError(
                f"GGUF tensor {tensor.name!r} (per-frequency rope factors, e.g. Llama 3.1 rope) "
                "is not supported; use the HF checkpoint")
        if tensor.name not in names:
            raise KeyError(f"GGUF tensor {tensor.name!r} has no {arch!r} checkpoint name")
        if not wanted(names[tensor.name]):
            continue
        weights = processor.process(weights=dequantize(tensor.data, tensor.tensor_type),
                                    name=tensor.name).weights
        # Dequantized F32 tensors are read-only views of the memory-mapped file.
        yield names[tensor.name], torch.from_numpy(np.array(weights, copy=True))


# ---- building -------------------------------------------------------------------------


def build_model(config: PreTrainedConfig, dtype: torch.dtype, max_positions: int,
                device: torch.device, tp: TensorParallel = SINGLE,
                backend=None, stage_for: StageFor = whole_model
                ) -> torch.nn.Module:
    """Our model for the config (this rank's shard of its pipeline stage's layers),
    weights uninitialized."""
    model_class = model_class_for(config)
    default_dtype = torch.get_default_dtype()
    torch.set_default_dtype(dtype)
    try:
        with device:
            return model_class(config, max_positions, backend=backend, tp=tp,
                               stage=stage_for(config.num_hidden_layers))
    finally:
        torch.set_default_dtype(default_dtype)


def _build_on_huge_pages(config: PreTrainedConfig, dtype: torch.dtype, max_positions: int,
                         device: torch.device, tp: TensorParallel, backend,
                         stage_for: StageFor, arena: HugePageArena | None = None
                         ) -> torch.nn.Module:
    """build_model, its CPU parameters then given storage on huge pages (a decode
    step streams them all; `arena` when it has the room) for the checkpoint to be
    loaded into; load_weights fills every parameter or raises. The storage they
    were built with is never written: moved after the load, every weight was
    written twice, and the first copies' memory stayed in the heap (bench/NOTES.md)."""
    net = build_model(config, dtype, max_positions, device, tp, backend, stage_for)
    if device.type == "cpu" and not storage_on_huge_pages(net, arena):
        logger.info("no transparent huge pages here: the weights stay on 4 KB pages")
    return net


def load_model(model: str, dtype: torch.dtype, max_positions: int, device: torch.device,
               tp: TensorParallel = SINGLE, backend=None,
               stage_for: StageFor = whole_model) -> torch.nn.Module:
    """From an HF directory, a .gguf file or a directory holding one .gguf; with tensor
    parallelism, this rank's shard; with pipeline parallelism, of its stage's layers
    only (stage_for: the stage, given the model's layer count)."""
    gguf_path = find_gguf(model)
    if gguf_path is None:
        # A shard or a stage is not known before the config; its rank's arena is
        # made then, for only what it holds.
        arena = (checkpoint_arena(model, dtype) if device.type == "cpu" and tp.size == 1
                 and stage_for is whole_model else None)
        config = AutoConfig.from_pretrained(model)
        net = _build_on_huge_pages(config, dtype, max_positions, device, tp, backend, stage_for,
                                   arena)
        net.load_weights(iterate_safetensors(model, net.wants))
    else:
        from gguf import GGUFReader

        reader = GGUFReader(gguf_path)
        config = gguf_config(gguf_path, reader)
        net = _build_on_huge_pages(config, dtype, max_positions, device, tp, backend, stage_for)
        net.load_weights(iterate_gguf(reader, config, net.wants))
    logger.info("loaded %s from %s (%s, %s)", type(net).__name__, gguf_path or model, dtype, device)
    return net.eval()
