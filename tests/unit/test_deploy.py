"""The deployment files, checked offline: every Kubernetes manifest against the API schema
(kubernetes-validate, strict: unknown fields fail), and the links between them (labels,
ports, metric names, files) that no schema sees."""
from __future__ import annotations

import contextlib
import io
import json
import re
import shutil
import subprocess
from pathlib import Path

import kubernetes_validate
import pytest
import yaml

from cluster.frontdoor import main as frontdoor_main
from server.config import EdgeLimits
from server.http.drain import LAST_EVENTS_SECONDS

ROOT = Path(__file__).resolve().parents[2]
K8S = ROOT / "deploy" / "kubernetes"
DOCKER = ROOT / "docker"
K8S_VERSION = "1.33"


def manifests() -> list[Path]:
    return sorted(p for p in K8S.glob("*.yaml") if p.name != "kustomization.yaml")


def documents() -> list[dict]:
    return [d for p in manifests() for d in yaml.safe_load_all(p.read_text()) if d]


def find(kind: str, name: str) -> dict:
    return next(d for d in documents() if d["kind"] == kind and d["metadata"]["name"] == name)


def container(deployment: dict) -> dict:
    return deployment["spec"]["template"]["spec"]["containers"][0]


def frontdoor_output(argv: list[str]) -> str:
    """What `python -m cluster.frontdoor ARGV` prints."""
    out = io.StringIO()
    with contextlib.redirect_stdout(out):
        frontdoor_main(argv)
    return out.getvalue()


@pytest.mark.parametrize("doc", documents(), ids=lambda d: f"{d['kind']}/{d['metadata']['name']}")
def test_every_manifest_is_valid_against_the_kubernetes_schema(doc):
    kubernetes_validate.validate(doc, K8S_VERSION, strict=True)


def test_the_validator_rejects_a_misspelt_field():
    bad = json.loads(json.dumps(find("Deployment", "pagedllama")))
    bad["spec"]["replica"] = bad["spec"].pop("replicas")
    with pytest.raises(kubernetes_validate.ValidationError):
        kubernetes_validate.validate(bad, K8S_VERSION, strict=True)


def test_the_kustomization_applies_every_manifest():
    kustomization = yaml.safe_load((K8S / "kustomization.yaml").read_text())
    assert sorted(kustomization["resources"]) == [p.name for p in manifests()]


@pytest.mark.skipif(shutil.which("kubectl") is None, reason="kubectl is not installed")
def test_kubectl_builds_the_kustomization_offline():
    out = subprocess.run(["kubectl", "kustomize", str(K8S)], capture_output=True, text=True,
                         check=True).stdout
    assert len([d for d in yaml.safe_load_all(out) if d]) == len(documents())


def test_every_object_lives_in_the_pagedllama_namespace():
    for doc in documents():
        if doc["kind"] != "Namespace":
            assert doc["metadata"]["namespace"] == "pagedllama", doc["metadata"]["name"]


def test_replicas_request_exactly_their_cpu_limit_and_take_threads_from_it():
    c = container(find("Deployment", "pagedllama"))
    assert c["resources"]["requests"] == c["resources"]["limits"]
    threads = next(e for e in c["env"] if e["name"] == "PAGEDLLAMA_THREADS")
    ref = threads["valueFrom"]["resourceFieldRef"]
    assert (ref["resource"], ref["containerName"]) == ("limits.cpu", c["name"])


def test_replicas_are_ready_on_health_and_drain_within_the_grace_period():
    pod = find("Deployment", "pagedllama")["spec"]["template"]["spec"]
    c = pod["containers"][0]
    assert c["readinessProbe"]["httpGet"]["path"] == "/health"
    assert "livenessProbe" in c
    pre_stop = c["lifecycle"]["preStop"]["exec"]["command"]
    assert pre_stop[0] == "sleep"
    # The grace period counts from the preStop hook: the sleep, then the drain (server/http/drain.py:
    # PAGEDLLAMA_DRAIN_SECONDS, then up to 5 s for the ended requests' last events), then the
    # shutdown itself, which needs some room (10 s here) before Kubernetes sends SIGKILL.
    env = {e["name"]: e.get("value") for e in c["env"]}
    drain = float(env.get("PAGEDLLAMA_DRAIN_SECONDS") or EdgeLimits.drain_seconds)
    needed = int(pre_stop[1]) + drain + LAST_EVENTS_SECONDS + 10
    assert needed <= pod["terminationGracePeriodSeconds"]


def test_the_disruption_budget_covers_the_replica_pods():
    pdb = find("PodDisruptionBudget", "pagedllama")
    labels = find("Deployment", "pagedllama")["spec"]["template"]["metadata"]["labels"]
    assert pdb["spec"]["selector"]["matchLabels"].items() <= labels.items()


