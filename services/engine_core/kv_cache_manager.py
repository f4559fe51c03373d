"""KVCacheManager: which blocks each request holds."""
from __future__ import annotations

from services.engine_core.block_pool import BlockPool, KVCacheBlock
from services.engine_core.request import Request


def cdiv(a: int, b: int) -> int:
    return -(-a // b)


class KVCacheManager:
    def __init__(self, num_blocks: int, block_size: int):
        self.block_size = block_size
        self.block_pool = BlockPool(num_blocks)
        self.req_to_blocks: dict[str, list[KVCacheBlock]] = {}

    @property
    def num_blocks(self) -> int:
        return self.block_pool.num_blocks

    @property
    def num_free_blocks(self) -> int:
        return self.block_pool.num_free_blocks

    def allocate_slots(self, request: Request, num_new_tokens: int) -> list[int] | None:
        """Makes room for num_new_tokens more tokens; returns the ids of the blocks
        added, or None (and changes nothing) when too few blocks are free."""
        blocks = self.req_to_blocks.setdefault(request.request_id, [])
        num_needed = cdiv(request.num_computed_tokens + num_new_tokens, self.block_size)
        num_new_blocks = num_needed - len(blocks)
        if num_new_blocks <= 0:
            return []
        if num_new_blocks > self.block_pool.num_free_blocks:
            return None
        new_blocks = self.block_pool.allocate(num_new_blocks)
        blocks.extend(new_blocks)
        return [b.block_id for b in new_blocks]

    def block_ids(self, request_id: str) -> list[int]:
        return [b.block_id for b in self.req_to_blocks.get(request_id, [])]

    def free(self, request: Request) -> None:
        """Releases the request's blocks, last block first so that the tail of a
        sequence is the first to be reused."""
        blocks = self.req_to_blocks.pop(request.request_id, [])
        self.block_pool.free(reversed(blocks))
