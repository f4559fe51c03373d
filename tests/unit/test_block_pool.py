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
