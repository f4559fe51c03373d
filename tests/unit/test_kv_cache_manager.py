import subprocess
import sys

from services.common.request_types import SamplingParams
from services.engine_core.kv_cache_manager import KVCacheManager
from services.engine_core.kv_cache_utils import ROOT_HASH, hash_block_tokens, hash_full_blocks
from services.engine_core.request import Request

BS = 4


def make_request(rid, tokens):
    return Request(rid, list(tokens), SamplingParams())


def admit(kv, request, num_new=None):
    """What the scheduler does for a waiting request."""
    blocks, num_cached = kv.get_computed_blocks(request)
    num_new = request.num_tokens - num_cached if num_new is None else num_new
    assert kv.allocate_slots(request, num_new, blocks) is not None
    request.num_computed_tokens = num_cached + num_new
    return num_cached


def test_block_hash_is_chained_and_stable_across_processes():
    h1 = hash_block_tokens(ROOT_HASH, [1, 2, 3, 4])
    assert h1 != hash_block_tokens(ROOT_HASH, [1, 2, 3, 5])
    assert hash_block_tokens(h1, [5, 6, 7, 8]) != hash_block_tokens(ROOT_HASH, [5, 6, 7, 8])
    assert hash_block_tokens(ROOT_HASH, [1, 2, 3, 4], ("lora", 1)) != h1
    code = ("from services.engine_core.kv_cache_utils import *;"
            "print(hash_block_tokens(ROOT_HASH, [1, 2, 3, 4]).hex())")
    other = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True,
                           env={"PYTHONHASHSEED": "123", "PATH": ""}, check=True).stdout.strip()
    assert other == h1.hex()
    assert hash_full_blocks(list(range(10)), BS, []) == [
        h := hash_block_tokens(ROOT_HASH, [0, 1, 2, 3]), hash_block_tokens(h, [4, 5, 6, 7])]


def test_shared_prefix_is_reused_and_freed_by_the_last_owner():
    kv = KVCacheManager(num_blocks=16, block_size=BS)
    prefix = list(range(100, 112))  # 3 full blocks
    a = make_request("a", prefix + [1, 2])
    assert admit(kv, a) == 0
    b = make_request("b", prefix + [3, 4, 5])
    assert admit(kv, b) == 12
    shared = kv.req_to_blocks["a"][:3]
    assert kv.req_to_blocks["b"][:3] == shared
    assert all(blk.ref_cnt == 2 for blk in shared)
    kv.free(a)
    assert all(blk.ref_cnt == 1 for blk in shared) and kv.num_free_blocks == 16 - 4  # b holds 4
    kv.free(b)
    assert kv.num_free_blocks == 16
    # Still cached after everyone let go: a third request hits without recompute.
    c = make_request("c", prefix + [9])
    assert admit(kv, c) == 12
    assert kv.prefix_cache_stats.queries == 0  # only the scheduler records lookups


def test_last_prompt_token_is_always_computed():
    kv = KVCacheManager(num_blocks=8, block_size=BS)
    tokens = list(range(8))  # exactly 2 blocks
    admit(kv, make_request("a", tokens))
    blocks, num_cached = kv.get_computed_blocks(make_request("b", tokens))
    assert num_cached == 4 and len(blocks) == 1


def test_lru_eviction_evicts_the_least_recently_freed_cached_block():
    kv = KVCacheManager(num_blocks=4, block_size=BS)
    old, new = make_request("old", range(0, 5)), make_request("new", range(50, 55))
    admit(kv, old)
    kv.free(old)  # its full block is cached, free
    admit(kv, new)
    kv.free(new)
    # Take 3 blocks: the free queue holds [never used..., old's, new's] in that order.
    admit(kv, make_request("filler", range(200, 212)))
    assert kv.get_computed_blocks(make_request("x", range(0, 5)))[1] == 0  # evicted
    assert kv.get_computed_blocks(make_request("y", range(50, 55)))[1] == 4  # still cached


def test_reset_prefix_cache_only_when_idle():
    kv = KVCacheManager(num_blocks=8, block_size=BS)
    a = make_request("a", range(9))
    admit(kv, a)
    assert not kv.reset_prefix_cache()
    kv.free(a)
    assert kv.reset_prefix_cache()
    assert kv.get_computed_blocks(make_request("b", range(9)))[1] == 0


def test_prefix_caching_off_never_hits():
    kv = KVCacheManager(num_blocks=8, block_size=BS, enable_prefix_caching=False)
    admit(kv, make_request("a", range(9)))
    assert kv.get_computed_blocks(make_request("b", range(9))) == ([], 0)


def _decode_round_robin(kv, requests, steps):
    for _ in range(steps):
        for request in requests:
            assert kv.allocate_slots(request, 1) is not None
            request.num_computed_tokens += 1
            request.append_output_token(5)


def test_without_prefix_caching_each_request_grows_into_the_blocks_after_its_prompt():
    """Four prompts of 2 blocks admitted together, then decoding in turns: each
    request's blocks are one run (room set aside up to its max_tokens), so decode
    attention streams them; without it they interleave (0-1, 8, 12, ...)."""
    kv = KVCacheManager(40, BS, enable_prefix_caching=False)
    requests = [Request(f"r{i}", list(range(10 * i, 10 * i + 8)), SamplingParams(max_tokens=12))
                for i in range(4)]
    for request in requests:
        admit(kv, request)
    _decode_round_robin(kv, requests, 12)
    for i, request in enumerate(requests):
        assert kv.block_ids(request.request_id) == list(range(5 * i, 5 * i + 5))
    for request in requests:
        kv.free(request)
    assert kv.num_free_blocks == 40


def test_with_prefix_caching_admission_leaves_the_eviction_order_alone():
    kv = KVCacheManager(40, BS, enable_prefix_caching=True)
    requests = [Request(f"r{i}", list(range(10 * i, 10 * i + 8)), SamplingParams(max_tokens=12))
                for i in range(2)]
    for request in requests:
        admit(kv, request)
    assert [b.block_id for b in kv.block_pool.free_queue] == list(range(4, 40))
    _decode_round_robin(kv, requests, 4)  # each takes the block after its last if free
    assert kv.block_ids("r0") == [0, 1, 4] and kv.block_ids("r1") == [2, 3, 5]
