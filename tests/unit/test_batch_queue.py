"""Pipeline parallelism in the engine core (fake workers): the batch queue keeps up to
P batches in flight, a request is in one of them at a time, the first stage gets
the tokens only the last one saw from the scheduler, and aborts, preemption and
stop tokens stay right with several batches in flight. Also the layer partition
and the stages' ranks."""
import collections

import pytest

from services.common.config import (CacheConfig, EngineConfig, ModelConfig, ParallelConfig,
                                    SchedulerConfig)
from services.common.request_types import EngineCoreRequest, FinishReason, SamplingParams
from services.common.scheduler_output import ModelRunnerOutput, SchedulerOutput
from services.engine_core.engine_core import EngineCore
from services.engine_core.executor import PendingStep
from services.worker.pipeline import PipelineStage, partition_layers
from tests.unit.fake_executor import FakeExecutor, next_token, reference_tokens, run_to_end

BLOCK_SIZE = 4


class PipelineFakeExecutor(FakeExecutor):
    """Fake workers as a pipeline's: a step runs only when its output is waited for
    (all steps sent before it first, in order), and no worker keeps what it samples:
    the scheduler sends it back as new_token_ids. A request scheduled while its
    token is in flight would lack it ("scheduled tokens the worker does not have")."""

    def __init__(self, num_blocks: int, block_size: int):
        super().__init__(num_blocks, block_size)
        self.queue: collections.deque = collections.deque()  # [so, output or None]
        self.max_in_flight = 0
        self.prompt_len: dict[str, int] = {}

    def execute_model_async(self, so: SchedulerOutput) -> PendingStep:
        entry = [so, None]
        self.queue.append(entry)
        self.max_in_flight = max(self.max_in_flight, len(self.queue))
        return PendingStep(lambda: self._run_until(entry))

    def _run_until(self, entry) -> ModelRunnerOutput:
        while entry[1] is None:
            head = self.queue.popleft()
            head[1] = self._execute(head[0])
        return entry[1]

    def _execute(self, so: SchedulerOutput) -> ModelRunnerOutput:
        for new in so.new_requests:
            self.prompt_len[new.request_id] = new.num_prompt_tokens
        for cached in so.cached_requests:  # what the last stage sampled, from the scheduler
            state = self.requests[cached.request_id]
            start = max(cached.num_computed_tokens, self.prompt_len[cached.request_id])
            state["tokens"][start:] = cached.new_token_ids
        output = super().execute_model(so)
        for request_id in output.sampled_token_ids:  # no stage keeps it
            self.requests[request_id]["tokens"].pop()
        return output


def make_core(stages=2, num_blocks=64, max_model_len=64, budget=64) -> EngineCore:
    config = EngineConfig(model=ModelConfig(model="fake", max_model_len=max_model_len),
                          cache=CacheConfig(block_size=BLOCK_SIZE),
                          scheduler=SchedulerConfig(max_num_batched_tokens=budget),
                          parallel=ParallelConfig(pipeline_parallel_size=stages))
    return EngineCore(config, PipelineFakeExecutor(num_blocks, BLOCK_SIZE))


def add(core: EngineCore, n: int, max_tokens: int = 12, prompt_len: int = 5) -> dict:
    prompts = {f"r{i}": [7 + i + j for j in range(prompt_len)] for i in range(n)}
    for request_id, prompt in prompts.items():
        core.add_request(EngineCoreRequest(request_id, prompt,
                                           SamplingParams(max_tokens=max_tokens)))
    return prompts


def assert_all_free(core: EngineCore, num_blocks: int = 64) -> None:
    assert core.scheduler.kv_cache_manager.num_free_blocks == num_blocks
    assert not core.scheduler.waiting and not core.scheduler.running


@pytest.mark.parametrize("stages", [2, 3])
def test_batches_fill_the_pipeline_and_tokens_equal_one_stage(stages):
    core = make_core(stages)
    depths = []
    core.on_step_sent = depths.append
    prompts = add(core, 8)
    tokens, reasons = run_to_end(core)
    for request_id, prompt in prompts.items():
        assert tokens[request_id] == reference_tokens(prompt, 12, set(), 64)
        assert reasons[request_id] is FinishReason.LENGTH
    assert core.executor.max_in_flight == stages == max(depths)
    assert core.queue_depth() == stages
    assert_all_free(core)


