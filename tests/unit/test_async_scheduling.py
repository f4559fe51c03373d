"""Async scheduling: the engine core schedules and sends step N + 1 before step
N's output is back (fake executor), and the worker runs steps in the order they
came on its stream, on its main thread."""
import asyncio
import threading
import time

import pytest

from services.common.config import CacheConfig, EngineConfig, ModelConfig, SchedulerConfig
from services.common.errors import FailedPrecondition
from services.common.request_types import EngineCoreRequest, FinishReason, SamplingParams
from services.engine_core.engine_core import EngineCore
from services.engine_core.executor import PendingStep
from services.worker.step_order import StepOrder
from tests.unit.fake_executor import FakeExecutor, next_token, reference_tokens, run_to_end

BLOCK_SIZE = 4


def make_core(num_blocks=64, max_model_len=64, async_scheduling=True) -> EngineCore:
    config = EngineConfig(model=ModelConfig(model="fake", max_model_len=max_model_len),
                          cache=CacheConfig(block_size=BLOCK_SIZE),
                          scheduler=SchedulerConfig(async_scheduling=async_scheduling))
    return EngineCore(config, FakeExecutor(num_blocks, BLOCK_SIZE))


def assert_all_free(core: EngineCore, num_blocks: int) -> None:
    assert core.scheduler.kv_cache_manager.num_free_blocks == num_blocks
    assert core.executor.requests == {}, "the worker was not told every request finished"
    assert not core.scheduler.waiting and not core.scheduler.running


def test_each_step_is_sent_before_the_last_ones_output_is_applied():
    core = make_core()
    updates_at_send = []
    execute, update = core.executor.execute_model, core.scheduler.update_from_output
    num_updates = 0

    def counting_update(*args):
        nonlocal num_updates
        num_updates += 1
        return update(*args)
    core.scheduler.update_from_output = counting_update
    core.executor.execute_model = lambda so: (updates_at_send.append(num_updates), execute(so))[1]
    steps_done = []
    core.on_step_done = lambda seconds, num_tokens: steps_done.append(num_tokens)
    prompts = {f"r{i}": [3 + i, 5, 7 + i] for i in range(3)}
    for request_id, prompt in prompts.items():
        core.add_request(EngineCoreRequest(request_id, prompt, SamplingParams(max_tokens=6)))
    tokens, reasons = run_to_end(core)
    assert steps_done == [9, 3, 3, 3, 3, 3]  # the prefills, then 5 decode steps
    # Step k (from 0) goes out when k - 1 outputs are in: one step always in
    # flight. No step computes past max_tokens: the 7th only tells the worker
    # that the requests finished.
    assert updates_at_send == [0, 0, 1, 2, 3, 4, 6]
    for request_id, prompt in prompts.items():
        assert tokens[request_id] == reference_tokens(prompt, 6, set(), 64)
        assert reasons[request_id] is FinishReason.LENGTH
    assert_all_free(core, 64)


@pytest.mark.parametrize("async_scheduling", [True, False])
def test_a_stop_token_ends_a_request_whose_next_step_is_in_flight(async_scheduling):
    core = make_core(async_scheduling=async_scheduling)
    prompt = [1, 2, 3]
    stop = reference_tokens(prompt, 3, set(), 64)[1]  # its second token
    core.add_request(EngineCoreRequest("r", prompt, SamplingParams(max_tokens=10), [stop]))
    tokens, reasons = run_to_end(core)
    assert tokens["r"] == reference_tokens(prompt, 10, {stop}, 64)
    assert reasons["r"] is FinishReason.STOP
    assert_all_free(core, 64)


def test_a_request_id_reused_at_once_does_not_get_the_old_requests_token():
    core = make_core()
    first = [1, 2, 3]
    core.add_request(EngineCoreRequest("r", first, SamplingParams(max_tokens=10),
                                       [next_token(first)]))
    assert core.step() == []  # its prefill is in flight
    [ended] = core.step()  # its extra decode is sent, then the EOS comes back
    assert ended.finished and ended.new_token_ids == [next_token(first)]
    second = [40, 50, 60, 70]
    core.add_request(EngineCoreRequest("r", second, SamplingParams(max_tokens=5)))
    tokens, reasons = run_to_end(core)
    assert tokens["r"] == reference_tokens(second, 5, set(), 64)
    assert_all_free(core, 64)


