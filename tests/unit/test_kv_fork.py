"""Property test of the KV cache manager's beam forks: random forks, prunes and
appends. Reference counts always equal the holders, a block being written is
held by its writer alone (the shared partial block is copied first, and only
it), nothing is freed twice, and when every sequence is gone every block is free."""
from __future__ import annotations

from collections import Counter

from hypothesis import given, settings
from hypothesis import strategies as st

from services.common.sampling_params import SamplingParams
from services.engine_core.kv_cache_manager import KVCacheManager
from services.engine_core.request import Request

BLOCK_SIZE = 4
NUM_BLOCKS = 64


def check_ref_counts(kv: KVCacheManager) -> None:
    holders = Counter(b.block_id for blocks in kv.req_to_blocks.values() for b in blocks)
    for block in kv.block_pool.blocks:
        assert block.ref_cnt == holders[block.block_id], f"block {block.block_id}"
    assert kv.num_free_blocks == NUM_BLOCKS - len(holders)


def append(kv: KVCacheManager, seq: Request, num_tokens: int, token: int) -> bool:
    """Computes num_tokens more of the sequence; False when the cache is full."""
    for _ in range(num_tokens):
        seq.append_output_token(token)
    copies_before = len(kv.blocks_to_copy)
    blocks_before = [b.block_id for b in kv.req_to_blocks.get(seq.request_id, [])]
    if kv.allocate_slots(seq, num_tokens) is None:
        return False
    blocks = kv.req_to_blocks[seq.request_id]
    start, end = seq.num_computed_tokens, seq.num_computed_tokens + num_tokens
    for pos in range(start, end):  # every block written is held by this sequence alone
        assert blocks[pos // BLOCK_SIZE].ref_cnt == 1
    copied = kv.take_blocks_to_copy()[copies_before:] if kv.blocks_to_copy else []
    if copied:  # only the partial block it writes first is replaced, by its copy
        (src, dst), = copied
        index = start // BLOCK_SIZE
        assert start % BLOCK_SIZE and blocks_before[index] == src and blocks[index].block_id == dst
        assert [b.block_id for b in blocks[:index]] == blocks_before[:index]
    seq.num_computed_tokens = end
    return True


ops = st.lists(st.tuples(st.sampled_from(["fork", "fork", "prune", "append"]),
                         st.integers(0, 1000), st.integers(1, 6)), max_size=60)


@settings(max_examples=300, deadline=None)
@given(ops=ops, prompt_len=st.integers(1, 13), prefix_caching=st.booleans())
def test_random_forks_prunes_and_appends_keep_ref_counts(ops, prompt_len, prefix_caching):
    kv = KVCacheManager(NUM_BLOCKS, BLOCK_SIZE, prefix_caching)
    root = Request("b0", list(range(prompt_len)), SamplingParams(max_tokens=1000))
    assert kv.allocate_slots(root, prompt_len) is not None
    root.num_computed_tokens = prompt_len
    live = [root]
    for i, (op, pick, n) in enumerate(ops):
        if not live:
            break
        seq = live[pick % len(live)]
        if op == "fork":
            child = Request(f"b{i + 1}", seq.prompt_token_ids, seq.sampling_params,
                            output_token_ids=list(seq.output_token_ids),
                            num_computed_tokens=seq.num_computed_tokens,
                            block_hashes=list(seq.block_hashes))
            kv.fork(seq, child)
            live.append(child)
        elif op == "prune":
            kv.free(seq)
            live.remove(seq)
        elif not append(kv, seq, n, token=i % 50):
            kv.free(seq)  # as a preemption would
            live.remove(seq)
        check_ref_counts(kv)
    for seq in live:
        kv.free(seq)
    check_ref_counts(kv)
    assert kv.num_free_blocks == NUM_BLOCKS
