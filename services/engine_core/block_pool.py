"""BlockPool: owns every KV cache block, its ref count and its prefix-cache hash."""
from __future__ import annotations

from typing import Iterable

from services.engine_core.kv_cache_utils import BlockHash, FreeKVCacheBlockQueue, KVCacheBlock


class BlockPool:
    def __init__(self, num_blocks: int):
        if num_blocks < 1:
            raise ValueError("the KV cache needs at least one block")
        self.blocks = [KVCacheBlock(i) for i in range(num_blocks)]
        self.free_queue = FreeKVCacheBlockQueue(self.blocks)
        # NOTE: maps each hash to one block; a block is in here iff its
        # block_hash is set, whether it is in use or free.
        self.cached_blocks: dict[BlockHash, KVCacheBlock] = {}

    @property
    def num_blocks(self) -> int:
        return len(self.blocks)

    @property
    def num_free_blocks(self) -> int:
        """Blocks no request holds, cached ones included (they can be evicted)."""
        return self.free_queue.num_free_blocks

    def allocate(self, n: int, after: KVCacheBlock | None = None) -> list[KVCacheBlock]:
        """n fresh blocks with ref count 1, evicting the least recently freed. Given
        `after` (a sequence's last block), each is the block that follows the one
        before in memory where that one is free and holds no cached KV: a decode
        step's attention reads a sequence's blocks in order, and blocks in one run
        stream from memory; scattered ones each start a new page."""
        if n > self.num_free_blocks:
            raise ValueError(f"cannot allocate {n} blocks, {self.num_free_blocks} free")
        blocks = []
        for _ in range(n):
            block = self._free_block_after(after) or self.free_queue.popleft()
            assert block.ref_cnt == 0, f"free block {block.block_id} still referenced"
            self._evict(block)
            block.ref_cnt = 1
            blocks.append(block)
            after = block
        return blocks

    def set_aside_after(self, block: KVCacheBlock, n: int) -> None:
        """Moves the up to n free, uncached blocks that follow `block` in memory to
        the back of the free queue, so that other requests take them last: room for
        the sequence that ends at `block` to grow into (allocate's `after`)."""
        for block_id in range(block.block_id + 1, min(block.block_id + 1 + n, self.num_blocks)):
            follower = self.blocks[block_id]
            if follower.ref_cnt or follower.block_hash is not None:
                return
            self.free_queue.remove(follower)
            self.free_queue.append(follower)

    def _free_block_after(self, block: KVCacheBlock | None) -> KVCacheBlock | None:
        if block is None or block.block_id + 1 >= self.num_blocks:
            return None
        follower = self.blocks[block.block_id + 1]
        if follower.ref_cnt or follower.block_hash is not None:
            return None
        self.free_queue.remove(follower)
        return follower

    def touch(self, blocks: Iterable[KVCacheBlock]) -> None:
        """Takes one more reference to each (cache-hit) block, reviving free ones."""
        for block in blocks:
            if block.ref_cnt == 0:
                self.free_queue.remove(block)
            block.ref_cnt += 1

    def free(self, blocks: Iterable[KVCacheBlock]) -> None:
        """Drops one reference from each block; a block with none left is free,
        at the tail of the queue, its cached KV still reusable until evicted."""
        for block in blocks:
            if block.ref_cnt <= 0:
                raise ValueError(f"block {block.block_id} freed twice")
            block.ref_cnt -= 1
            if block.ref_cnt == 0:
                self.free_queue.append(block)

    def get_cached_block(self, block_hash: BlockHash) -> KVCacheBlock | None:
        return self.cached_blocks.get(block_hash)

    def cache_block(self, block: KVCacheBlock, block_hash: BlockHash) -> None:
        """Registers a block that now holds a full block of KV under its hash."""
        if block.block_hash is not None or block_hash in self.cached_blocks:
            # Already registered, or the same content is cached in another block
            # (two requests computed it in the same step): keep the first.
            return
        block.block_hash = block_hash
        self.cached_blocks[block_hash] = block

    def uncache(self, block: KVCacheBlock) -> None:
        """Forgets a block's hash (its KV will not be what the hash says)."""
        if block.block_hash is not None:
            self._evict(block)

    def reset_prefix_cache(self) -> bool:
        """Forgets every cached hash; only possible while no request holds a block."""
        if self.num_free_blocks != self.num_blocks:
            return False
        for block in self.cached_blocks.values():
            block.block_hash = None
        self.cached_blocks.clear()
        return True

    def _evict(self, block: KVCacheBlock) -> None:
        if block.block_hash is not None:
            del self.cached_blocks[block.block_hash]
            block.block_hash = None
