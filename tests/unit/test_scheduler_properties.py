"""Property tests: random streams of add / abort / step against the engine core
with a fake executor. Whatever happens, the KV cache stays consistent, budgets
hold, every request not aborted finishes with the tokens it would have had
alone, and in the end every block is free."""
from __future__ import annotations

from collections import Counter

from hypothesis import HealthCheck, event, given, settings
from hypothesis import strategies as st

from services.common.config import (CacheConfig, EngineConfig, LoRAConfig, ModelConfig,
                                    SchedulerConfig)
from services.common.lora import LoRARequest
from services.common.errors import InvalidArgument
from services.common.request_types import EngineCoreRequest, FinishReason, SamplingParams
from services.engine_core.engine_core import EngineCore
from services.engine_core.request import RequestStatus
from services.engine_core.scheduler import Scheduler
from tests.unit.fake_executor import FakeExecutor, reference_tokens

BLOCK_SIZE = 4
EOS = 7


def check_invariants(scheduler: Scheduler) -> None:
    kv = scheduler.kv_cache_manager
    pool = kv.block_pool
    owners = Counter()
    for request_id, blocks in kv.req_to_blocks.items():
        assert len(set(map(id, blocks))) == len(blocks), f"{request_id} holds a block twice"
        owners.update(b.block_id for b in blocks)
    free = list(pool.free_queue)
    assert len(free) == len(set(map(id, free))) == pool.num_free_blocks
    for block in pool.blocks:
        assert block.ref_cnt == owners[block.block_id], f"block {block.block_id} ref count"
        assert (block.ref_cnt == 0) == (block in free)
    for block_hash, block in pool.cached_blocks.items():
        assert block.block_hash == block_hash
    for request in scheduler.running:
        assert len(kv.req_to_blocks[request.request_id]) * BLOCK_SIZE >= request.num_computed_tokens
    assert scheduler.num_preempted == sum(r.status is RequestStatus.PREEMPTED
                                          for r in scheduler.waiting)


_add = st.tuples(st.just("add"), st.integers(1, 30), st.integers(1, 40), st.integers(0, 3),
                st.integers(0, 2), st.integers(0, 3))  # the last: LoRA adapter id (0: none)
operations = st.lists(st.one_of(
    _add, _add, _add,  # weighted: enough requests to run out of blocks
    st.tuples(st.just("abort"), st.integers(0, 50)),
    st.tuples(st.just("step"), st.integers(1, 6)),
), min_size=8, max_size=80)


@settings(max_examples=400, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(ops=operations, num_blocks=st.integers(10, 24), budget=st.integers(4, 48),
       max_seqs=st.integers(2, 8), policy=st.sampled_from(["fcfs", "priority"]),
       prefix_caching=st.booleans(), max_loras=st.integers(1, 2),
       async_scheduling=st.booleans())
def test_random_add_abort_step(ops, num_blocks, budget, max_seqs, policy, prefix_caching,
                               max_loras, async_scheduling):
    max_model_len = num_blocks * BLOCK_SIZE // 2
    config = EngineConfig(
        model=ModelConfig(model="fake", max_model_len=max_model_len),
        cache=CacheConfig(block_size=BLOCK_SIZE, enable_prefix_caching=prefix_caching),
        scheduler=SchedulerConfig(max_num_seqs=max_seqs, max_num_batched_tokens=budget,
                                  policy=policy, async_scheduling=async_scheduling),
        lora=LoRAConfig(enable_lora=True, max_loras=max_loras))
    core = EngineCore(config, FakeExecutor(num_blocks, BLOCK_SIZE))
    scheduler = core.scheduler
    execute_model = core.executor.execute_model

    def checked_execute_model(so):
        assert so.total_num_scheduled_tokens <= budget
        assert len(so.num_scheduled_tokens) <= max_seqs
        return execute_model(so)
    core.executor.execute_model = checked_execute_model
    prefixes = [[(11 * p + i) % 100 + 10 for i in range(12)] for p in range(4)]
    added, aborted, produced, finish = [], set(), {}, {}

    def step():
        # With async scheduling each step is scheduled before the last one's
        # tokens are back: in-flight placeholders, preemption of a request whose
        # step is in flight, an extra step after EOS.
        for output in core.step():
            produced.setdefault(output.request_id, []).extend(output.new_token_ids)
            if output.finished:
                finish[output.request_id] = output.finish_reason
        check_invariants(scheduler)

    for op in ops:
        if op[0] == "add":
            _, length, max_tokens, prefix, priority, lora_id = op
            # Prompts share one of four 12-token prefixes (3 blocks), then differ.
            prompt = (prefixes[prefix] + [len(added) + 200] * length)[:length + 2]
            request = EngineCoreRequest(f"r{len(added)}", prompt,
                                        SamplingParams(max_tokens=max_tokens), [EOS],
                                        priority=priority, lora_request=LoRARequest(
                                            f"a{lora_id}", lora_id, f"/a{lora_id}")
                                        if lora_id else None)
            try:
                core.add_request(request)
            except InvalidArgument:
                assert len(prompt) >= max_model_len
                continue
            added.append(request)
        elif op[0] == "abort" and added:
            request_id = added[op[1] % len(added)].request_id
            for output in core.abort_requests([request_id]):
                aborted.add(output.request_id)
                finish[output.request_id] = output.finish_reason
            check_invariants(scheduler)
        elif op[0] == "step":
            for _ in range(op[1]):
                step()

    for _ in range(10_000):
        if not core.has_work():
            break
        step()
    assert not core.has_work(), "requests never finished"
    assert all(len(loras) <= max_loras for loras in core.executor.step_loras)
    event(f"preempted: {scheduler.num_preemptions > 0}")
    event(f"prefix cache hits: {scheduler.kv_cache_manager.prefix_cache_stats.hits > 0}")
    event(f"aborted: {bool(aborted)}")
    pool = scheduler.kv_cache_manager.block_pool
    assert pool.num_free_blocks == num_blocks
    assert all(block.ref_cnt == 0 for block in pool.blocks)
    assert core.executor.requests == {}, "the worker was not told every request finished"
    for request in added:
        if request.request_id in aborted:
            assert finish[request.request_id] is FinishReason.ABORT
            continue
        expected = reference_tokens(request.prompt_token_ids, request.sampling_params.max_tokens,
                                    {EOS}, max_model_len)
        assert produced[request.request_id] == expected
        assert finish[request.request_id] in (FinishReason.STOP, FinishReason.LENGTH)
