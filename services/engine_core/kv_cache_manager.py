"""KVCacheManager: which blocks each request holds, and prefix-cache lookups."""
from __future__ import annotations

from dataclasses import dataclass

from services.engine_core.block_pool import BlockPool
from services.engine_core.kv_cache_utils import KVCacheBlock, hash_full_blocks
from services.engine_core.request import Request


# The most blocks set aside after a new request's first ones (512 tokens of 16).
MAX_BLOCKS_SET_ASIDE = 32


def cdiv(a: int, b: int) -> int:
    return -(-a // b)


@dataclass
class PrefixCacheStats:
    queries: int = 0  # prompt tokens looked up
    hits: int = 0  # of those, tokens found cached


class KVCacheManager:
    def __init__(self, num_blocks: int, block_size: int, enable_prefix_caching: bool = True):
        self.block_size = block_size
        self.enable_prefix_caching = enable_prefix_caching
        self.block_pool = BlockPool(num_blocks)
        self.req_to_blocks: dict[str, list[KVCacheBlock]] = {}
        # How many leading blocks of each request are registered in the cache.
        self.num_cached_blocks: dict[str, int] = {}
        self.prefix_cache_stats = PrefixCacheStats()
        # (source, destination) block ids copied since the last take_blocks_to_copy().
        self.blocks_to_copy: list[tuple[int, int]] = []

    @property
    def num_blocks(self) -> int:
        return self.block_pool.num_blocks

    @property
    def num_free_blocks(self) -> int:
        return self.block_pool.num_free_blocks

    def get_computed_blocks(self, request: Request) -> tuple[list[KVCacheBlock], int]:
        """The longest chain of cached blocks that prefixes the request, and the
        number of tokens it covers. The last token is always left to compute:
        its logits are needed to sample (or its hidden state, to pool)."""
        if not self.enable_prefix_caching or request.needs_every_prompt_position:
            return [], 0
        hashes = self._block_hashes(request)
        max_blocks = (request.num_tokens - 1) // self.block_size
        hits = []
        for block_hash in hashes[:max_blocks]:
            block = self.block_pool.get_cached_block(block_hash)
            if block is None:
                break
            hits.append(block)
        return hits, len(hits) * self.block_size

    def record_prefix_cache_lookup(self, num_queried: int, num_hit: int) -> None:
        """Counts a lookup whose request was admitted (a failed admission is retried)."""
        if self.enable_prefix_caching:
            self.prefix_cache_stats.queries += num_queried
            self.prefix_cache_stats.hits += num_hit

    def allocate_slots(self, request: Request, num_new_tokens: int,
                       new_computed_blocks: list[KVCacheBlock] = ()) -> list[int] | None:
        """Makes room for num_new_tokens after the request's computed tokens and
        the cache-hit blocks; returns the ids of the freshly allocated blocks, or
        None (changing nothing) when too few blocks are free. A shared partial
        block about to be written (a beam's fork) is first copied (see fork)."""
        blocks = self.req_to_blocks.get(request.request_id, [])
        num_computed = request.num_computed_tokens + len(new_computed_blocks) * self.block_size
        num_needed = cdiv(num_computed + num_new_tokens, self.block_size)
        num_new_blocks = max(0, num_needed - len(blocks) - len(new_computed_blocks))
        shared = self._shared_block_to_write(blocks, num_computed)
        # Cache hits on free blocks take them out of the free queue too.
        num_revived = sum(1 for b in new_computed_blocks if b.ref_cnt == 0)
        if num_new_blocks + (shared is not None) > self.block_pool.num_free_blocks - num_revived:
            return None
        if shared is not None:
            self._copy_on_write(blocks, shared)
        self.block_pool.touch(new_computed_blocks)
        blocks = self.req_to_blocks.setdefault(request.request_id, [])
        first = not blocks
        blocks.extend(new_computed_blocks)
        new_blocks = self.block_pool.allocate(num_new_blocks, blocks[-1] if blocks else None)
        blocks.extend(new_blocks)
        if first and new_blocks and not self.enable_prefix_caching:
            self._set_room_aside(request, len(blocks), new_blocks[-1])
        if self.enable_prefix_caching:
            # Up to the known tokens: an in-flight one (async scheduling) has no
            # hash yet; its block is registered on a later step.
            self._cache_full_blocks(request, blocks,
                                    min(num_computed + num_new_tokens, request.num_tokens))
        return [b.block_id for b in new_blocks]

    def _set_room_aside(self, request: Request, num_blocks: int, last: KVCacheBlock) -> None:
        """Sets the blocks after a new request's first ones aside for its growth, up
        to its max_tokens (at most MAX_BLOCKS_SET_ASIDE). Not with prefix caching:
        there the free queue's order is the eviction order of cached blocks."""
        params = request.sampling_params
        total = request.num_prompt_tokens + ((params.max_tokens or 0) if params else 0)
        room = min(cdiv(total, self.block_size) - num_blocks, MAX_BLOCKS_SET_ASIDE)
        if room > 0:
            self.block_pool.set_aside_after(last, room)

    def fork(self, parent: Request, child: Request) -> None:
        """Beam search: the child starts with every block of its parent, shared by
        reference count, the partial last one included. Full blocks stay shared;
        the partial one is copied when either first writes into it, so that no
        token is recomputed and only that block is duplicated."""
        blocks = self.req_to_blocks.get(parent.request_id, [])
        self.block_pool.touch(blocks)
        self.req_to_blocks[child.request_id] = list(blocks)
        self.num_cached_blocks[child.request_id] = self.num_cached_blocks.get(parent.request_id, 0)

    def take_blocks_to_copy(self) -> list[tuple[int, int]]:
        """The copies the workers must make before the next step's forward."""
        copies, self.blocks_to_copy = self.blocks_to_copy, []
        return copies

    def copied_into(self, request_id: str) -> bool:
        """Whether a copy pending for the next step changed the request's block table."""
        if not self.blocks_to_copy:
            return False
        ids = set(self.block_ids(request_id))
        return any(dst in ids for _, dst in self.blocks_to_copy)

    def _shared_block_to_write(self, blocks: list[KVCacheBlock], num_computed: int) -> int | None:
        """The index of the partial block the next token goes to, if others hold it too."""
        index = num_computed // self.block_size
        if num_computed % self.block_size and index < len(blocks) and blocks[index].ref_cnt > 1:
            return index
        return None

    def _copy_on_write(self, blocks: list[KVCacheBlock], index: int) -> None:
        shared = blocks[index]
        blocks[index] = self.block_pool.allocate(1)[0]
        self.block_pool.free([shared])  # the others keep it
        self.blocks_to_copy.append((shared.block_id, blocks[index].block_id))

    def block_ids(self, request_id: str) -> list[int]:
        return [b.block_id for b in self.req_to_blocks.get(request_id, [])]

    def free(self, request: Request) -> None:
        """Releases the request's blocks, last block first: the tail of a sequence
        is the least likely to be shared, so it is evicted first."""
        blocks = self.req_to_blocks.pop(request.request_id, [])
        self.num_cached_blocks.pop(request.request_id, None)
        # Blocks registered for a step that was then undone (its request preempted
        # while the same schedule() went on) hold no KV: no later request may hit them.
        for block in blocks[request.num_computed_tokens // self.block_size:]:
            if block.ref_cnt == 1:
                self.block_pool.uncache(block)
        if self.blocks_to_copy:  # a copy into a block it no longer holds is moot
            ids = {b.block_id for b in blocks}
            self.blocks_to_copy = [c for c in self.blocks_to_copy if c[1] not in ids]
        self.block_pool.free(reversed(blocks))

    def free_tail(self, request: Request, num_tokens: int) -> None:
        """Frees the request's blocks past its first num_tokens tokens (those that
        held only rejected draft tokens). They were never registered in the prefix
        cache: registration stops at the request's known tokens."""
        blocks = self.req_to_blocks.get(request.request_id, [])
        keep = cdiv(num_tokens, self.block_size)
        if len(blocks) > keep:
            tail = blocks[keep:]
            del blocks[keep:]
            self.block_pool.free(reversed(tail))

    def reset_prefix_cache(self) -> bool:
        return self.block_pool.reset_prefix_cache()

    def _block_hashes(self, request: Request) -> list[bytes]:
        # Blocks computed under an adapter hold other KV than the base model's.
        extra_keys = (request.lora_id,) if request.lora_id else ()
        return hash_full_blocks(request.all_token_ids, self.block_size, request.block_hashes,
                                extra_keys)

    def _cache_full_blocks(self, request: Request, blocks: list[KVCacheBlock],
                           num_tokens: int) -> None:
        """Registers the blocks that this step fills completely."""
        start = self.num_cached_blocks.get(request.request_id, 0)
        end = num_tokens // self.block_size
        if end <= start:
            return
        hashes = self._block_hashes(request)
        for i in range(start, end):
            self.block_pool.cache_block(blocks[i], hashes[i])
        self.num_cached_blocks[request.request_id] = end
