"""The three real processes over real gRPC: stream, cancel, errors, health
(traces: test_observability.py)."""

import grpc
import pytest
from grpc_health.v1 import health_pb2, health_pb2_grpc
from grpc_reflection.v1alpha.proto_reflection_descriptor_database import \
    ProtoReflectionDescriptorDatabase

from llmserve.client import Client
from tests.e2e.conftest import address as _address
from tests.e2e.conftest import engine_stats, wait_all_blocks_free

pytestmark = pytest.mark.e2e


def test_health_and_reflection_on_all_three(stack):
    expected = {"frontend": "llmserve.v1.Inference", "engine-core": "llmserve.engine.v1.EngineCore",
                "worker": "llmserve.worker.v1.Worker"}
    for service in stack.services:
        with grpc.insecure_channel(service.address) as channel:
            stub = health_pb2_grpc.HealthStub(channel)
            for name in ("", expected[service.name]):
                assert stub.Check(health_pb2.HealthCheckRequest(service=name), timeout=5).status \
                    == health_pb2.HealthCheckResponse.SERVING, (service.name, name)
            services = ProtoReflectionDescriptorDatabase(channel).get_services()
            assert expected[service.name] in services and "grpc.health.v1.Health" in services


def test_stream_then_cancel_frees_every_block(stack, tokenizer):
    with Client(_address(stack, "frontend")) as client:
        responses = list(client.generate(chat=[{"role": "user", "content": "What is 2+2?"}],
                                         max_tokens=24, temperature=0))
        text = "".join(r.text for r in responses)
        assert len(responses) > 1 and text.strip()
        assert "\ufffd" not in text
        last = responses[-1]
        assert last.HasField("finish_reason") and last.usage.completion_tokens == sum(
            len(r.token_ids) for r in responses)
        assert text == tokenizer.decode([t for r in responses for t in r.token_ids],
                                        skip_special_tokens=True)

        stream = client.generate(prompt="Write a very long story about a dragon.",
                                 max_tokens=500, temperature=0, ignore_eos=True)
        for i, _ in enumerate(stream):
            if i == 5:
                assert engine_stats(stack).num_running == 1
                stream.cancel()
                break
        stats = wait_all_blocks_free(stack)
        assert stats.num_waiting == 0


def test_deadline_aborts_the_request(stack):
    with Client(_address(stack, "frontend")) as client:
        with pytest.raises(grpc.RpcError) as err:
            for _ in client.generate(prompt="Count to a thousand:", max_tokens=1000,
                                     ignore_eos=True, timeout=1.0):
                pass
        assert err.value.code() == grpc.StatusCode.DEADLINE_EXCEEDED
    wait_all_blocks_free(stack)


def test_bad_input_is_invalid_argument_and_harms_nobody(stack):
    with Client(_address(stack, "frontend")) as client:
        good = client.generate(prompt="Hello", max_tokens=8, temperature=0)
        for kwargs, field in [({"prompt": "hi", "temperature": -1.0}, "temperature"),
                              ({"token_ids": [10**6]}, "token_ids"),
                              ({"prompt": ""}, "prompt"),
                              ({"prompt": "hi", "max_tokens": 0}, "max_tokens")]:
            with pytest.raises(grpc.RpcError) as err:
                list(client.generate(**kwargs))
            assert err.value.code() == grpc.StatusCode.INVALID_ARGUMENT
            assert field in err.value.details()
        assert list(good)[-1].usage.completion_tokens == 8
        info = client.model_info()
        assert info.vocab_size == 49152 and info.dtype == "float32" and info.num_kv_blocks > 0


def test_generate_cli_streams_the_answer(stack):
    import subprocess
    import sys
    out = subprocess.run([sys.executable, "-m", "llmserve.cli", "generate", "--address",
                          _address(stack, "frontend"), "--max-tokens", "12", "What is 2+2?"],
                         capture_output=True, text=True, timeout=60)
    assert out.returncode == 0, out.stderr
    assert out.stdout.strip()
