"""Deployment artefacts, validated offline with the real tools: hadolint for the
Dockerfile, Compose v2 and the compose-spec schema for docker-compose.yml,
kustomize + Kubernetes schemas (strict) + the KEDA / Prometheus Operator CRD
models for deploy/k8s, Grafana's dashboard schema and promtool for the
dashboards (``make test`` installs the tools and generates the schema)."""

from __future__ import annotations

import json
import re
import shutil
import subprocess
import sys
from pathlib import Path

import kubernetes_validate
import pydantic
import pytest
import yaml
from cloudcoil.models.keda import v1alpha1 as keda
from cloudcoil.models.prometheus_operator import v1 as prometheus_operator
from prometheus_client import CollectorRegistry

from dashboards.render import panels, promql
from service.controller.loop import ControllerMetrics
from service.metrics import Metrics

ROOT = Path(__file__).resolve().parents[1]
BIN = Path(sys.executable).parent
DASHBOARD = ROOT / "dashboards" / "dflash.json"
GRAFANA_SCHEMA = ROOT / "build" / "grafana-dashboard.schema.json"
KUSTOMIZATIONS = ("base", "overlays/gpu", "alternatives/hpa")
KUBERNETES_VERSION = "1.30.0"
CRD_MODELS = {
    ("keda.sh/v1alpha1", "ScaledObject"): keda.ScaledObject,
    ("monitoring.coreos.com/v1", "PodMonitor"): prometheus_operator.PodMonitor,
}


def run(*command: str | Path, **kwargs) -> subprocess.CompletedProcess:
    return subprocess.run([str(c) for c in command], capture_output=True, text=True, cwd=ROOT, **kwargs)


def exported_metric_names() -> set[str]:
    """Every sample name the service and the controller export."""
    registry = CollectorRegistry()
    Metrics(registry)
    ControllerMetrics(registry)
    names = set()
    for family in registry.collect():
        kind = family.type
        suffixes = {"counter": ("_total",), "histogram": ("_bucket", "_sum", "_count"), "gauge": ("",)}[kind]
        names.update(family.name + s for s in suffixes)
    return names


# ------------------------------------------------------------------ images


def test_dockerfile_passes_hadolint():
    result = run(BIN / "hadolint", "--no-color", "Dockerfile")
    assert result.returncode == 0, result.stdout + result.stderr


def test_images_run_as_non_root_with_health_checks():
    stages = re.split(r"^FROM ", (ROOT / "Dockerfile").read_text(), flags=re.M)[1:]
    final = {s.split()[2]: s for s in stages if " AS " in s.splitlines()[0]}
    for name in ("cpu", "gpu", "gateway"):
        assert re.search(r"^USER 10001$", final[name], re.M), name
        assert "HEALTHCHECK" in final[name], name
    assert stages[-1].splitlines()[0].endswith("AS cpu"), "cpu must be the default (last) stage"


# ----------------------------------------------------------------- compose


@pytest.mark.parametrize("profiles", [(), ("gpu", "load")])
def test_compose_file_is_valid_compose_v2(profiles):
    flags = [arg for p in profiles for arg in ("--profile", p)]
    result = run(BIN / "docker-compose", "-f", "docker-compose.yml", *flags, "config", "--format", "json")
    assert result.returncode == 0, result.stderr
    services = json.loads(result.stdout)["services"]
    assert {"dflash", "prometheus", "grafana"} <= set(services)
    assert set(profiles) <= {p for s in services.values() for p in s.get("profiles", [])}
    grafana_mounts = {v["target"] for v in services["grafana"]["volumes"]}
    assert {"/etc/grafana/provisioning", "/var/lib/grafana/dashboards"} <= grafana_mounts


def test_compose_file_matches_the_compose_spec_schema():
    result = run(BIN / "check-jsonschema", "--builtin-schema", "vendor.compose-spec", "docker-compose.yml")
    assert result.returncode == 0, result.stdout + result.stderr


def test_prometheus_config_is_valid():
    promtool = shutil.which("promtool")
    if promtool is None:
        pytest.skip("needs promtool (make test installs Debian's prometheus)")
    result = run(promtool, "check", "config", "deploy/prometheus/prometheus.yml")
    assert result.returncode == 0, result.stdout + result.stderr


# -------------------------------------------------------------- kubernetes


def rendered(kustomization: str) -> list[dict]:
    result = run("kubectl", "kustomize", f"deploy/k8s/{kustomization}")
    assert result.returncode == 0, result.stderr
    return [doc for doc in yaml.safe_load_all(result.stdout) if doc]


def unknown_fields(obj: object, model: type, path: str = "$") -> list[str]:
    """Keys the CRD model does not define (its pydantic models allow extras,
    like the API server's pruning; a typo would be silently dropped there)."""
    if not isinstance(obj, dict) or not (isinstance(model, type) and issubclass(model, pydantic.BaseModel)):
        return []
    fields = {f.alias or name: f for name, f in model.model_fields.items()}
    found = []
    for key, value in obj.items():
        if key not in fields:
            found.append(f"{path}.{key}")
            continue
        annotation = fields[key].annotation
        for candidate in (annotation, *getattr(annotation, "__args__", ())):
            for inner in (candidate, *getattr(candidate, "__args__", ())):
                if isinstance(inner, type) and issubclass(inner, pydantic.BaseModel):
                    items = value if isinstance(value, list) else [value]
                    for item in items:
                        found += unknown_fields(item, inner, f"{path}.{key}")
    return found