def test_each_batch_takes_a_share_of_the_requests():
    core = make_core(2)
    add(core, 6)
    sizes = []
    core.executor_execute = core.executor.execute_model_async
    core.executor.execute_model_async = lambda so: (
        sizes.append(len(so.num_scheduled_tokens)), core.executor_execute(so))[1]
    run_to_end(core)
    assert max(sizes) == 3  # ceil(6 / 2): two batches of three alternate
    assert sizes[2:6] == [3, 3, 3, 3]


def test_aborts_while_batches_are_in_flight():
    core = make_core(2)
    prompts = add(core, 6, max_tokens=20)

    aborted = []

    def abort_two(c):
        if c.num_steps == 5 and not aborted:
            assert len(c._in_flight) == 1  # and the step just sent is in flight too
            aborted.extend(c.abort_requests(["r1", "r4"]))
    tokens, reasons = run_to_end(core, abort_two)
    assert [(o.request_id, o.finish_reason) for o in aborted] == [
        ("r1", FinishReason.ABORT), ("r4", FinishReason.ABORT)]
    assert "r1" not in reasons and "r4" not in reasons
    for request_id in set(prompts) - {"r1", "r4"}:
        assert tokens[request_id] == reference_tokens(prompts[request_id], 20, set(), 64)
    assert_all_free(core)


def test_preemption_with_batches_in_flight_recomputes_the_same_tokens():
    # 16 blocks of 4 tokens for 6 requests growing to 5 + 24 tokens: some must wait.
    core = make_core(2, num_blocks=16, max_model_len=64)
    prompts = add(core, 6, max_tokens=24)
    tokens, _ = run_to_end(core)
    assert core.scheduler.num_preemptions > 0
    for request_id, prompt in prompts.items():
        assert tokens[request_id] == reference_tokens(prompt, 24, set(), 64)
    assert_all_free(core, 16)


def test_a_stop_token_ends_a_request_with_another_batch_in_flight():
    core = make_core(2)
    prompts = add(core, 4)
    stop = reference_tokens(prompts["r2"], 12, set(), 64)[3]
    core.add_request(EngineCoreRequest("s", prompts["r2"], SamplingParams(max_tokens=12),
                                       [stop]))
    tokens, reasons = run_to_end(core)
    assert tokens["s"] == reference_tokens(prompts["r2"], 12, {stop}, 64)
    assert reasons["s"] is FinishReason.STOP
    assert_all_free(core)


def test_chunked_prefill_chunks_follow_each_other_through_the_pipeline():
    """A long prompt's chunks may be in consecutive batches (stages run batches in
    order, so each chunk's KV is written before the next reads it)."""
    core = make_core(2, budget=8)
    prompt = list(range(3, 40))
    core.add_request(EngineCoreRequest("long", prompt, SamplingParams(max_tokens=5)))
    tokens, _ = run_to_end(core)
    assert tokens["long"] == reference_tokens(prompt, 5, set(), 64)
    assert core.executor.max_in_flight == 2
    assert_all_free(core)


def test_next_token_of_the_fake_is_what_the_reference_uses():
    assert reference_tokens([1, 2], 1, set(), 64) == [next_token([1, 2])]


@pytest.mark.parametrize("layers, stages, expected", [
    (30, 2, [15, 15]), (30, 4, [7, 8, 8, 7]), (31, 3, [10, 11, 10]), (5, 3, [2, 2, 1]),
    (4, 4, [1, 1, 1, 1])])
def test_partition_follows_vllms_rule(layers, stages, expected):
    assert partition_layers(layers, stages) == expected


def test_an_explicit_partition_is_checked():
    assert partition_layers(30, 3, "12,10,8") == [12, 10, 8]
    for bad in ("12,10", "12,10,9", "30,0,0", "a,b,c"):
        with pytest.raises(ValueError, match="--pp-layer-partition"):
            partition_layers(30, 3, bad)
    with pytest.raises(ValueError, match="each stage needs at least one"):
        partition_layers(2, 3)


def test_stage_ranks_are_stage_major():
    # 3 stages of 2 TP ranks: global rank 3 is TP rank 1 of stage 1.
    stage = PipelineStage.of(3, 2, 3, 30)
    assert (stage.rank, stage.prev_rank, stage.next_rank) == (1, 1, 5)
    assert (stage.start_layer, stage.end_layer) == (10, 20)
    assert stage.owns(10) and stage.owns(19) and not stage.owns(20)
    first, last = PipelineStage.of(0, 2, 3, 30), PipelineStage.of(5, 2, 3, 30)
    assert first.is_first and first.prev_rank is None and first.next_rank == 2
    assert last.is_last and last.next_rank is None and last.prev_rank == 3
