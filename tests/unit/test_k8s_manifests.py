"""deploy/k8s, rendered by kustomize (the CPU deployment, the GPU overlay, and the
CPU one with the TLS component): every object validates strictly against the
Kubernetes 1.33 schemas, and what the manifests say agrees with the services'
own command lines and with itself. (test_k8s_manifests_run.py runs them.)"""
import kubernetes_validate
import pytest

from services.engine_core import __main__ as engine_core_main
from services.frontend import __main__ as frontend_main
from services.worker import __main__ as worker_main
from tests.k8s_render import K8S_DIR, find, pod_templates, render, render_with_components

KUBERNETES_VERSION = "1.33.0"
SERVICES = {"frontend": frontend_main, "engine-core": engine_core_main, "worker": worker_main}


@pytest.fixture(scope="module")
def tls_objects(tmp_path_factory):
    """The CPU deployment with the TLS component."""
    return render_with_components(tmp_path_factory.mktemp("tls"), K8S_DIR / "overlays" / "cpu",
                                  [K8S_DIR / "components" / "tls"])


@pytest.fixture(scope="module", params=["cpu", "gpu", "pipeline", "cpu+tls"])
def objects(request):
    if request.param == "cpu":
        return render(K8S_DIR)
    if request.param in ("gpu", "pipeline"):
        return render(K8S_DIR / "overlays" / request.param)
    return request.getfixturevalue("tls_objects")


def containers(objects):
    for name, template in pod_templates(objects).items():
        for container in template["spec"]["containers"]:
            yield name, template, container


def parsed_args(container):
    """The container's arguments, parsed by its service's own parser."""
    assert container["command"][0] == "llmserve"
    return SERVICES[container["command"][1]].parse_args(container.get("args", []))


def test_every_object_validates_strictly(objects):
    kinds = {o["kind"] for o in objects}
    assert kinds >= {"StatefulSet", "Deployment", "Service", "ConfigMap", "PodDisruptionBudget",
                     "NetworkPolicy", "HorizontalPodAutoscaler"}
    for o in objects:
        kubernetes_validate.validate(o, KUBERNETES_VERSION, strict=True)


def test_probes_ask_the_health_port_for_the_right_service(objects):
    for workload, _, container in containers(objects):
        args = parsed_args(container)
        service = SERVICES[container["command"][1]].SERVICE_NAME
        declared = {p["containerPort"] for p in container["ports"]}
        assert {args.port, args.health_port} <= declared, (workload, container["name"])
        assert container["readinessProbe"]["grpc"] == {"port": args.health_port,
                                                       "service": service}
        assert container["livenessProbe"]["grpc"] == {"port": args.health_port}
        if "startupProbe" in container:  # the model load, up to 10 minutes
            probe = container["startupProbe"]
            assert probe["grpc"] == {"port": args.health_port}
            assert probe["periodSeconds"] * probe["failureThreshold"] >= 600


def test_the_grace_period_covers_prestop_and_the_drain(objects):
    for workload, template, container in containers(objects):
        args = parsed_args(container)
        pre_stop = container.get("lifecycle", {}).get("preStop", {}).get("sleep", {})
        drain = getattr(args, "drain_timeout", 0)
        assert template["spec"]["terminationGracePeriodSeconds"] >= \
            pre_stop.get("seconds", 0) + drain + 5, (workload, container["name"])


def test_the_engine_pod_wires_its_workers_and_the_frontend_finds_the_engines(objects):
    engine = pod_templates(objects)["llmserve-engine"]["spec"]["containers"]
    core = parsed_args(next(c for c in engine if c["command"][1] == "engine-core"))
    workers = sorted((parsed_args(c) for c in engine if c["command"][1] == "worker"),
                     key=lambda a: a.rank)
    assert core.worker_addresses.split(",") == [f"127.0.0.1:{w.port}" for w in workers]
    assert core.tensor_parallel_size * core.pipeline_parallel_size == len(workers)
    assert [w.rank for w in workers] == list(range(len(workers)))

    frontend_container = pod_templates(objects)["llmserve-frontend"]["spec"]["containers"][0]
    frontend = parsed_args(frontend_container)
    startup = frontend_container["startupProbe"]  # the frontend waits for the engines within it
    assert frontend.engine_wait_timeout >= startup["periodSeconds"] * startup["failureThreshold"]
    service = find(objects, "Service", frontend.engine_core_addresses.host)
    assert service["spec"]["clusterIP"] == "None"  # headless: one record per ready pod
    assert [p["port"] for p in service["spec"]["ports"]] == [frontend.engine_core_addresses.port]
    assert frontend.engine_core_addresses.port == core.port


def test_selectors_and_references_resolve(objects):
    templates = pod_templates(objects)
    labels = {name: t["metadata"]["labels"] for name, t in templates.items()}

    def selected(selector):
        return [n for n, ls in labels.items() if selector.items() <= ls.items()]

    port_names = {name: {p["name"] for c in t["spec"]["containers"] for p in c["ports"]}
                  for name, t in templates.items()}
    for o in objects:
        spec = o.get("spec", {})
        if o["kind"] == "Service":
            [target] = selected(spec["selector"])
            assert {p["targetPort"] for p in spec["ports"]} <= port_names[target]
        elif o["kind"] in ("PodDisruptionBudget", "NetworkPolicy"):
            selector = spec.get("selector") or spec["podSelector"]
            [target] = selected(selector["matchLabels"])
            for rule in spec.get("ingress", []):
                assert {p["port"] for p in rule["ports"]} <= port_names[target]
        elif o["kind"] == "HorizontalPodAutoscaler":
            assert find(objects, spec["scaleTargetRef"]["kind"], spec["scaleTargetRef"]["name"])
    for _, _, container in containers(objects):
        for source in container.get("envFrom", []):
            assert find(objects, "ConfigMap", source["configMapRef"]["name"])


def test_tls_reaches_every_service_and_the_probes_stay_plaintext(tls_objects):
    for _, template, container in containers(tls_objects):
        args = parsed_args(container)
        assert args.tls_cert and args.tls_key and args.tls_ca
        mount = next(m for m in container["volumeMounts"] if m["name"] == "tls")
        assert args.tls_cert.startswith(mount["mountPath"] + "/")
        volume = next(v for v in template["spec"]["volumes"] if v["name"] == "tls")
        assert volume["secret"]["secretName"] == "llmserve-tls"
        assert container["readinessProbe"]["grpc"]["port"] == args.health_port != args.port

