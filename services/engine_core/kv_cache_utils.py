"""KV cache building blocks: the block, the O(1) LRU free queue, the block hash."""
from __future__ import annotations

import hashlib
from array import array
from dataclasses import dataclass
from typing import Optional, Sequence

# A full block's identity in the prefix cache: a chained digest of every token
# up to and including this block.
BlockHash = bytes

# The parent of a sequence's first block.
ROOT_HASH: BlockHash = b""


def hash_block_tokens(parent: BlockHash, token_ids: Sequence[int],
                      extra_keys: tuple = ()) -> BlockHash:
    """H(parent, token_ids, extra_keys) with SHA-256: stable across processes and
    runs, unlike Python's hash(); extra_keys tell apart blocks whose KV differs
    for other reasons than the tokens (e.g. a LoRA adapter)."""
    h = hashlib.sha256(parent)
    h.update(array("q", token_ids).tobytes())
    if extra_keys:
        h.update(repr(extra_keys).encode())
    return h.digest()


def hash_full_blocks(token_ids: Sequence[int], block_size: int, known: list[BlockHash],
                     extra_keys: tuple = ()) -> list[BlockHash]:
    """Extends `known` (the hashes of the first blocks) to every full block of token_ids."""
    for i in range(len(known), len(token_ids) // block_size):
        parent = known[-1] if known else ROOT_HASH
        known.append(hash_block_tokens(parent, token_ids[i * block_size:(i + 1) * block_size],
                                       extra_keys))
    return known


@dataclass(eq=False)
class KVCacheBlock:
    block_id: int
    ref_cnt: int = 0
    # Set while the block holds a full, hashed block of KV (it may be free then:
    # its KV stays reusable until the block is evicted for another use).
    block_hash: Optional[BlockHash] = None
    # Links of the free queue; both None while the block is not in it.
    prev_free: Optional["KVCacheBlock"] = None
    next_free: Optional["KVCacheBlock"] = None


class FreeKVCacheBlockQueue:
    """Doubly linked list of free blocks: allocate from the head, free to the tail,
    so the least recently freed cached block is evicted first (LRU).

    NOTE: remove() takes any block out in O(1), which a deque cannot do; a prefix
    cache hit on a free block revives it that way.
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
