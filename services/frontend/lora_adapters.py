"""LoRAAdapters: the LoRA adapters a frontend serves, by name. The frontend sends
the adapter along with every request that names it, so an engine core replica
that did not hold it yet (restarted, or new) loads it then."""
from __future__ import annotations

import logging
import zlib

from services.common.errors import AlreadyExists, InvalidArgument, NotFound
from services.common.lora import LoRARequest
from services.frontend.engine_client import EngineClient

logger = logging.getLogger(__name__)
MAX_NAME_CHARS = 128


class LoRAAdapters:
    def __init__(self, engine: EngineClient):
        self.engine = engine
        self.by_name: dict[str, LoRARequest] = {}

    def get(self, name: str | None) -> LoRARequest | None:
        if name is None:
            return None
        lora = self.by_name.get(name)
        if lora is None:
            raise NotFound(f"no LoRA adapter named {name!r} is loaded (loaded: "
                           f"{', '.join(self.by_name) or 'none'})")
        return lora

    def names(self) -> list[str]:
        return list(self.by_name)

    async def load(self, name: str, path: str) -> None:
        if not 0 < len(name) <= MAX_NAME_CHARS:
            raise InvalidArgument("lora_name", f"must have 1 to {MAX_NAME_CHARS} characters")
        if not path:
            raise InvalidArgument("lora_path", "is empty")
        if name in self.by_name:
            raise AlreadyExists(f"a LoRA adapter named {name!r} is loaded already; "
                                "unload it first")
        lora = LoRARequest(name, adapter_id(name, path), path)
        await self.engine.add_lora(lora)
        self.by_name[name] = lora
        logger.info("LoRA adapter %r loaded from %s", name, path)

    async def unload(self, name: str) -> None:
        self.get(name)
        await self.engine.remove_lora(name)
        del self.by_name[name]
        logger.info("LoRA adapter %r unloaded", name)


def adapter_id(name: str, path: str) -> int:
    """The engine's id of an adapter, from its name and path: frontends that load
    the same adapter (several replicas behind one engine) agree on it without
    talking to each other. A clash of two adapters is refused by the engine core."""
    return zlib.crc32(f"{name}\0{path}".encode()) % (2**31 - 1) + 1
