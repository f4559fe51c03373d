"""A worker killed with SIGKILL mid-stream costs a pause, not a request: the
launcher starts it again, the engine core reloads it and recomputes every
request, and each stream goes on with exactly the tokens an undisturbed run
gives (greedy and seeded)."""
import signal
import threading
import time

import grpc
import pytest

from llmserve.client import Client
from llmserve.launcher import LocalStack
from services.common.config import CacheConfig, EngineConfig, ModelConfig
from tests.e2e.conftest import wait_all_blocks_free

pytestmark = pytest.mark.e2e
MAX_TOKENS = 40


def requests_to_send() -> list[dict]:
    greedy = [{"token_ids": [1000 + 97 * i + j for j in range(12 + i)], "temperature": 0}
              for i in range(6)]
    seeded = [{"token_ids": [3000 + j for j in range(9)], "temperature": 1.0, "seed": s}
              for s in (5, 6)]
    return greedy + seeded


def run_streams(address: str, kill_when_started=None) -> list[list[int]]:
    """All requests at once; each stream's tokens. kill_when_started runs once
    every stream has its first few tokens."""
    sent = requests_to_send()
    tokens: list[list[int]] = [[] for _ in sent]
    errors: list[grpc.RpcError] = []
    started = threading.Barrier(len(sent) + 1)

    def stream(i: int) -> None:
        try:
            with Client(address) as client:
                for response in client.generate(max_tokens=MAX_TOKENS, ignore_eos=True,
                                                timeout=300, **sent[i]):
                    tokens[i] += response.token_ids
                    if len(tokens[i]) == 5:
                        started.wait(timeout=120)
        except grpc.RpcError as e:
            errors.append(e)
            started.abort()

    threads = [threading.Thread(target=stream, args=(i,)) for i in range(len(sent))]
    for thread in threads:
        thread.start()
    started.wait(timeout=120)
    if kill_when_started is not None:
        kill_when_started()
    for thread in threads:
        thread.join(timeout=300)
    assert not errors, [(e.code(), e.details()) for e in errors]
    return tokens


def test_a_killed_worker_costs_a_pause_not_a_request(model_dir, tmp_path):
    config = EngineConfig(model=ModelConfig(model=model_dir, dtype="float32"),
                          cache=CacheConfig(kv_cache_bytes=160 << 20))
    with LocalStack(config, port=0, log_dir=str(tmp_path), restart_dead=True) as stack:
        address = stack.start(timeout_s=180)
        undisturbed = run_streams(address)
        worker = next(s for s in stack.services if s.name == "worker")
        first_pid = worker.process.pid
        disturbed = run_streams(address, lambda: worker.process.send_signal(signal.SIGKILL))
        assert worker.process.pid != first_pid  # it was started again
        assert all(len(t) == MAX_TOKENS for t in disturbed)
        assert disturbed == undisturbed
        wait_all_blocks_free(stack)
        engine_log = (tmp_path / "engine-core.log").read_text()
        assert "workers recovered: 8 requests resume by recomputation" in engine_log
