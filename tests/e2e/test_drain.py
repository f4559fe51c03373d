"""Graceful drain on SIGTERM: the frontend and the engine core refuse new work
(health NOT_SERVING, UNAVAILABLE, HTTP 503) and let the streams in flight finish,
up to --drain-timeout; then they exit."""
import signal
import threading

import grpc
import pytest
import requests
from grpc_health.v1 import health_pb2

from llmserve.client import Client
from llmserve.launcher import LocalStack
from services.common.config import CacheConfig, EngineConfig, ModelConfig
from tests.e2e.conftest import health_status
from tests.waiting import DEADLINE_S, wait_until

pytestmark = pytest.mark.e2e


def start_stack(model_dir, tmp_path, drain_timeout_s: float) -> LocalStack:
    config = EngineConfig(model=ModelConfig(model=model_dir, dtype="float32"),
                          cache=CacheConfig(kv_cache_bytes=160 << 20))
    stack = LocalStack(config, port=0, log_dir=str(tmp_path), http_port=0,
                       drain_timeout_s=drain_timeout_s)
    stack.start(timeout_s=180)
    return stack


def service(stack, name):
    return next(s for s in stack.services if s.name == name)


class Stream(threading.Thread):
    """A streamed request read on a thread; `started` is set at its 5th response."""

    def __init__(self, address: str, max_tokens: int):
        super().__init__(daemon=True)
        self.address, self.max_tokens = address, max_tokens
        self.started, self.tokens, self.error, self.finish_reason = threading.Event(), [], None, None

    def run(self):
        try:
            with Client(self.address) as client:
                for response in client.generate(prompt="Tell a long story.", ignore_eos=True,
                                                max_tokens=self.max_tokens, temperature=0):
                    self.tokens += response.token_ids
                    if response.HasField("finish_reason"):
                        self.finish_reason = response.finish_reason
                    if len(self.tokens) >= 5:
                        self.started.set()
        except grpc.RpcError as e:
            self.error = e.code()
        finally:
            self.started.set()


def test_frontend_drains_then_exits(model_dir, tmp_path):
    stack = start_stack(model_dir, tmp_path, drain_timeout_s=60)
    try:
        frontend = service(stack, "frontend")
        stream = Stream(frontend.address, max_tokens=160)
        stream.start()
        assert stream.started.wait(60) and stream.error is None
        frontend.process.send_signal(signal.SIGTERM)
        wait_until(lambda: health_status(frontend.address)
                   == health_pb2.HealthCheckResponse.NOT_SERVING, "the frontend NOT_SERVING")
        with Client(frontend.address) as client, pytest.raises(grpc.RpcError) as refused:
            list(client.generate(prompt="Hi", max_tokens=2))
        assert refused.value.code() == grpc.StatusCode.UNAVAILABLE
        http = f"http://{stack.http_address}"
        assert requests.get(f"{http}/health", timeout=5).status_code == 503
        response = requests.post(f"{http}/v1/completions", json={"prompt": "Hi", "max_tokens": 2},
                                 timeout=10)
        assert response.status_code == 503 and response.json()["error"]["code"] == "unavailable"
        stream.join(60)
        assert stream.error is None and len(stream.tokens) == 160  # finished, whole
        assert frontend.process.wait(timeout=DEADLINE_S) == 0
    finally:
        stack.stop()


def test_engine_core_drain_timeout_cuts_what_is_left(model_dir, tmp_path):
    stack = start_stack(model_dir, tmp_path, drain_timeout_s=3)
    try:
        engine = service(stack, "engine-core")
        stream = Stream(service(stack, "frontend").address, max_tokens=1500)
        stream.start()
        assert stream.started.wait(60) and stream.error is None
        engine.process.send_signal(signal.SIGTERM)
        wait_until(lambda: health_status(engine.address)
                   == health_pb2.HealthCheckResponse.NOT_SERVING, "the engine core NOT_SERVING")
        # It exits while the stream still has most of its 1,500 tokens to go (a
        # drain that waited for it would exit only after them): cut, not finished.
        assert engine.process.wait(timeout=DEADLINE_S) == 0
        stream.join(DEADLINE_S)
        assert stream.error is not None and len(stream.tokens) < 1500
    finally:
        stack.stop()
