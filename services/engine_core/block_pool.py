"""BlockPool: owns every KV cache block, with ref counts and an O(1) LRU free queue."""
from __future__ import annotations

from dataclasses import dataclass
from typing import Iterable, Optional


@dataclass(eq=False)
class KVCacheBlock:
    block_id: int
    ref_cnt: int = 0
    # Links of the free queue; both None while the block is not in it.
    prev_free: Optional["KVCacheBlock"] = None
    next_free: Optional["KVCacheBlock"] = None


class FreeKVCacheBlockQueue:
    """Doubly linked list of free blocks: allocate from the head, free to the tail.

    NOTE: remove() takes any block out in O(1), which a deque cannot do; prefix
    caching needs it to revive a free block that still holds cached KV.
    """

    def __init__(self, blocks: list[KVCacheBlock]):
        self._head = KVCacheBlock(-1)  # sentinels: no None checks at the ends
        self._tail = KVCacheBlock(-1)
        self._head.next_free, self._tail.prev_free = self._tail, self._head
        self.num_free_blocks = 0
        for block in blocks:
            self.append(block)

    def popleft(self) -> KVCacheBlock:
        block = self._head.next_free
        if block is self._tail:
            raise ValueError("no free blocks")
        self.remove(block)
        return block

    def remove(self, block: KVCacheBlock) -> None:
        if block.prev_free is None or block.next_free is None:
            raise ValueError(f"block {block.block_id} is not in the free queue")
        block.prev_free.next_free = block.next_free
        block.next_free.prev_free = block.prev_free
        block.prev_free = block.next_free = None
        self.num_free_blocks -= 1

    def append(self, block: KVCacheBlock) -> None:
        if block.prev_free is not None or block.next_free is not None:
            raise ValueError(f"block {block.block_id} is already in the free queue")
        last = self._tail.prev_free
        last.next_free, block.prev_free = block, last
        block.next_free, self._tail.prev_free = self._tail, block
        self.num_free_blocks += 1

    def __iter__(self):
        block = self._head.next_free
        while block is not self._tail:
            yield block
            block = block.next_free


class BlockPool:
    """All KV cache blocks of one engine core."""

    def __init__(self, num_blocks: int):
        if num_blocks < 1:
            raise ValueError("the KV cache needs at least one block")
        self.blocks = [KVCacheBlock(i) for i in range(num_blocks)]
        self.free_queue = FreeKVCacheBlockQueue(self.blocks)

    @property
    def num_blocks(self) -> int:
        return len(self.blocks)

    @property
    def num_free_blocks(self) -> int:
        return self.free_queue.num_free_blocks

    def allocate(self, n: int) -> list[KVCacheBlock]:
        if n > self.num_free_blocks:
            raise ValueError(f"cannot allocate {n} blocks, {self.num_free_blocks} free")
        blocks = [self.free_queue.popleft() for _ in range(n)]
        for block in blocks:
            assert block.ref_cnt == 0, f"free block {block.block_id} still referenced"
            block.ref_cnt = 1
        return blocks

    def free(self, blocks: Iterable[KVCacheBlock]) -> None:
        """Drops one reference from each block; a block with none left is free."""
        for block in blocks:
            if block.ref_cnt <= 0:
                raise ValueError(f"block {block.block_id} freed twice")
            block.ref_cnt -= 1
            if block.ref_cnt == 0:
                self.free_queue.append(block)
