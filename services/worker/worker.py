"""Worker: one rank's model, KV cache and step execution. Transport-free."""
from __future__ import annotations

import logging
import os
from dataclasses import dataclass

import torch

from services.common.config import CacheConfig, EngineConfig
from services.common.errors import FailedPrecondition, InvalidArgument
from services.common.request_types import LoadedModel
from services.common.scheduler_output import ModelRunnerOutput, SchedulerOutput
from services.worker.attention import make_attention_backend
from services.worker.cuda_graphs import DecodeGraphs
from services.worker.host_memory import keep_freed_host_memory
from services.worker.lora.manager import LoRAManager
from services.worker.cpu_matmul import prepare_cpu_linears
from services.worker.linear import linear_layers
from services.worker.model_loader import (load_model, resolve_dtype, resolve_storage_dtypes,
                                          whole_model)
from services.worker.model_runner import ModelRunner
from services.worker.parallel import init_distributed
from services.worker.pipeline import PipelineStage

logger = logging.getLogger(__name__)

# The largest decode batch replayed from a CUDA graph; larger ones run eagerly.
MAX_GRAPH_BATCH = 256


def kv_blocks_for_memory(total_bytes: int, utilization: float, used_bytes: int,
                         block_bytes: int) -> int:
    """KV blocks that fit in total × utilization once what the worker needs besides
    (used_bytes: weights, peak activations of a profiling run, CUDA's own) is in."""
    budget = int(total_bytes * utilization) - used_bytes
    if budget < block_bytes:
        raise ValueError(f"no GPU memory left for the KV cache: {used_bytes / 2**30:.2f} GiB "
                         f"used of a {total_bytes * utilization / 2**30:.2f} GiB budget; "
                         "raise --gpu-memory-utilization or use a smaller model")
    return budget // block_bytes


@dataclass
class CudaMemory:
    """GPU memory at one moment: free on the device, and held by torch's allocator."""

    device: torch.device
    free: int
    torch_reserved: int

    @classmethod
    def now(cls, device: torch.device) -> "CudaMemory":
        torch.cuda.synchronize(device)
        return cls(device, torch.cuda.mem_get_info(device)[0], torch.cuda.memory_reserved(device))

    def used_since(self, torch_peak: int) -> int:
        """Bytes this process took since this moment, with torch's memory at its
        `torch_peak` (reserved bytes, from a profiling run)."""
        now = CudaMemory.now(self.device)
        outside_torch = (self.free - now.free) - (now.torch_reserved - self.torch_reserved)
        return max(0, outside_torch) + torch_peak - self.torch_reserved


@dataclass
class WorkerDescription:
    """What a worker runs, once its model is loaded (its info metric)."""

    rank: int
    world_size: int
    device: str
    dtype: str
    weight_dtype: str
    kv_cache_dtype: str
    attention_backend: str
    pipeline_stage: int = 0  # from 0
    num_kv_blocks: int = 0
    kv_cache_bytes: int = 0


def resolve_device(device: str, rank: int) -> torch.device:
    """ParallelConfig.device for this rank: on CUDA, rank i runs on GPU i."""
    if device == "auto":
        device = "cuda" if torch.cuda.is_available() else "cpu"
    if device == "cpu":
        return torch.device("cpu")
    if not torch.cuda.is_available():
        raise FailedPrecondition("--device cuda: torch sees no CUDA GPU on this worker's machine "
                                 f"(torch {torch.__version__}); use --device cpu")
    if rank >= torch.cuda.device_count():
        raise FailedPrecondition(f"worker rank {rank} needs GPU {rank}, but this machine has "
                                 f"{torch.cuda.device_count()}")
    return torch.device("cuda", rank)


