"""TLS on every hop, mutual TLS between the services, and the API key on the
public gRPC and HTTP APIs; health stays open. Certificates are made at test
time (certificates.py)."""
import asyncio

import grpc
import pytest
import requests
from grpc_health.v1 import health_pb2, health_pb2_grpc

from bench.stack import engine_stats_at
from llmserve.client import Client
from llmserve.launcher import LocalStack
from services.common.config import CacheConfig, EngineConfig, ModelConfig
from services.common.errors import Unavailable
from services.common.pb import engine_core_pb2, engine_core_pb2_grpc
from services.common.tls import TlsConfig
from services.frontend.engine_addresses import parse_engine_addresses
from services.frontend.router import EngineRouter
from tests.e2e.certificates import make_certificates
from tests.e2e.dns_server import DnsServer

pytestmark = pytest.mark.e2e
KEY = "test-key-123"


@pytest.fixture(scope="module")
def secure(tmp_path_factory, model_dir):
    directory = tmp_path_factory.mktemp("tls")
    certs = make_certificates(directory)
    config = EngineConfig(model=ModelConfig(model=model_dir, dtype="float32"),
                          cache=CacheConfig(kv_cache_bytes=160 << 20))
    stack = LocalStack(config, port=0, log_dir=str(directory), http_port=0, api_key=KEY,
                       tls=TlsConfig(certs.cert, certs.key, certs.ca))
    stack.start(timeout_s=180)
    yield stack, certs, make_certificates(directory, "stranger")
    stack.stop()


def frontend(stack) -> str:
    return next(s.address for s in stack.services if s.name == "frontend")


def engine_core(stack) -> str:
    return next(s.address for s in stack.services if s.name == "engine-core")


def test_the_key_over_tls_generates(secure):
    stack, certs, _ = secure
    with Client(frontend(stack), api_key=KEY, tls_ca=certs.ca) as client:
        tokens = [t for r in client.generate(prompt="Hi", max_tokens=4) for t in r.token_ids]
    assert len(tokens) == 4


@pytest.mark.parametrize("api_key", [None, "wrong-key"])
def test_without_the_key_grpc_is_unauthenticated_and_health_is_open(secure, api_key):
    stack, certs, _ = secure
    with Client(frontend(stack), api_key=api_key, tls_ca=certs.ca) as client:
        with pytest.raises(grpc.RpcError) as refused:
            list(client.generate(prompt="Hi", max_tokens=4))
        assert refused.value.code() == grpc.StatusCode.UNAUTHENTICATED
        assert "API key" in refused.value.details()
        with pytest.raises(grpc.RpcError) as refused:
            client.tokenize("Hi")
        assert refused.value.code() == grpc.StatusCode.UNAUTHENTICATED
        status = health_pb2_grpc.HealthStub(client.channel).Check(
            health_pb2.HealthCheckRequest(service=""), timeout=10).status
        assert status == health_pb2.HealthCheckResponse.SERVING


def test_https_needs_the_key_except_for_health(secure):
    stack, certs, _ = secure
    url = f"https://{stack.http_address}"
    body = {"prompt": "Hi", "max_tokens": 3}
    refused = requests.post(f"{url}/v1/completions", json=body, verify=certs.ca, timeout=30)
    assert refused.status_code == 401
    assert refused.json()["error"]["code"] == "unauthenticated"
    served = requests.post(f"{url}/v1/completions", json=body, verify=certs.ca, timeout=60,
                           headers={"Authorization": f"Bearer {KEY}"})
    assert served.status_code == 200 and served.json()["usage"]["completion_tokens"] == 3
    assert requests.get(f"{url}/health", verify=certs.ca, timeout=30).status_code == 200
    with pytest.raises(requests.exceptions.SSLError):  # a CA it does not trust
        requests.get(f"{url}/health", verify=secure[2].ca, timeout=30)


def test_plaintext_is_refused(secure):
    stack, _, _ = secure
    with Client(frontend(stack), api_key=KEY) as client:
        with pytest.raises(grpc.RpcError) as refused:
            list(client.generate(prompt="Hi", max_tokens=2, timeout=10))
    assert refused.value.code() == grpc.StatusCode.UNAVAILABLE


def test_internal_services_require_a_client_certificate_from_their_ca(secure):
    stack, certs, stranger = secure
    address = engine_core(stack)
    assert engine_stats_at(address, TlsConfig(certs.cert, certs.key, certs.ca)).num_kv_blocks > 0
    no_certificate = grpc.ssl_channel_credentials(open(certs.ca, "rb").read())
    with grpc.secure_channel(address, no_certificate) as channel:
        with pytest.raises(grpc.RpcError) as refused:
            engine_core_pb2_grpc.EngineCoreStub(channel).GetStats(
                engine_core_pb2.GetStatsRequest(), timeout=10)
    assert refused.value.code() == grpc.StatusCode.UNAVAILABLE
    # A certificate from another CA is refused too (the server trusts its CA only).
    foreign = grpc.ssl_channel_credentials(open(certs.ca, "rb").read(),
                                           open(stranger.key, "rb").read(),
                                           open(stranger.cert, "rb").read())
    with grpc.secure_channel(address, foreign) as channel:
        with pytest.raises(grpc.RpcError) as refused:
            engine_core_pb2_grpc.EngineCoreStub(channel).GetStats(
                engine_core_pb2.GetStatsRequest(), timeout=10)
    assert refused.value.code() == grpc.StatusCode.UNAVAILABLE


def test_engines_found_by_dns_are_checked_against_the_dns_name(secure):
    """With --engine-core-addresses dns:name:port, the frontend reaches engine pods
    by IP and checks their certificates against the name (pod IPs change)."""
    stack, certs, _ = secure
    host, port = engine_core(stack).rsplit(":", 1)
    dns = DnsServer()
    dns.set("llmserve-engine", [host])
    dns.set("elsewhere", [host])
    tls = TlsConfig(certs.cert, certs.key, certs.ca)

    async def max_model_len(name: str) -> int:
        router = EngineRouter(parse_engine_addresses(f"dns://{dns.address}/{name}:{port}"),
                              tls=tls)
        try:
            await router.start(timeout_s=5)
            return (await router.get_info()).max_model_len
        finally:
            await router.close()
    try:
        assert asyncio.run(max_model_len("llmserve-engine")) > 0
        with pytest.raises(Unavailable):  # a name the certificate does not hold
            asyncio.run(max_model_len("elsewhere"))
    finally:
        dns.stop()
