"""LoRARegistry: the LoRA adapters the engine core's workers hold, by name."""
from __future__ import annotations

import logging

from services.common.config import LoRAConfig
from services.common.errors import AlreadyExists, FailedPrecondition, InvalidArgument, NotFound
from services.common.lora import LoRARequest

logger = logging.getLogger(__name__)


class LoRARegistry:
    def __init__(self, config: LoRAConfig, executor):
        self.config = config
        self.executor = executor
        self.by_name: dict[str, LoRARequest] = {}

    def add(self, lora: LoRARequest) -> None:
        """Loads the adapter into every worker, unless it is there already."""
        if not self.config.enable_lora:
            raise InvalidArgument("lora_request", "LoRA is off: start the engine with "
                                  "--enable-lora (LLM(enable_lora=True) offline)")
        known = self.by_name.get(lora.lora_name)
        if known == lora:
            return
        if known is not None:
            raise AlreadyExists(f"a LoRA adapter named {lora.lora_name!r} is loaded already, "
                                f"from {known.lora_path}; unload it first")
        if lora.lora_int_id <= 0:
            raise InvalidArgument("lora_request.lora_int_id", "must be > 0")
        if any(other.lora_int_id == lora.lora_int_id for other in self.by_name.values()):
            raise InvalidArgument("lora_request.lora_int_id",
                                  f"{lora.lora_int_id} is taken by another adapter")
        self.executor.add_lora(lora.lora_int_id, lora.lora_path)
        self.by_name[lora.lora_name] = lora
        logger.info("LoRA adapter %r (id %d) loaded from %s", lora.lora_name, lora.lora_int_id,
                    lora.lora_path)

    def remove(self, name: str, ids_in_use: set[int]) -> None:
        lora = self.by_name.get(name)
        if lora is None:
            raise NotFound(f"no LoRA adapter named {name!r} is loaded")
        if lora.lora_int_id in ids_in_use:
            raise FailedPrecondition(f"requests still run with LoRA adapter {name!r}; "
                                     "retry when they are done")
        self.executor.remove_lora(lora.lora_int_id)
        del self.by_name[name]
        logger.info("LoRA adapter %r unloaded", name)

    def reload_all(self) -> None:
        """Into workers that were restarted (and so lost them)."""
        for lora in self.by_name.values():
            self.executor.add_lora(lora.lora_int_id, lora.lora_path)
