"""The fleet's deployment files: the Kubernetes manifests pass the Kubernetes API's own schemas
(kubernetes-validate, offline, strict: unknown fields refused) for a named version, custom
resources parse; the committed Envoy ConfigMap is what deploy/envoy_config.py generates today
and its config passes the real `envoy --mode validate`, as does every routing policy's config."""

from __future__ import annotations

import json
import shlex
import subprocess
import sys
from pathlib import Path

import pytest
import yaml

from prefillonly.serving.host.envoy_config import (AFFINITY_LB, PICKER_CLUSTER, PICKER_DESTINATION_HEADER, ROUTINGS,
                                                   USER_HEADER, FrontDoor, Upstream, envoy_config, validate_config)

ROOT = Path(__file__).resolve().parents[2]
K8S = ROOT / "deploy" / "kubernetes"
KUBERNETES_VERSION = "1.33.0"
CUSTOM_RESOURCES = {"monitoring.coreos.com/v1"}  # no schema in kubernetes-validate: parsed only


def _documents():
    for path in sorted(K8S.glob("*.yaml")):
        for doc in yaml.safe_load_all(path.read_text()):
            if doc:
                yield path.name, doc


def test_manifests_pass_the_kubernetes_schemas():
    import kubernetes_validate

    kinds = []
    for name, doc in _documents():
        kinds.append(doc["kind"])
        if doc["apiVersion"] in CUSTOM_RESOURCES:
            assert doc["metadata"]["name"] and doc["spec"], name
            continue
        kubernetes_validate.validate(doc, KUBERNETES_VERSION, strict=True)
    for kind in ("StatefulSet", "Service", "Deployment", "ConfigMap", "HorizontalPodAutoscaler", "PodDisruptionBudget",
                 "ServiceMonitor"):
        assert kind in kinds, kind


def test_a_broken_manifest_is_refused():
    import kubernetes_validate

    doc = next(d for _, d in _documents() if d["kind"] == "StatefulSet")
    doc = json.loads(json.dumps(doc))
    doc["spec"]["replicas"] = "three"
    with pytest.raises(kubernetes_validate.ValidationError):
        kubernetes_validate.validate(doc, KUBERNETES_VERSION, strict=True)


def test_replicas_are_one_gpu_each_with_the_probes_and_the_headless_service_envoy_resolves():
    docs = {(d["kind"], d["metadata"]["name"]): d for _, d in _documents()}
    pod = docs[("StatefulSet", "prefillonly-replica")]["spec"]["template"]["spec"]
    triton = pod["containers"][0]
    assert triton["resources"]["limits"]["nvidia.com/gpu"] == 1
    assert triton["readinessProbe"]["httpGet"]["path"] == "/v2/health/ready"
    assert "probe" in triton["livenessProbe"]["exec"]["command"]
    # the scoring frontend (started by serve in the pod) calls back through the fleet's Envoy Service
    upstream = triton["args"][triton["args"].index("--frontend-upstream") + 1]
    service = docs[("Service", "prefillonly")]
    grpc_port = next(p["port"] for p in service["spec"]["ports"] if p["name"] == "grpc")
    assert upstream == f"{service['metadata']['name']}.{service['metadata']['namespace']}.svc.cluster.local:{grpc_port}"
    assert pod["terminationGracePeriodSeconds"] >= 120
    assert docs[("Service", "prefillonly-replicas")]["spec"]["clusterIP"] == "None"
    hpa = docs[("HorizontalPodAutoscaler", "prefillonly-replica")]["spec"]
    assert hpa["metrics"][0]["pods"]["metric"]["name"] == "prefillonly_waiting_requests"


@pytest.mark.parametrize("name", ["envoy-configmap.yaml", "envoy-picker-configmap.yaml"])
def test_the_committed_envoy_configmap_is_what_the_generator_makes_and_envoy_accepts_it(name):
    path = K8S / name
    command = path.read_text().splitlines()[1].removeprefix("# ")
    args = shlex.split(command)[2:]  # after "python deploy/envoy_config.py"
    fresh = subprocess.run([sys.executable, str(ROOT / "deploy" / "envoy_config.py"), *args], capture_output=True, text=True,
                           cwd=ROOT, timeout=120)
    assert fresh.returncode == 0, fresh.stderr
    committed = yaml.safe_load(path.read_text())
    assert yaml.safe_load(fresh.stdout) == committed, "regenerate it: " + command
    config = json.loads(committed["data"]["envoy.json"])
    validate_config(config)
    clusters = {c["name"]: c for c in config["static_resources"]["clusters"]}
    assert clusters["triton_http_affinity"]["type"] == "STRICT_DNS" and clusters["triton_http_affinity"]["lb_policy"] == "MAGLEV"
    routes = config["static_resources"]["listeners"][0]["filter_chains"][0]["filters"][0]["typed_config"]["route_config"]
    routes = routes["virtual_hosts"][0]["routes"]
    if "picker" in name:  # the picker's choice first, then the routes it falls back to
        assert routes[0]["match"]["headers"][0]["name"] == PICKER_DESTINATION_HEADER
        assert clusters[routes[0]["route"]["cluster"]]["type"] == "ORIGINAL_DST"
        picker = clusters[PICKER_CLUSTER]["load_assignment"]["endpoints"][0]["lb_endpoints"][0]["endpoint"]["address"]
        docs = {(d["kind"], d["metadata"]["name"]): d for _, d in _documents()}
        service = docs[("Service", "prefillonly-picker")]
        assert picker["socket_address"] == {"address": f"prefillonly-picker.{service['metadata']['namespace']}.svc.cluster.local",
                                            "port_value": service["spec"]["ports"][0]["port"]}
        routes = routes[1:]
    first = routes[0]
    assert first["match"]["headers"][0]["name"] == USER_HEADER
    assert first["route"]["hash_policy"] == [{"header": {"header_name": USER_HEADER}}]


@pytest.mark.parametrize("routing", ROUTINGS)
def test_every_routing_policy_makes_a_config_envoy_accepts(routing):
    upstreams = [Upstream("127.0.0.1", 8100 + 10 * i, 8101 + 10 * i) for i in range(3)]
    for lb in AFFINITY_LB if routing == "affinity" else AFFINITY_LB[:1]:
        validate_config(envoy_config(FrontDoor(upstreams, routing=routing, affinity_lb=lb)))


def test_front_door_refuses_bad_routing_settings():
    up = [Upstream("127.0.0.1", 1, 2)]
    for bad in (dict(routing="sticky"), dict(affinity_lb="ROUND_ROBIN"), dict(hash_balance_factor=99), dict(retries=-1)):
        with pytest.raises(ValueError):
            FrontDoor(up, **bad)


def test_the_picker_deployment_parses_with_the_replicas_block_size():
    # the picker hashes prompts into the replicas' block keys: its --block-size must be the engine's
    from prefillonly.config import EngineConfig
    from prefillonly.serving.picker.__main__ import build_parser

    docs = {(d["kind"], d["metadata"]["name"]): d for _, d in _documents()}
    container = docs[("Deployment", "prefillonly-picker")]["spec"]["template"]["spec"]["containers"][0]
    command = container.get("command", []) + container.get("args", [])
    args = build_parser().parse_args(command[command.index("prefillonly.serving.picker") + 1 :])
    assert args.block_size == EngineConfig.default_of("cache_block_size")
