"""LocalStack's start: every service at once, each given the address of the next.
When one cannot start, start() names it and its log, and stops the others."""
import pytest

from llmserve.launcher import LocalStack
from services.common.config import CacheConfig, EngineConfig, ModelConfig

pytestmark = pytest.mark.e2e


def test_a_service_failing_at_start_is_named_and_nothing_is_left_running(model_dir, tmp_path):
    # A KV cache too small for max_model_len: the engine core refuses it once the
    # worker has loaded the model and counted its blocks.
    config = EngineConfig(model=ModelConfig(model=model_dir, dtype="float32",
                                            max_model_len=2048),
                          cache=CacheConfig(kv_cache_bytes=16 << 20))
    stack = LocalStack(config, port=0, log_dir=str(tmp_path))
    with pytest.raises(RuntimeError, match="engine-core exited with code 1 before serving") as err:
        stack.start(timeout_s=120)
    assert str(tmp_path / "engine-core.log") in str(err.value)
    assert "fewer than max_model_len 2048" in (tmp_path / "engine-core.log").read_text()
    # All three were started together, before the engine core could fail; all ended.
    assert [s.name for s in stack.services] == ["worker", "engine-core", "frontend"]
    assert all(s.process.poll() is not None for s in stack.services)