def test_the_router_config_is_the_one_the_launcher_writes_for_the_replicas_service():
    held = find("ConfigMap", "pagedllama-router")["data"]["haproxy.cfg"]
    command = held.splitlines()[0].removeprefix("# written by: python -m cluster.frontdoor ")
    assert held == frontdoor_output(command.split()), "regenerate it (command in router.yaml)"
    svc = find("Service", "pagedllama-replicas")
    assert svc["spec"]["clusterIP"] == "None"       # headless: one DNS record per ready pod
    name = f"{svc['metadata']['name']}.{svc['metadata']['namespace']}.svc.cluster.local"
    assert f"{name}:{svc['spec']['ports'][0]['port']}" in held
    replica = find("Deployment", "pagedllama")["spec"]["template"]
    assert svc["spec"]["selector"].items() <= replica["metadata"]["labels"].items()
    router = find("Deployment", "pagedllama-router")["spec"]["template"]["spec"]
    mount = router["containers"][0]["volumeMounts"][0]["mountPath"]
    assert router["containers"][0]["args"] == ["-f", f"{mount}/haproxy.cfg"]
    assert router["volumes"][0]["configMap"]["name"] == "pagedllama-router"


def test_every_replica_mounts_the_shared_volume_for_its_cache_and_state_dirs():
    pod = find("Deployment", "pagedllama")["spec"]["template"]["spec"]
    env = {e["name"]: e.get("value") for e in pod["containers"][0]["env"]}
    mount = next(m for m in pod["containers"][0]["volumeMounts"] if m["name"] == "shared")
    assert env["PAGEDLLAMA_CACHE_DIR"].startswith(mount["mountPath"] + "/")
    assert env["PAGEDLLAMA_STATE_DIR"].startswith(mount["mountPath"] + "/")
    claim = next(v for v in pod["volumes"] if v["name"] == "shared")["persistentVolumeClaim"]
    pvc = find("PersistentVolumeClaim", claim["claimName"])
    assert pvc["spec"]["accessModes"] == ["ReadWriteMany"]
    assert pod["securityContext"]["fsGroup"] == pod["securityContext"]["runAsUser"]


def test_the_service_in_front_selects_the_router():
    svc = find("Service", "pagedllama")
    router = find("Deployment", "pagedllama-router")["spec"]["template"]
    assert svc["spec"]["selector"].items() <= router["metadata"]["labels"].items()
    assert router["metadata"]["labels"]["app.kubernetes.io/component"] == "router"


def test_the_autoscaler_scales_on_the_adapters_name_for_waiting_requests():
    hpa = find("HorizontalPodAutoscaler", "pagedllama")
    assert hpa["spec"]["scaleTargetRef"]["name"] == "pagedllama"
    wanted = hpa["spec"]["metrics"][0]["pods"]["metric"]["name"]
    rules = yaml.safe_load(find("ConfigMap", "prometheus-adapter-rules")["data"]["config.yaml"])
    served = []
    for rule in rules["rules"]:
        series = re.match(r"'?([\w:]+)\{", rule["seriesQuery"]).group(1)
        served.append(re.sub(rule["name"]["matches"],
                             rule["name"]["as"].replace("${1}", r"\1"), series))
    assert wanted in served
    from server.metrics_state import PREFIX
    assert PREFIX == "pagedllama:"
    assert "\"num_requests_waiting\"" in (ROOT / "server" / "metrics_state.py").read_text()


def test_prometheus_scrapes_the_replicas_with_the_labels_the_adapter_needs():
    config = yaml.safe_load(find("ConfigMap", "prometheus-config")["data"]["prometheus.yml"])
    job = next(j for j in config["scrape_configs"] if j["job_name"] == "pagedllama")
    targets = {r.get("target_label") for r in job["relabel_configs"]}
    assert {"namespace", "pod"} <= targets
    keep = next(r for r in job["relabel_configs"] if r.get("action") == "keep")
    assert keep["regex"] == "replica"


def test_the_grafana_configmap_holds_the_dashboard_from_docker():
    held = find("ConfigMap", "grafana-dashboards")["data"]["pagedllama.json"]
    assert json.loads(held) == json.loads((DOCKER / "grafana-dashboard.json").read_text()), \
        "run: python scripts/grafana_configmap.py"


def test_compose_puts_the_router_in_front_of_both_replicas():
    compose = yaml.safe_load((DOCKER / "compose.yaml").read_text())
    services = compose["services"]
    mount = services["router"]["volumes"][0].split(":")
    held = (DOCKER / mount[0]).read_text()
    command = held.splitlines()[0].removeprefix("# written by: python -m cluster.frontdoor ")
    assert held == frontdoor_output(command.split())
    assert "replica-1:8000 replica-2:8000" in command
    assert {"replica-1", "replica-2", "router", "prometheus", "grafana"} <= services.keys()
    for name in ("replica-1", "replica-2"):   # one shared volume for the cache and the store
        assert services[name]["volumes"] == ["shared:/var/lib/pagedllama"]


def test_compose_mounts_and_builds_only_files_that_exist():
    compose = yaml.safe_load((DOCKER / "compose.yaml").read_text())
    for service in compose["services"].values():
        for volume in service.get("volumes", []):
            source = volume.split(":")[0]
            assert source in compose.get("volumes", {}) or (DOCKER / source).exists(), volume
        if "build" in service:
            assert (DOCKER / service["build"]["context"] / service["build"]["dockerfile"]).exists()
