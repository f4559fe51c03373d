"""Two engine-core replicas behind one frontend: load is spread, and when one dies
its requests go on on the other, as if nothing happened, and new ones go there."""
import concurrent.futures
import os
import signal
import subprocess
import sys
import time
from pathlib import Path

import grpc
import pytest

from llmserve.client import Client
from llmserve.launcher import LocalStack
from services.common.config import CacheConfig, EngineConfig, ModelConfig
from tests.e2e.conftest import address, engine_stats

pytestmark = pytest.mark.e2e
ENGINES = ["engine-core-0", "engine-core-1"]
MAX_TOKENS = 120


def _tokens(stream) -> list[int]:
    return [t for response in stream for t in response.token_ids]


def test_requests_spread_and_survive_a_dead_replica(tmp_path, model_dir):
    config = EngineConfig(model=ModelConfig(model=model_dir, dtype="float32"),
                          cache=CacheConfig(kv_cache_bytes=128 << 20))
    with LocalStack(config, port=0, log_dir=str(tmp_path), engine_replicas=2,
                    restart_dead=True) as stack:
        stack.start(timeout_s=240)
        # Each replica's worker runs on its own cores (no two thread teams on one).
        workers = [s.process.pid for s in stack.services if s.name.startswith("worker")]
        cores = [set(os.sched_getaffinity(pid)) for pid in workers]
        if len(os.sched_getaffinity(0)) >= 2:
            assert len(cores) == 2 and not cores[0] & cores[1] and all(cores)
        with Client(address(stack, "frontend")) as client:
            with concurrent.futures.ThreadPoolExecutor(4) as pool:
                list(pool.map(lambda i: list(client.generate(f"Story {i}:", max_tokens=8)),
                              range(4)))
            assert all(engine_stats(stack, e).num_steps > 0 for e in ENGINES)

            # Killed mid-stream, a replica's requests go on on the other one, with
            # the tokens an undisturbed run gives (greedy and seeded).
            requests = [dict(prompt="A very long story:", temperature=0),
                        dict(prompt="Another story:", temperature=1.0, seed=3)]
            undisturbed = [_tokens(client.generate(max_tokens=MAX_TOKENS, ignore_eos=True, **r))
                           for r in requests]
            streams = [client.generate(max_tokens=MAX_TOKENS, ignore_eos=True, **r)
                       for r in requests]
            firsts = [list(next(s).token_ids) for s in streams]
            busy = next(e for e in ENGINES if engine_stats(stack, e).num_running >= 1)
            next(s for s in stack.services if s.name == busy).process.send_signal(signal.SIGKILL)
            assert [f + _tokens(s) for f, s in zip(firsts, streams)] == undisturbed

            # New requests are served meanwhile (by the survivor, or by the dead
            # replica once it is back).
            for i in range(3):
                assert list(client.generate(f"After {i}:", max_tokens=4))[-1].usage \
                    .completion_tokens == 4

            # The launcher starts the dead replica again, and the router uses it again.
            deadline = time.monotonic() + 120
            while True:
                try:
                    engine_stats(stack, busy)
                    break
                except grpc.RpcError:
                    assert time.monotonic() < deadline, "the dead replica was not restarted"
                    time.sleep(0.5)
            # The router polls it back into routing: concurrent requests reach it.
            while engine_stats(stack, busy).num_steps == 0:
                assert time.monotonic() < deadline, "the restarted replica got no request"
                with concurrent.futures.ThreadPoolExecutor(4) as pool:
                    list(pool.map(lambda i: list(client.generate(f"Again {i}:", max_tokens=8)),
                                  range(4)))


def test_async_streaming_example_runs(stack):
    example = Path(__file__).parents[2] / "examples" / "async_streaming.py"
    out = subprocess.run([sys.executable, str(example), address(stack, "frontend")],
                         capture_output=True, text=True, timeout=120)
    assert out.returncode == 0, out.stderr[-2000:]
    assert out.stdout.count("Q: ") == 3 and "Paris" in out.stdout
