"""The three-process gRPC stack (worker, engine core, frontend) the serving
benchmark runs against, started and stopped by the benchmark."""
from __future__ import annotations

import shutil
import tempfile
from contextlib import contextmanager
from typing import Iterator

from llmserve.launcher import LocalStack
from services.common import convert
from services.common.config import CacheConfig, EngineConfig, ModelConfig
from services.common.pb import engine_core_pb2, engine_core_pb2_grpc
from services.common.request_types import EngineStats
from services.common.tls import TlsConfig, sync_channel


@contextmanager
def serving_stack(model_dir: str, dtype: str, kv_cache_gib: float, max_model_len: int,
                  env: dict[str, str] | None = None,
                  metrics_port: int | None = None,
                  prefix_caching: bool = False, http: bool = False) -> Iterator[LocalStack]:
    """A started LocalStack on free ports; its logs are kept only if something fails.
    env and metrics_port as LocalStack's (tracing and metrics are off by default);
    http: the OpenAI HTTP API too, on a free port (stack.http_address)."""
    log_dir = tempfile.mkdtemp(prefix="llmserve-bench-")
    # Prefix caching off unless asked for, as in the offline runs and vLLM's: a
    # round that repeats the prompts of the one before (the observability rounds)
    # would skip their prefills and run about 1.5x as fast.
    config = EngineConfig(model=ModelConfig(model=model_dir, dtype=dtype,
                                            max_model_len=max_model_len),
                          cache=CacheConfig(kv_cache_bytes=int(kv_cache_gib * (1 << 30)),
                                            enable_prefix_caching=prefix_caching))
    stack = LocalStack(config, port=0, log_dir=log_dir, env=env, metrics_port=metrics_port,
                       http_port=0 if http else None)
    try:
        stack.start(timeout_s=300)
        yield stack
    except BaseException:
        print(f"[bench] serving stack failed; its logs are in {log_dir}", flush=True)
        raise
    finally:
        stack.stop()
    shutil.rmtree(log_dir, ignore_errors=True)


def frontend_address(stack: LocalStack) -> str:
    return next(s.address for s in stack.services if s.name == "frontend")


def engine_stats(stack: LocalStack, name: str = "engine-core") -> EngineStats:
    return engine_stats_at(next(s.address for s in stack.services if s.name == name))


def engine_stats_at(address: str, tls: TlsConfig | None = None) -> EngineStats:
    """GetStats of the engine core at `address` (over TLS when given)."""
    with sync_channel(address, tls) as channel:
        return convert.engine_stats_from_proto(engine_core_pb2_grpc.EngineCoreStub(
            channel).GetStats(engine_core_pb2.GetStatsRequest(), timeout=10))
