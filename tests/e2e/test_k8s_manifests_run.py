"""The Kubernetes manifests, run: deploy/k8s rendered by kustomize, each pod's
containers started as local processes from their commands, args, env and ports
(k8s_pods.py), and the headless Service's name answered by a DNS server in the
test with the ready engine pods, as the cluster DNS would. The manifests cannot
drift from the CLI: a renamed flag, a probe on the wrong port or a wrong
Service name fails here."""
import concurrent.futures
import signal
import time

import pytest
import requests

from llmserve.client import Client
from tests.e2e.conftest import engine_stats_at, wait_all_blocks_free_at
from tests.e2e.dns_server import DnsServer
from tests.e2e.k8s_pods import restart_container, start_pod, stop_pod, wait_ready
from tests.k8s_render import K8S_DIR, find, pod_templates, render

pytestmark = pytest.mark.e2e

# Pod IPs: loopback addresses of their own, so every pod can use the manifests' ports.
ENGINE_IPS = ["127.0.0.11", "127.0.0.12"]
FRONTEND_IP = "127.0.0.21"


def container_port(template: dict, container: str, port_name: str) -> int:
    spec = next(c for c in template["spec"]["containers"] if c["name"] == container)
    return next(p["containerPort"] for p in spec["ports"] if p["name"] == port_name)


@pytest.fixture
def cluster(tmp_path, otlp):
    """Starts pods from the rendered manifests; stops them all at the end."""
    yield from run_pods(render(), tmp_path, otlp)


@pytest.fixture
def pipeline_cluster(tmp_path, otlp):
    """The same, from the pipeline-parallel overlay."""
    yield from run_pods(render(K8S_DIR / "overlays" / "pipeline"), tmp_path, otlp)


def run_pods(objects: list[dict], tmp_path, otlp):
    dns = DnsServer()
    pods = []
    # What the image and the cluster provide differently here: the collector.
    overrides = {"OTEL_EXPORTER_OTLP_ENDPOINT": otlp.endpoint, "OTEL_BSP_SCHEDULE_DELAY": "100"}

    def start(workload: str, name: str, ip: str):
        template = pod_templates(objects)[workload]
        pod = start_pod(objects, template, name, ip, tmp_path, overrides,
                        rewrite_arg=lambda arg: arg.replace("dns:///", f"dns://{dns.address}/"))
        pods.append(pod)
        wait_ready(pod, timeout_s=300)
        return pod

    yield objects, dns, start
    for pod in pods:
        stop_pod(pod, timeout_s=30)
    dns.stop()


def generate(frontend_ip: str, port: int, prompt: str, request_id: str) -> str:
    with Client(f"{frontend_ip}:{port}") as client:
        return "".join(r.text for r in client.generate(
            prompt=prompt, max_tokens=6, temperature=0, ignore_eos=True, request_id=request_id))


def stream_token_ids(frontend_ip: str, port: int, on_response=lambda i: None) -> list[int]:
    """A greedy 24-token stream; on_response(i) runs after its i-th response."""
    token_ids = []
    with Client(f"{frontend_ip}:{port}") as client:
        for i, response in enumerate(client.generate(
                prompt="Tell me about the sea.", max_tokens=24, temperature=0, ignore_eos=True)):
            token_ids += response.token_ids
            on_response(i)
    return token_ids


def test_the_manifests_serve_scale_and_drain(cluster, otlp):
    objects, dns, start = cluster
    templates = pod_templates(objects)
    service = find(objects, "Service", "llmserve-engine")["metadata"]["name"]
    ports = {name: container_port(templates["llmserve-frontend"], "frontend", name)
             for name in ("grpc", "http")}
    engine_port = container_port(templates["llmserve-engine"], "engine-core", "grpc")

    engine0 = start("llmserve-engine", "llmserve-engine-0", ENGINE_IPS[0])
    dns.set(service, [engine0.ip])  # ready: the headless Service lists it
    start("llmserve-frontend", "llmserve-frontend-0", FRONTEND_IP)
    text = check_both_apis(ports)

    # Scale up: a second replica joins routing when the name lists it.
    engine1 = start("llmserve-engine", "llmserve-engine-1", ENGINE_IPS[1])
    dns.set(service, [engine0.ip, engine1.ip])
    second = f"{engine1.ip}:{engine_port}"
    wait_until_it_serves(second, ports["grpc"])

    # Scale down: engine-0 leaves the Service, then the kubelet's preStop and SIGTERM.
    dns.set(service, [engine1.ip])
    pre_stop = templates["llmserve-engine"]["spec"]["containers"][0]["lifecycle"]["preStop"]
    time.sleep(pre_stop["sleep"]["seconds"])
    assert stop_pod(engine0) == {"engine-core": 0, "worker": 0}  # drained, exited cleanly
    steps = engine_stats_at(second).num_steps
    assert generate(FRONTEND_IP, ports["grpc"], "The capital of France is", "k8s-last") == text
    assert engine_stats_at(second).num_steps > steps

    check_worker_restart(engine1, ports["grpc"])
    assert wait_all_blocks_free_at(second).num_used_kv_blocks == 0
    check_trace(otlp, "k8s-first")