@pytest.mark.skipif(shutil.which("kubectl") is None, reason="needs kubectl (kustomize is built in)")
@pytest.mark.parametrize("kustomization", KUSTOMIZATIONS)
def test_manifests_validate_against_kubernetes_and_crd_schemas(kustomization):
    docs = rendered(kustomization)
    for doc in docs:
        model = CRD_MODELS.get((doc["apiVersion"], doc["kind"]))
        if model is None:
            kubernetes_validate.validate(doc, KUBERNETES_VERSION, strict=True)
        else:
            model.model_validate(doc)
            assert unknown_fields({k: v for k, v in doc.items() if k != "metadata"}, model) == []
    kinds = {(d["kind"], d["metadata"]["name"]) for d in docs}
    assert {
        ("Deployment", "dflash-serve"),
        ("Deployment", "dflash-gateway"),
        ("Deployment", "dflash-controller"),
        ("PodMonitor", "dflash-serve"),
        ("Role", "dflash-gateway"),
    } <= kinds
    scaler = (
        ("ScaledObject", "dflash-serve")
        if kustomization != "alternatives/hpa"
        else ("HorizontalPodAutoscaler", "dflash-serve")
    )
    assert scaler in kinds


def deployment(docs: list[dict], name: str) -> dict:
    return next(d for d in docs if d["kind"] == "Deployment" and d["metadata"]["name"] == name)


@pytest.mark.skipif(shutil.which("kubectl") is None, reason="needs kubectl (kustomize is built in)")
def test_replicas_have_probes_and_the_gpu_overlay_asks_for_a_gpu():
    for kustomization, gpu in (("base", False), ("overlays/gpu", True)):
        serve = deployment(rendered(kustomization), "dflash-serve")
        container = serve["spec"]["template"]["spec"]["containers"][0]
        assert {"startupProbe", "livenessProbe", "readinessProbe", "resources"} <= set(container)
        assert container["readinessProbe"]["httpGet"]["path"] == "/ready"
        env = {e["name"]: e.get("value") for e in container["env"]}
        assert env["DFLASH_CONTROLLER"] == "false"  # the controller Deployment drives every replica
        assert ("nvidia.com/gpu" in container["resources"]["limits"]) == gpu
        assert (env.get("DFLASH_ENGINE") == "sglang") == gpu


@pytest.mark.skipif(shutil.which("kubectl") is None, reason="needs kubectl (kustomize is built in)")
def test_autoscaling_and_controller_queries_use_exported_metrics():
    exported = exported_metric_names()
    docs = rendered("base")
    scaler = next(d for d in docs if d["kind"] == "ScaledObject")
    queries = [t["metadata"]["query"] for t in scaler["spec"]["triggers"]]
    controller = deployment(docs, "dflash-controller")
    queries += [
        a.split("=", 1)[1]
        for a in controller["spec"]["template"]["spec"]["containers"][0]["command"]
        if a.startswith("--discover-replicas=")
    ]
    for query in queries:
        names = set(re.findall(r"\b(dflash_[a-z0-9_]+)", query))
        assert names <= exported, (query, names - exported)


# -------------------------------------------------------------- dashboards


def dashboard_targets() -> list[dict]:
    return [t for p in panels() for t in p["targets"]]


def test_dashboard_matches_grafanas_schema():
    if not GRAFANA_SCHEMA.exists():
        pytest.fail(f"{GRAFANA_SCHEMA} missing: run `make deploy-schemas` (make test does)")
    result = run(BIN / "check-jsonschema", "--schemafile", GRAFANA_SCHEMA, DASHBOARD)
    assert result.returncode == 0, result.stdout + result.stderr


def test_dashboard_panels_are_well_formed():
    dashboard = json.loads(DASHBOARD.read_text())
    panels = dashboard["panels"]
    assert len({p["id"] for p in panels}) == len(panels)
    for p in panels:
        assert p["gridPos"]["x"] + p["gridPos"]["w"] <= 24
        if p["type"] != "row":
            assert p["targets"] and p["datasource"]["uid"] == "${datasource}"
            assert all(t["refId"] and t["expr"] for t in p["targets"])
    variables = {v["name"] for v in dashboard["templating"]["list"]}
    assert {"datasource", "model", "instance"} <= variables
    assert all('model=~"$model"' in t["expr"] and 'instance=~"$instance"' in t["expr"] for t in dashboard_targets())


def test_dashboard_queries_use_only_exported_metrics():
    exported = exported_metric_names()
    used = {name for t in dashboard_targets() for name in re.findall(r"\b(dflash_[a-z0-9_]+)", t["expr"])}
    assert used <= exported, used - exported
    assert len(used) >= 15


def test_dashboard_queries_parse():
    promtool = shutil.which("promtool")
    if promtool is None:
        pytest.skip("needs promtool (make test installs Debian's prometheus)")
    rules = {
        "groups": [
            {
                "name": "dashboard",
                "rules": [
                    {"record": f"dashboard:query_{i}", "expr": promql(t["expr"])}
                    for i, t in enumerate(dashboard_targets())
                ],
            }
        ]
    }
    path = ROOT / "build" / "dashboard-queries.rules.yml"
    path.parent.mkdir(exist_ok=True)
    path.write_text(yaml.safe_dump(rules))
    result = run(promtool, "check", "rules", path)
    assert result.returncode == 0, result.stdout + result.stderr
