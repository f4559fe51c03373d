"""Worker: one rank's model, KV cache and step execution. Transport-free."""
from __future__ import annotations

import logging

import torch

from services.common.config import CacheConfig, ModelConfig, ParallelConfig
from services.common.request_types import LoadedModel
from services.common.scheduler_output import ModelRunnerOutput, SchedulerOutput
from services.worker.model_loader import load_model, resolve_dtype
from services.worker.model_runner import ModelRunner
from services.worker.parallel import init_distributed

logger = logging.getLogger(__name__)


class Worker:
    def __init__(self, rank: int = 0, device: str = "cpu"):
        self.rank = rank
        self.device = torch.device(device)
        self.model_runner: ModelRunner | None = None
        self.cache_config: CacheConfig | None = None

    def load_model(self, model_config: ModelConfig, cache_config: CacheConfig,
                   parallel_config: ParallelConfig = ParallelConfig()) -> LoadedModel:
        # The same seed on every rank: all ranks draw the same tokens.
        torch.manual_seed(model_config.seed)
        tp = init_distributed(self.rank, parallel_config.tensor_parallel_size,
                              parallel_config.distributed_init_method, self.device)
        dtype = resolve_dtype(model_config.dtype, self.device)
        model = load_model(model_config.model, dtype, model_config.max_model_len, self.device, tp)
        self.model_runner = ModelRunner(model, cache_config.block_size, self.device, dtype,
                                        model_config.max_model_len)
        self.cache_config = cache_config
        return LoadedModel(vocab_size=model.config.vocab_size, dtype=str(dtype).removeprefix("torch."),
                           kv_block_bytes=self.model_runner.kv_block_bytes())

    def determine_num_kv_blocks(self) -> int:
        # CPU: the configured KV cache size. (CUDA will profile free memory.)
        return self.cache_config.kv_cache_bytes // self.model_runner.kv_block_bytes()

    def init_kv_cache(self, num_blocks: int) -> None:
        self.model_runner.init_kv_cache(num_blocks)
        logger.info("worker %d: KV cache of %d blocks", self.rank, num_blocks)

    def execute_model(self, scheduler_output: SchedulerOutput) -> ModelRunnerOutput:
        return self.model_runner.execute_model(scheduler_output)
