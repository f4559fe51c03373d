"""One three-process stack shared by the end-to-end tests (starting one takes seconds)."""

import grpc
import pytest
from grpc_health.v1 import health_pb2, health_pb2_grpc

from bench.stack import engine_stats_at
from llmserve.launcher import LocalStack
from services.common.config import (CacheConfig, EngineConfig, LoRAConfig, ModelConfig,
                                    SchedulerConfig, StructuredOutputsConfig)
from bench.otlp_receiver import OtlpReceiver
from tests.lora_adapters import ALL_PROJECTIONS, build_adapter
from tests.waiting import wait_until

# Small limits so that tests can fill the batch and the waiting queue, and
# see a grammar compile stopped.
MAX_NUM_SEQS = 8
MAX_WAITING = 8
COMPILE_TIMEOUT_S = 4.0


@pytest.fixture(scope="package")
def otlp():
    """The OTLP/gRPC endpoint the stack's services export spans and metrics to."""
    receiver = OtlpReceiver()
    yield receiver
    receiver.stop()


@pytest.fixture(scope="package")
def lora_dirs(tmp_path_factory, model_dir) -> dict[str, str]:
    """Two PEFT adapters of the default model: "start" is served from the stack's
    start (--lora-modules), "runtime" is for tests to load."""
    root = tmp_path_factory.mktemp("lora")
    dirs = {"start": str(root / "start"), "runtime": str(root / "runtime")}
    build_adapter(model_dir, dirs["start"], 1, r=8, lora_alpha=16,
                  target_modules=ALL_PROJECTIONS)
    build_adapter(model_dir, dirs["runtime"], 2, r=4, lora_alpha=8,
                  target_modules=["q_proj", "v_proj", "down_proj"])
    return dirs


@pytest.fixture(scope="package")
def stack(tmp_path_factory, model_dir, otlp, lora_dirs):
    log_dir = tmp_path_factory.mktemp("logs")
    config = EngineConfig(model=ModelConfig(model=model_dir, dtype="float32"),
                          cache=CacheConfig(kv_cache_bytes=160 << 20),
                          scheduler=SchedulerConfig(max_num_seqs=MAX_NUM_SEQS,
                                                    max_waiting_requests=MAX_WAITING),
                          lora=LoRAConfig(enable_lora=True, max_loras=2),
                          structured_outputs=StructuredOutputsConfig(COMPILE_TIMEOUT_S))
    local = LocalStack(config, port=0, log_dir=str(log_dir), http_port=0, metrics_port=0,
                       lora_modules=[f"start-adapter={lora_dirs['start']}"],
                       env={"OTEL_EXPORTER_OTLP_ENDPOINT": otlp.endpoint,
                            "OTEL_EXPORTER_OTLP_INSECURE": "true",
                            "OTEL_METRICS_EXPORTER": "otlp",
                            # Export often: the tests wait for what was sent.
                            "OTEL_BSP_SCHEDULE_DELAY": "100",
                            "OTEL_METRIC_EXPORT_INTERVAL": "500"})
    local.start(timeout_s=180)
    yield local
    local.stop()
    for service in local.services:
        assert service.process.returncode is not None


def address(stack, name: str) -> str:
    return next(s.address for s in stack.services if s.name == name)


def engine_stats(stack, name: str = "engine-core"):
    return engine_stats_at(address(stack, name))


def health_status(address: str, service: str = "", timeout_s: float = 5.0) -> int:
    """grpc.health.v1 Check of `service` at a plaintext address."""
    with grpc.insecure_channel(address) as channel:
        return health_pb2_grpc.HealthStub(channel).Check(
            health_pb2.HealthCheckRequest(service=service), timeout=timeout_s).status


def wait_all_blocks_free(stack, name: str = "engine-core", timeout_s: float = 10.0):
    """Polls until the engine core holds no KV block and runs nothing."""
    return wait_all_blocks_free_at(address(stack, name), timeout_s)


def wait_all_blocks_free_at(engine_address: str, timeout_s: float = 10.0):
    def idle():
        stats = engine_stats_at(engine_address)
        return stats if stats.num_used_kv_blocks == 0 and stats.num_running == 0 else None
    return wait_until(idle, f"every KV block of {engine_address} free", timeout_s)


def wait_for_engine_stat(stack, field: str, n: int):
    """Polls until the engine core's stat `field` reaches n."""
    wait_until(lambda: getattr(engine_stats(stack), field) >= n, f"{field} reaching {n}")


def kill_a_worker_mid_stream(stack, prompt: str, max_tokens: int, rank: int = 1) -> None:
    """SIGKILL of one worker rank after 20 streamed tokens (the stack restarts its
    dead): the stream ends with the undisturbed run's tokens, every worker of the
    group was restarted, and every KV block is free."""
    from llmserve.client import Client

    workers = [s for s in stack.services if s.name.startswith("worker")]
    pids = [w.process.pid for w in workers]
    with Client(address(stack, "frontend")) as client:
        def stream():
            return client.generate(prompt, max_tokens=max_tokens, temperature=0,
                                   ignore_eos=True)

        undisturbed = [t for r in stream() for t in r.token_ids]
        tokens = []
        for response in stream():
            tokens += response.token_ids
            if len(tokens) >= 20 and workers[rank].process.poll() is None \
                    and all(w.process.pid == pid for w, pid in zip(workers, pids)):
                workers[rank].process.kill()  # once: several tokens may come at a time
    assert tokens == undisturbed and len(tokens) == max_tokens
    assert all(w.process.pid != pid for w, pid in zip(workers, pids))  # all restarted
    wait_all_blocks_free(stack)
