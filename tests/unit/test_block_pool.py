import pytest

from services.engine_core.block_pool import BlockPool, FreeKVCacheBlockQueue, KVCacheBlock


def test_free_queue_is_fifo_and_removes_from_the_middle():
    blocks = [KVCacheBlock(i) for i in range(5)]
    queue = FreeKVCacheBlockQueue(blocks)
    queue.remove(blocks[2])
    assert [b.block_id for b in queue] == [0, 1, 3, 4]
    assert queue.popleft() is blocks[0]
    queue.append(blocks[2])
    assert [b.block_id for b in queue] == [1, 3, 4, 2]
    assert queue.num_free_blocks == 4
    with pytest.raises(ValueError):
        queue.append(blocks[3])  # already queued
    with pytest.raises(ValueError):
        queue.remove(blocks[0])  # not queued


def test_pool_refcounts_and_double_free():
    pool = BlockPool(4)
    a, b = pool.allocate(2)
    assert pool.num_free_blocks == 2 and a.ref_cnt == b.ref_cnt == 1
    with pytest.raises(ValueError):
        pool.allocate(3)
    pool.free([b, a])
    assert pool.num_free_blocks == 4
    # Freed blocks go to the tail: the never-used ones come out first.
    assert [blk.block_id for blk in pool.allocate(2)] == [2, 3]
    with pytest.raises(ValueError, match="freed twice"):
        pool.free([a])


def test_a_sequence_grows_into_the_block_after_its_last_when_that_one_is_free_and_uncached():
    """Decode attention reads a sequence's blocks in order: one run streams."""
    pool = BlockPool(8)
    first = pool.allocate(2)  # 0, 1
    other = pool.allocate(1)  # 2: the block after `first` is taken
    assert [b.block_id for b in pool.allocate(2, after=first[-1])] == [3, 4]
    pool.free(other)
    pool.cache_block(other[0], b"cached")  # free, but its KV may be hit: left alone
    assert [b.block_id for b in pool.allocate(1, after=first[-1])] == [5]
    assert [b.block_id for b in pool.allocate(1, after=pool.blocks[6])] == [7]
    assert [b.block_id for b in pool.allocate(1, after=pool.blocks[7])] == [6]  # the last: head


def test_blocks_set_aside_after_a_sequence_are_taken_last_by_others():
    pool = BlockPool(10)
    head = pool.allocate(2)  # 0, 1
    pool.set_aside_after(head[-1], 3)  # 2, 3, 4 to the back of the queue
    assert [b.block_id for b in pool.free_queue] == [5, 6, 7, 8, 9, 2, 3, 4]
    assert [b.block_id for b in pool.allocate(1)] == [5]
    assert [b.block_id for b in pool.allocate(3, after=head[-1])] == [2, 3, 4]
    taken = pool.allocate(1)  # 6
    pool.set_aside_after(pool.blocks[5], 4)  # stops at 6, which is held
    assert [b.block_id for b in pool.free_queue] == [7, 8, 9]
    pool.free(taken)
    pool.cache_block(taken[0], b"cached")
    pool.set_aside_after(pool.blocks[5], 4)  # stops at 6, free but cached
    assert [b.block_id for b in pool.free_queue] == [7, 8, 9, 6]