class Worker:
    def __init__(self, rank: int = 0, pinned: bool = False):
        self.rank = rank
        # Known once load_model has the config (ParallelConfig.device).
        self.device = torch.device("cpu")
        # Pinned to its own cores (and thread count) by whoever started it.
        self.pinned = pinned
        self.model_runner: ModelRunner | None = None
        self.cache_config: CacheConfig | None = None
        self.description: WorkerDescription | None = None

    def load_model(self, config: EngineConfig) -> LoadedModel:
        model_config, cache_config = config.model, config.cache
        parallel_config, lora_config = config.parallel, config.lora
        # The same seed on every rank: all ranks draw the same tokens.
        torch.manual_seed(model_config.seed)
        self.device = resolve_device(parallel_config.device, self.rank)
        if self.device.type == "cuda":
            torch.cuda.set_device(self.device)
            self._cuda_start = CudaMemory.now(self.device)
        elif not keep_freed_host_memory():
            logger.info("malloc is not glibc's: freed activations may go back to the kernel")
        num_stages = parallel_config.pipeline_parallel_size
        tp = init_distributed(self.rank, parallel_config.tensor_parallel_size,
                              parallel_config.distributed_init_method, self.device, num_stages)
        world = tp.size * num_stages
        if world > 1 and self.device.type == "cpu" and not self.pinned:
            # Ranks on one machine share its cores (see cpu_cores.py); the
            # launcher pins each to its own, a rank started alone takes its share.
            torch.set_num_threads(max(1, (os.cpu_count() or 1) // world))
        dtype = resolve_dtype(model_config.dtype, self.device)
        weight_dtype, kv_dtype = resolve_storage_dtypes(dtype, model_config.weight_dtype,
                                                        cache_config.kv_cache_dtype)
        backend = make_attention_backend(model_config.attention_backend, self.device,
                                         cache_config.block_size, kv_dtype)
        partition = parallel_config.pp_layer_partition
        # A partition is checked against the model's layers even for one stage.
        stage_for = whole_model if num_stages == 1 and not partition else (
            lambda num_layers: PipelineStage.of(self.rank, tp.size, num_stages, num_layers,
                                                partition))
        model = load_model(model_config.model, dtype, model_config.max_model_len, self.device, tp,
                           backend, stage_for)
        graphs = None
        # LoRA deltas depend on per-step slot tensors the graphs would not see; a
        # pipeline stage's step sends and receives tensors outside any graph.
        if self.device.type == "cuda" and backend.graph_safe and num_stages == 1 \
                and not model_config.enforce_eager and not lora_config.enable_lora:
            graphs = DecodeGraphs(model, MAX_GRAPH_BATCH, model_config.max_model_len,
                                  cache_config.block_size, self.device, capture=True)
        linears = (_prepare_cpu_model(model, dtype, weight_dtype)
                   if self.device.type == "cpu" else "F.linear")
        lora = (LoRAManager(model, lora_config.max_loras, lora_config.max_lora_rank, tp,
                            dtype, self.device)
                if lora_config.enable_lora else None)
        draft = self._load_draft_model(config, model, dtype, weight_dtype, backend)
        # After the linears' strategies and LoRA: the C++ loop takes plain layers only.
        in_cpp = self.device.type == "cpu" and lora is None
        decode = (model.model.cpu_decode.reach if in_cpp and model.use_cpu_decode_layers()
                  else "Python")
        if in_cpp and draft is not None:
            draft.use_cpu_decode_layers()
        self.model_runner = ModelRunner(model, cache_config.block_size, self.device, kv_dtype,
                                        model_config.max_model_len, graphs, lora, dtype,
                                        config.speculative, draft)
        self.cache_config = cache_config
        self.description = WorkerDescription(
            self.rank, world, str(self.device), _name(dtype), _name(weight_dtype or dtype),
            _name(kv_dtype), backend.name, model.stage.rank)
        logger.info("worker %d on %s: %s, %s attention, linears: %s, KV cache %s, CUDA graphs "
                    "%s, decode steps' layers in %s", self.rank, self.device, dtype, backend.name,
                    linears, kv_dtype, "on" if graphs else "off", decode)
        _log_stage(self.rank, model)
        return LoadedModel(vocab_size=model.config.vocab_size, dtype=_name(dtype),
                           kv_block_bytes=self.model_runner.kv_block_bytes(),
                           hidden_size=model.config.hidden_size)

    def _load_draft_model(self, config: EngineConfig, target: torch.nn.Module,
                          dtype: torch.dtype, weight_dtype, backend) -> torch.nn.Module | None:
        """speculative_config's draft model, whole on every rank (it is small, and
        each rank then drafts the same tokens), in the target's dtype."""
        spec = config.speculative
        if spec.method != "draft_model":
            return None
        draft = load_model(spec.model, dtype, config.model.max_model_len, self.device,
                           backend=backend)
        if draft.config.vocab_size != target.config.vocab_size:
            raise InvalidArgument("speculative_config.model", (
                f"the draft model has {draft.config.vocab_size} tokens in its vocabulary, the "
                f"target {target.config.vocab_size}: a draft model must share the target's "
                "tokenizer"))
        if self.device.type == "cpu":
            _prepare_cpu_model(draft, dtype, weight_dtype)
        logger.info("worker %d: draft model %s (%d layers)", self.rank, spec.model,
                    draft.config.num_hidden_layers)
        return draft

    def determine_num_kv_blocks(self) -> int:
        """CPU: the configured KV cache size. CUDA: what the memory budget leaves after
        the weights and the peak activations of a profiling forward pass."""
        block_bytes = self.model_runner.kv_block_bytes()
        if self.device.type != "cuda":
            return self.cache_config.kv_cache_bytes // block_bytes
        peak = self.model_runner.profile_peak_memory()
        # As vLLM counts it: what this worker took since load_model began, torch's peak
        # and memory outside torch's allocator (CUDA context, cuBLAS, NCCL) alike.
        used = self._cuda_start.used_since(peak)
        total = torch.cuda.mem_get_info(self.device)[1]
        return kv_blocks_for_memory(total, self.cache_config.gpu_memory_utilization, used,
                                    block_bytes)

    def init_kv_cache(self, num_blocks: int) -> None:
        self.model_runner.init_kv_cache(num_blocks)
        self.description.num_kv_blocks = num_blocks
        self.description.kv_cache_bytes = num_blocks * self.model_runner.kv_block_bytes()
        logger.info("worker %d: KV cache of %d blocks", self.rank, num_blocks)

    def execute_model(self, scheduler_output: SchedulerOutput) -> ModelRunnerOutput:
        return self.model_runner.execute_model(scheduler_output)

    def add_lora(self, lora_id: int, lora_path: str) -> None:
        lora = self.model_runner.lora
        if lora is None:
            raise FailedPrecondition("LoRA is off: start the engine with --enable-lora")
        try:
            lora.add_adapter(lora_id, lora_path)
        except ValueError as e:
            raise InvalidArgument("lora_path", str(e)) from None

    def remove_lora(self, lora_id: int) -> None:
        if self.model_runner.lora is not None:
            self.model_runner.lora.remove_adapter(lora_id)


def _prepare_cpu_model(model: torch.nn.Module, dtype: torch.dtype, weight_dtype) -> str:
    """A loaded model made ready for the CPU: each linear layer's strategy built from
    its weights (which load_model put on huge pages); returns the name of the
    linears' path."""
    return prepare_cpu_linears(linear_layers(model), dtype, weight_dtype)


def _log_stage(rank: int, model: torch.nn.Module) -> None:
    """What this rank holds, counted from its loaded parameters (a tied head once)."""
    stage, num_layers = model.stage, len(model.model.own_layers)
    num_params = sum(p.numel() for p in model.parameters())
    logger.info("worker %d: pipeline stage %d of %d, layers %d-%d, %d parameters", rank,
                stage.rank + 1, stage.size, stage.start_layer,
                stage.start_layer + num_layers - 1, num_params)


def _name(dtype: torch.dtype) -> str:
    return str(dtype).removeprefix("torch.")
