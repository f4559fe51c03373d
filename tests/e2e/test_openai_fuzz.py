"""Generated request bodies (schemathesis, from our own OpenAPI document) against
every HTTP endpoint of a real stack: no 5xx, and afterwards the server is healthy
and holds no KV block."""
import subprocess
import sys
from pathlib import Path

import pytest
import requests

from llmserve.launcher import LocalStack
from services.common.config import (CacheConfig, EngineConfig, LoRAConfig, ModelConfig,
                                    SchedulerConfig)
from tests.e2e.conftest import wait_all_blocks_free
from tests.waiting import DEADLINE_S

pytestmark = pytest.mark.e2e


@pytest.fixture(scope="module")
def fuzz_stack(tmp_path_factory, model_dir):
    # Short sequences: every valid generated request finishes within seconds.
    config = EngineConfig(model=ModelConfig(model=model_dir, dtype="float32", max_model_len=24),
                          cache=CacheConfig(kv_cache_bytes=32 << 20),
                          scheduler=SchedulerConfig(max_num_seqs=16),
                          lora=LoRAConfig(enable_lora=True))  # fuzzes the adapter routes too
    with LocalStack(config, port=0, log_dir=str(tmp_path_factory.mktemp("fuzz")),
                    http_port=0) as stack:
        stack.start(timeout_s=240)
        yield stack


def test_generated_bodies_never_get_a_server_error(fuzz_stack, tmp_path):
    """schemathesis' CLI (its pytest plugin predates pytest 9) with the one check
    that matters here: no response is a 5xx. Every operation, every phase
    (examples, boundary values, random bodies), a fixed seed."""
    url = f"http://{fuzz_stack.http_address}/openapi.json"
    cli = Path(sys.executable).parent / "schemathesis"
    result = subprocess.run(
        [str(cli), "run", url, "--checks", "not_a_server_error", "--max-examples", "20",
         "--seed", "1", "--request-timeout", "120", "--report", "ndjson",
         "--report-dir", str(tmp_path)],
        capture_output=True, text=True, timeout=1200, cwd=tmp_path)  # its cache goes there
    assert result.returncode == 0, result.stdout[-4000:]
    summary = result.stdout[result.stdout.rindex("SUMMARY"):]
    assert "Tested: 10" in summary and " passed" in summary, summary


def test_the_server_is_healthy_and_holds_no_kv_block_afterwards(fuzz_stack):
    assert requests.get(f"http://{fuzz_stack.http_address}/health", timeout=10).status_code == 200
    wait_all_blocks_free(fuzz_stack, timeout_s=DEADLINE_S)
