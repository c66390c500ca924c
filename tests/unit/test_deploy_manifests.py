"""deploy/: the Compose file and the Kubernetes manifests parse, and name the port, probe path, flags and metric
that Kettle really has (the image's PORT, the /health route, `kettle launch`'s flags, tgi_queue_size)."""

from __future__ import annotations

import re
import shutil
import subprocess
import sys
from pathlib import Path

import pytest
import yaml
from typer.main import get_command

from kettle.cli import app
from kettle.router import metrics

ROOT = Path(__file__).resolve().parents[2]
DEPLOY = ROOT / "deploy"


def image_port() -> str:
    """The port the image listens on: its `PORT` environment variable."""
    return re.search(r"\bPORT=(\d+)", (ROOT / "Dockerfile").read_text()).group(1)


def launch_flags() -> set[str]:
    return {opt for param in get_command(app).commands["launch"].params for opt in param.opts}


def launch_envvars() -> set[str]:
    names: set[str] = set()
    for param in get_command(app).commands["launch"].params:
        names.update([param.envvar] if isinstance(param.envvar, str) else param.envvar or [])
    return names


def assert_known_flags(args: list[str]) -> None:
    unknown = [arg for arg in args if arg.startswith("-") and arg not in launch_flags()]
    assert not unknown, f"not flags of kettle launch: {unknown}"


def kubernetes() -> dict[tuple[str, str], dict]:
    documents = {}
    for path in sorted((DEPLOY / "kubernetes").glob("*.yaml")):
        for document in yaml.safe_load_all(path.read_text()):
            documents[(document["kind"], document["metadata"]["name"])] = document
    return documents


def test_compose_replicas_and_router():
    compose = yaml.safe_load((DEPLOY / "docker-compose.yml").read_text())
    services = compose["services"]
    replicas = {name: s for name, s in services.items() if name.startswith("kettle-")}
    assert len(replicas) >= 2
    for service in replicas.values():
        assert service["build"]["context"] == ".."  # the repository's Dockerfile
        assert_known_flags(service["command"])
        assert "/data" in service["volumes"][0]
        assert f"http://localhost:{image_port()}/health" in " ".join(service["healthcheck"]["test"])
    router = services["router"]["command"]
    workers = router[router.index("--worker-urls") + 1 : router.index("--worker-urls") + 1 + len(replicas)]
    assert workers == [f"http://{name}:{image_port()}" for name in replicas]
    assert router[router.index("--policy") + 1] == "cache_aware"
    assert router[router.index("--health-check-endpoint") + 1] == "/health"


def test_kubernetes_deployment_probes_port_and_flags():
    documents = kubernetes()
    deployment = documents[("Deployment", "kettle")]
    pod = deployment["spec"]["template"]
    (container,) = pod["spec"]["containers"]
    assert_known_flags(container["args"])
    env = {item["name"]: item["value"] for item in container["env"]}
    assert set(env) <= launch_envvars()
    assert env["PORT"] == image_port()
    assert [p["containerPort"] for p in container["ports"]] == [int(image_port())]
    for probe in ("readinessProbe", "livenessProbe"):
        assert container[probe]["httpGet"]["path"] == "/health"
    # The grace period outlasts Kettle's own drain.
    timeout = float(container["args"][container["args"].index("--graceful-termination-timeout") + 1])
    assert pod["spec"]["terminationGracePeriodSeconds"] > timeout
    service = documents[("Service", "kettle")]
    assert service["spec"]["selector"] == deployment["spec"]["selector"]["matchLabels"]


def test_kubernetes_router_finds_the_kettle_pods():
    documents = kubernetes()
    labels = documents[("Deployment", "kettle")]["spec"]["template"]["metadata"]["labels"]
    router = documents[("Deployment", "kettle-router")]["spec"]["template"]["spec"]
    args = router["containers"][0]["args"]
    assert "--service-discovery" in args
    assert args[args.index("--selector") + 1] == ",".join(f"{k}={v}" for k, v in labels.items())
    assert args[args.index("--service-discovery-port") + 1] == image_port()
    assert router["serviceAccountName"] == documents[("ServiceAccount", "kettle-router")]["metadata"]["name"]
    assert {"list", "watch"} <= set(documents[("Role", "kettle-router")]["rules"][0]["verbs"])


def test_hpa_scales_the_deployment_on_a_metric_kettle_exports():
    hpa = kubernetes()[("HorizontalPodAutoscaler", "kettle")]
    assert hpa["spec"]["scaleTargetRef"] == {"apiVersion": "apps/v1", "kind": "Deployment", "name": "kettle"}
    (metric,) = hpa["spec"]["metrics"]
    assert metric["pods"]["metric"]["name"] == "tgi_queue_size"
    assert metrics.QUEUE_SIZE._name == "tgi_queue_size"


def test_the_router_image_pins_the_scale_extra():
    pin = re.search(r"vllm-router==[\d.]+", (DEPLOY / "router" / "Dockerfile").read_text()).group(0)
    assert f'"{pin}"' in (ROOT / "pyproject.toml").read_text()


def test_router_flags_exist_in_the_installed_router():
    router = shutil.which("vllm-router", path=str(Path(sys.executable).parent)) or shutil.which("vllm-router")
    if router is None:
        pytest.skip("vllm-router is not installed (pip install kettle[scale])")
    help_text = subprocess.run([router, "--help"], capture_output=True, text=True, timeout=60).stdout
    compose = yaml.safe_load((DEPLOY / "docker-compose.yml").read_text())["services"]["router"]["command"]
    kube = kubernetes()[("Deployment", "kettle-router")]["spec"]["template"]["spec"]["containers"][0]["args"]
    entrypoint = re.search(r"ENTRYPOINT (\[.*\])", (DEPLOY / "router" / "Dockerfile").read_text()).group(1)
    for arg in [*compose, *kube, *yaml.safe_load(entrypoint)[1:]]:
        if arg.startswith("--"):
            assert arg in help_text, arg