@pytest.mark.parametrize("async_scheduling", [True, False])
def test_a_step_that_only_drops_finished_requests_is_not_waited_for(async_scheduling):
    """One stream's next request, arriving as the last one ends, is not held for
    the round trip of the step that tells the workers it ended: that step's
    output is read before the next step's, whenever that comes."""
    core = make_core(async_scheduling=async_scheduling)
    sent, read = [], []
    send = core.executor.execute_model_async

    def recording_send(so):
        pending, step = send(so), len(sent)
        sent.append(so)
        return PendingStep(lambda: (read.append(step), pending.result())[1])
    core.executor.execute_model_async = recording_send
    for request_id, prompt in (("a", [1, 2, 3]), ("b", [4, 5, 6, 7])):
        core.add_request(EngineCoreRequest(request_id, prompt, SamplingParams(max_tokens=3)))
        tokens, _ = run_to_end(core)
        assert tokens[request_id] == reference_tokens(prompt, 3, set(), 64)
        drop = sent[-1]
        assert drop.finished_request_ids == [request_id] and not drop.num_scheduled_tokens
        assert not core.has_work() and read[-1] == len(sent) - 2  # sent, not read
    assert read == list(range(len(sent) - 1))  # a's drop step read before b's first
    assert_all_free(core, 64)


def test_a_request_preempted_while_its_step_is_in_flight_can_still_finish():
    # 3 blocks of 4: two 4-token prompts fill two; each needs a second block to
    # decode, so scheduling step 2 preempts B while its prefill is in flight, and
    # the token that prefill samples (a stop token) then ends B in the waiting queue.
    core = make_core(num_blocks=3, max_model_len=12)
    a, b = [1, 2, 3, 4], [5, 6, 7, 8]
    core.add_request(EngineCoreRequest("a", a, SamplingParams(max_tokens=3)))
    core.add_request(EngineCoreRequest("b", b, SamplingParams(max_tokens=3), [next_token(b)]))
    tokens, reasons = run_to_end(core)
    assert core.scheduler.num_preemptions == 1
    assert tokens == {"a": reference_tokens(a, 3, set(), 12), "b": [next_token(b)]}
    assert reasons == {"a": FinishReason.LENGTH, "b": FinishReason.STOP}
    assert core.scheduler.num_preempted == 0
    assert_all_free(core, 3)


def test_the_worker_runs_steps_in_the_order_they_came_and_refuses_stale_ones():
    async def main():
        order, ran = StepOrder(asyncio.to_thread), []
        threads = set()
        release = threading.Event()

        def step(step_id):
            threads.add(threading.get_ident())
            if step_id == 1:
                assert release.wait(timeout=10)
            ran.append(step_id)
            return step_id
        first = order.submit(1, step, 1)
        later = [order.submit(i, step, i) for i in (2, 3, 4)]
        later[1].cancel()  # its call was cut before it ran: it never does
        await asyncio.sleep(0.05)
        await order.reset()  # the engine core set the KV cache up again
        release.set()
        assert await first == 1
        for stale in (later[0], later[2]):
            with pytest.raises(FailedPrecondition, match="step [24] was sent before"):
                await stale
        assert await asyncio.gather(*(order.submit(i, step, i) for i in (5, 6, 7))) == [5, 6, 7]
        assert ran == [1, 5, 6, 7]
        assert threading.get_ident() not in threads  # on the thread of `run`, not the loop's

    asyncio.run(main())


def test_the_worker_takes_a_step_that_arrived_while_the_one_before_ran_without_the_loop():
    """Step 2 arrives while step 1 runs: the drain that ran 1 runs 2 next, while
    the event loop is held up (its thread never gets to hand step 2 over)."""
    async def main():
        order, ran = StepOrder(asyncio.to_thread), []
        step_one_runs, step_two_sent = threading.Event(), threading.Event()

        def step(step_id):
            if step_id == 1:
                step_one_runs.set()
                assert step_two_sent.wait(timeout=10)
            ran.append(step_id)
        first = order.submit(1, step, 1)
        await asyncio.to_thread(step_one_runs.wait)
        second = order.submit(2, step, 2)
        step_two_sent.set()
        deadline = time.monotonic() + 10
        while len(ran) < 2 and time.monotonic() < deadline:  # the loop's thread, held
            time.sleep(0.001)
        assert ran == [1, 2]
        await asyncio.gather(first, second)

    asyncio.run(main())