def test_the_pipeline_overlay_serves_from_two_stages(pipeline_cluster):
    """One engine pod, its two workers one stage each: greedy text over both APIs
    equals the offline API's with the model in one process."""
    from llmserve.llm import LLM
    from services.common.sampling_params import SamplingParams

    objects, dns, start = pipeline_cluster
    templates = pod_templates(objects)
    ports = {name: container_port(templates["llmserve-frontend"], "frontend", name)
             for name in ("grpc", "http")}
    engine = start("llmserve-engine", "llmserve-engine-0", ENGINE_IPS[0])
    assert set(engine.processes) == {"engine-core", "worker", "worker-stage2"}
    dns.set(find(objects, "Service", "llmserve-engine")["metadata"]["name"], [engine.ip])
    start("llmserve-frontend", "llmserve-frontend-0", FRONTEND_IP)
    text = check_both_apis(ports)
    expected = LLM().generate("The capital of France is", SamplingParams(
        max_tokens=6, temperature=0, ignore_eos=True), use_tqdm=False)[0].outputs[0].text
    assert text == expected
    assert stop_pod(engine) == {"engine-core": 0, "worker": 0, "worker-stage2": 0}


def check_both_apis(ports: dict[str, int]) -> str:
    """Greedy text over gRPC equals the HTTP API's; returns it."""
    text = generate(FRONTEND_IP, ports["grpc"], "The capital of France is", "k8s-first")
    assert text.strip()
    http = requests.post(f"http://{FRONTEND_IP}:{ports['http']}/v1/completions", timeout=60,
                         json={"model": "SmolLM2-135M-Instruct",
                               "prompt": "The capital of France is", "max_tokens": 6,
                               "temperature": 0, "ignore_eos": True}).json()
    assert http["choices"][0]["text"] == text
    return text


def wait_until_it_serves(engine_address: str, grpc_port: int) -> None:
    """Sends bursts of 4 requests until the engine core there has run a step."""
    deadline = time.monotonic() + 60
    with concurrent.futures.ThreadPoolExecutor(4) as pool:
        while engine_stats_at(engine_address).num_steps == 0:
            assert time.monotonic() < deadline, "the new replica never got a request"
            list(pool.map(lambda i: generate(FRONTEND_IP, grpc_port, f"Count to {i}:",
                                             f"k8s-spread-{i}-{time.monotonic()}"), range(4)))


def check_worker_restart(pod, grpc_port: int) -> None:
    """The kubelet restarts a worker container that died (kill -9) mid-stream: the
    engine core reloads it and the stream goes on without an error. (The
    manifests' dtype is auto: bf16 on CPUs with AMX, where recomputing the
    request after the crash rounds differently than decoding it did, so only
    what was streamed before the crash is compared; in fp32 the whole stream is
    identical: test_worker_recovery.py.)"""
    undisturbed = stream_token_ids(FRONTEND_IP, grpc_port)
    killed = []

    def kill_worker(i: int) -> None:
        if i == 4:
            killed.append(pod.processes["worker"].pid)
            pod.processes["worker"].send_signal(signal.SIGKILL)
            pod.processes["worker"].wait()
            restart_container(pod, "worker")
    resumed = stream_token_ids(FRONTEND_IP, grpc_port, kill_worker)
    assert killed and pod.processes["worker"].pid != killed[0]
    assert len(resumed) == len(undisturbed) == 24 and resumed[:5] == undisturbed[:5]
    wait_ready(pod, timeout_s=120)  # the worker is ready again once reloaded


def check_trace(otlp, request_id: str) -> None:
    """The OTEL_* variables: one trace across the three containers, each named by its pod."""
    deadline = time.monotonic() + 30
    while not (spans := otlp.find_spans("frontend.request", **{"gen_ai.request.id": request_id})):
        assert time.monotonic() < deadline, "no trace from the frontend"
        time.sleep(0.2)
    trace = otlp.spans_of_trace(spans[0].trace_id)
    while {s.resource.get("k8s.container.name") for s in trace} != {"frontend", "engine-core",
                                                                    "worker"}:
        assert time.monotonic() < deadline, f"trace misses a container: {trace}"
        time.sleep(0.2)
        trace = otlp.spans_of_trace(spans[0].trace_id)
    assert {s.resource["k8s.pod.name"] for s in trace} == {"llmserve-frontend-0",
                                                           "llmserve-engine-0"}
