"""deploy/: the compose file and Kubernetes manifests lint clean, and keep the probes and budget they promise."""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

import kubernetes_validate
import yaml

ROOT = Path(__file__).resolve().parents[1]
DEPLOY = ROOT / "deploy"
MANIFESTS = sorted((DEPLOY / "k8s").glob("*.yaml"))


def test_yaml_lints_clean() -> None:
    """yamllint passes on the compose file and every manifest (deploy/.yamllint.yaml)."""
    result = subprocess.run(
        [sys.executable, "-m", "yamllint", "-c", str(DEPLOY / ".yamllint.yaml"), "compose.yaml", "k8s"],
        cwd=DEPLOY,
        capture_output=True,
        text=True,
        check=False,
        timeout=60,
    )
    assert result.returncode == 0, result.stdout + result.stderr


def test_manifests_validate_against_the_kubernetes_schema() -> None:
    """Every manifest validates strictly against the Kubernetes 1.37 schema (kubernetes-validate)."""
    for path in MANIFESTS:
        for doc in yaml.safe_load_all(path.read_text()):
            kubernetes_validate.validate(doc, "1.37.0", strict=True)


def test_replicas_have_probes_resources_and_a_disruption_budget() -> None:
    """The StatefulSet probes /healthz and /readyz with resources set, and a PDB keeps 2 of 3 replicas up."""
    docs = [doc for path in MANIFESTS for doc in yaml.safe_load_all(path.read_text())]
    kinds = {doc["kind"]: doc for doc in docs}
    pod = kinds["StatefulSet"]["spec"]["template"]["spec"]["containers"][0]
    assert pod["livenessProbe"]["httpGet"]["path"] == "/healthz"
    assert pod["readinessProbe"]["httpGet"]["path"] == "/readyz"
    assert pod["resources"]["requests"]["cpu"]
    assert pod["resources"]["limits"]["memory"]
    assert kinds["StatefulSet"]["spec"]["replicas"] == 3
    assert kinds["PodDisruptionBudget"]["spec"]["minAvailable"] == 2
    assert "Service" in kinds
    annotations = kinds["Ingress"]["metadata"]["annotations"]
    assert annotations["nginx.ingress.kubernetes.io/upstream-hash-by"] == "$http_x_memory_user"


def test_compose_runs_three_replicas_on_object_storage_behind_nginx() -> None:
    """The compose file has 3 replicas on one s3:// store, an S3-compatible server and nginx with the shipped config."""
    compose = yaml.safe_load((DEPLOY / "compose.yaml").read_text())
    services = compose["services"]
    replicas = [name for name in services if name.startswith("memproxy-")]
    assert len(replicas) == 3
    for name in replicas:
        assert services[name]["environment"]["MEMPROXY_STORAGE__URI"].startswith("s3://")
    assert "minio" in services
    assert "./nginx/memproxy.conf:/etc/nginx/conf.d/default.conf:ro" in services["router"]["volumes"]
    assert "hash $memproxy_user consistent;" in (DEPLOY / "nginx" / "memproxy.conf").read_text()
