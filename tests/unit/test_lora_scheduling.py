"""The scheduler and LoRA: no step runs more adapters than max_loras, a request
waiting for an adapter slot lets the ones behind it through, and adapters are
loaded into the workers before their first request (fake executor)."""
from services.common.config import CacheConfig, EngineConfig, LoRAConfig, ModelConfig
from services.common.lora import LoRARequest
from services.common.request_types import EngineCoreRequest, SamplingParams
from services.engine_core.engine_core import EngineCore
from tests.unit.fake_executor import FakeExecutor

A, B = LoRARequest("a", 1, "/adapters/a"), LoRARequest("b", 2, "/adapters/b")


def test_a_request_waiting_for_an_adapter_slot_lets_the_next_ones_through():
    config = EngineConfig(model=ModelConfig(model="fake", max_model_len=64),
                          cache=CacheConfig(block_size=4),
                          lora=LoRAConfig(enable_lora=True, max_loras=1))
    core = EngineCore(config, FakeExecutor(num_blocks=64, block_size=4))
    for i, lora in enumerate([A, B, A, None]):
        core.add_request(EngineCoreRequest(f"r{i}", [10 + i, 11, 12],
                                           SamplingParams(max_tokens=3), lora_request=lora))
    assert core.executor.loras == {1: "/adapters/a", 2: "/adapters/b"}
    first = core.scheduler.schedule()
    assert set(first.num_scheduled_tokens) == {"r0", "r2", "r3"}  # r1 (adapter b) waits
    assert [r.request_id for r in core.scheduler.waiting] == ["r1"]
    core.scheduler.update_from_output(first, core.executor.execute_model(first))
    finished = set()
    while core.has_work():
        finished |= {o.request_id for o in core.step() if o.finished}
    assert finished == {"r0", "r1", "r2", "r3"}
    assert all(len(step) <= 1 for step in core.executor.step_loras)
    assert core.stats().num_used_kv_blocks == 0
