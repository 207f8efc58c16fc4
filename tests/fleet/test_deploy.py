"""The fleet's deployment files: the Kubernetes manifests pass the Kubernetes API's own schemas
(kubernetes-validate, offline, strict: unknown fields refused) for a named version, custom
resources parse; the committed Envoy ConfigMaps are what deploy/envoy_config.py generates today
and their configs pass the real `envoy --mode validate`, as does every routing policy's config.
The keyed variant (deploy/kubernetes/keys/) is the base with the API keys' Secret mounted, and
nothing else; the Secret the generator prints passes the schemas and holds what each side reads."""

from __future__ import annotations

import importlib.util
import json
import os
import shlex
import subprocess
import sys
from pathlib import Path

import pytest
import yaml

from prefillonly.contract.tenants import API_KEY_FILTER, TENANT_HEADER
from prefillonly.serving.host.envoy_config import (AFFINITY_LB, OPEN_HTTP_PATHS, PICKER_CLUSTER, PICKER_DESTINATION_HEADER,
                                                   ROUTINGS, USER_HEADER, FrontDoor, Upstream, envoy_config, validate_config)

ROOT = Path(__file__).resolve().parents[2]
K8S = ROOT / "deploy" / "kubernetes"
KEYED = "keys"  # the folder of the keyed variant, under K8S
KEYS_DIR = "/etc/prefillonly/keys"  # where the keyed manifests mount the Secret
KUBERNETES_VERSION = "1.33.0"
CUSTOM_RESOURCES = {"monitoring.coreos.com/v1"}  # no schema in kubernetes-validate: parsed only


def _documents(folder: Path = K8S):
    for path in sorted(folder.glob("*.yaml")):
        for doc in yaml.safe_load_all(path.read_text()):
            if doc:
                yield path.name, doc


def _generator():
    """deploy/envoy_config.py as a module (deploy/ is no package)."""
    spec = importlib.util.spec_from_file_location("deploy_envoy_config", ROOT / "deploy" / "envoy_config.py")
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def test_manifests_pass_the_kubernetes_schemas():
    import kubernetes_validate

    kinds = []
    for name, doc in [*_documents(), *_documents(K8S / KEYED)]:
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


@pytest.mark.parametrize("name", ["envoy-configmap.yaml", "envoy-picker-configmap.yaml", f"{KEYED}/envoy-configmap-keys.yaml"])
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
    keys_file = shlex.split(command)[shlex.split(command).index("--api-keys-file") + 1] if KEYED in name else None
    _generator().validate(config, keys_file)  # with keys: reading a stand-in key file (the real one is in the pod)
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
    hashed = [USER_HEADER]
    if keys_file:  # the health checks open first; a user is a user of its tenant
        assert keys_file == f"{KEYS_DIR}/api-keys.json"
        opened = [r for r in routes if API_KEY_FILTER in r.get("typed_per_filter_config", {})]
        assert routes[: len(opened)] == opened and all(r["typed_per_filter_config"][API_KEY_FILTER]["disabled"] for r in opened)
        # Triton's health paths (the fleet door has no frontend of its own: /health is the replicas')
        assert [r["match"]["path"] for r in opened] == [p for p in OPEN_HTTP_PATHS if p.startswith("/v2/health/")]
        routes, hashed = routes[len(opened) :], [TENANT_HEADER, USER_HEADER]
    first = routes[0]
    assert first["match"]["headers"][0]["name"] == USER_HEADER
    assert first["route"]["hash_policy"] == [{"header": {"header_name": h}} for h in hashed]


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


def _keyed(kind: str, name: str) -> tuple[dict, dict]:
    """(the base manifest's resource, the keyed variant's) of one kind and name."""
    base = {(d["kind"], d["metadata"]["name"]): d for _, d in _documents()}
    keyed = {(d["kind"], d["metadata"]["name"]): d for _, d in _documents(K8S / KEYED)}
    return json.loads(json.dumps(base[(kind, name)])), keyed[(kind, name)]


def _secret_volume(pod: dict, entry: str) -> dict:
    volume = next(v for v in pod["volumes"] if "secret" in v)
    assert volume["secret"] == {"secretName": "prefillonly-api-keys", "optional": False, "items": [{"key": entry, "path": entry}]}
    return volume


def test_the_keyed_envoy_is_the_base_one_reading_the_keyed_config_and_the_secret():
    gen = _generator()
    base, keyed = _keyed("Deployment", "prefillonly-envoy")
    pod = keyed["spec"]["template"]["spec"]
    volume = _secret_volume(pod, gen.SECRET_ENVOY_FILE)
    container = base["spec"]["template"]["spec"]["containers"][0]
    container["volumeMounts"].append({"name": volume["name"], "mountPath": KEYS_DIR, "readOnly": True})
    base["spec"]["template"]["spec"]["volumes"] = [{"name": "config", "configMap": {"name": "prefillonly-envoy-keys"}}, volume]
    assert keyed == base
    configmaps = {d["metadata"]["name"] for _, d in _documents(K8S / KEYED) if d["kind"] == "ConfigMap"}
    assert configmaps == {"prefillonly-envoy-keys"}


def test_the_keyed_replicas_are_the_base_ones_with_the_key_file_that_serve_and_the_probe_read():
    from prefillonly.serving.host.probe import probe_key

    gen = _generator()
    base, keyed = _keyed("StatefulSet", "prefillonly-replica")
    pod = keyed["spec"]["template"]["spec"]
    volume = _secret_volume(pod, gen.SECRET_KEY_FILE)
    container = base["spec"]["template"]["spec"]["containers"][0]
    key_file = f"{KEYS_DIR}/{gen.SECRET_KEY_FILE}"
    container["env"] = [{"name": "PREFILLONLY_API_KEY_FILE", "value": key_file}]  # serve's --api-key-file, and the probe's
    container["volumeMounts"] = [{"name": volume["name"], "mountPath": KEYS_DIR, "readOnly": True}]
    base["spec"]["template"]["spec"]["volumes"] = [volume]
    assert keyed == base
    # the probe (unchanged command) sends the file's first key (test_the_secret_of_a_key_file...)
    assert probe_key({"PREFILLONLY_API_KEY_FILE": "/nonexistent"}) is None
    assert probe_key({"PREFILLONLY_PROBE_KEY": "k" * 16, "PREFILLONLY_API_KEYS": "a" * 16}) == "k" * 16
    assert probe_key({"PREFILLONLY_API_KEYS": f"{'a' * 16}, {'b' * 16}"}) == "a" * 16 and probe_key({}) is None


def test_the_liveness_probe_sends_its_key_and_says_when_one_is_wanted():
    import threading
    from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer

    from prefillonly.serving.host.probe import probe

    key = "probe-key-0123456789"

    class Door(BaseHTTPRequestHandler):  # the front door with keys, and an engine behind it that answers
        def do_POST(self):
            self.rfile.read(int(self.headers.get("content-length") or 0))
            keyed = self.headers.get("authorization") == f"Bearer {key}"
            body = json.dumps({"result_json": "{}"} if keyed else {"error": "unauthenticated: a missing or wrong API key"})
            self.send_response(200 if keyed else 401)
            self.send_header("content-length", str(len(body)))
            self.end_headers()
            self.wfile.write(body.encode())

        def log_message(self, *args):
            pass

    server = ThreadingHTTPServer(("127.0.0.1", 0), Door)
    threading.Thread(target=server.serve_forever, daemon=True).start()
    url = f"http://127.0.0.1:{server.server_address[1]}"
    try:
        assert probe(url, timeout=10, api_key=key) == (True, "HTTP 200: answered")
        alive, what = probe(url, timeout=10)
        assert not alive and what.startswith("HTTP 401: unauthenticated") and "--api-key" in what
    finally:
        server.shutdown()


def test_the_secret_of_a_key_file_holds_it_and_envoys_resource_of_it(tmp_path):
    import kubernetes_validate

    gen = _generator()
    key_file = tmp_path / "keys.txt"
    key_file.write_text("# the probe's tenant first\nprobe-key-0123456789 liveness\n"
                        "acme-key-0123456789a acme in_flight=4 rps=2.5\nacme-key-0123456789b acme   \n")
    done = subprocess.run([sys.executable, str(ROOT / "deploy" / "envoy_config.py"), "--secret-from-key-file", str(key_file),
                           "--secret", "prefillonly-api-keys", "--namespace", "prefillonly"],
                          capture_output=True, text=True, cwd=ROOT, timeout=60)
    assert done.returncode == 0, done.stderr
    secret = yaml.safe_load(done.stdout)
    kubernetes_validate.validate(secret, KUBERNETES_VERSION, strict=True)
    assert secret["metadata"] == {"name": "prefillonly-api-keys", "namespace": "prefillonly",
                                  "labels": {"app.kubernetes.io/name": "prefillonly"}}
    files = secret["stringData"]
    assert set(files) == {gen.SECRET_KEY_FILE, gen.SECRET_ENVOY_FILE}
    assert files[gen.SECRET_KEY_FILE] == key_file.read_text()  # as given, trailing spaces and all
    resource = json.loads(files[gen.SECRET_ENVOY_FILE])["resources"][0]
    assert resource["name"] == API_KEY_FILTER
    assert {c["key"]: c["client"] for c in resource["typed_config"]["credentials"]} == {
        "probe-key-0123456789": "liveness", "acme-key-0123456789a": "acme", "acme-key-0123456789b": "acme"}
    # the probe's key: the file's first
    from prefillonly.serving.host.probe import probe_key

    assert probe_key({"PREFILLONLY_API_KEY_FILE": str(key_file)}) == "probe-key-0123456789"


def test_a_bad_key_file_makes_no_secret_and_says_which_line(tmp_path):
    key_file = tmp_path / "keys.txt"
    key_file.write_text("good-key-0123456789 acme\ntoo-short acme\n")
    done = subprocess.run([sys.executable, str(ROOT / "deploy" / "envoy_config.py"), "--secret-from-key-file", str(key_file),
                           "--secret", "s"], capture_output=True, text=True, cwd=ROOT, timeout=60)
    assert done.returncode == 2 and not done.stdout
    assert f"{key_file}, line 2: an API key must be 16-256 characters" in done.stderr
    missing = subprocess.run([sys.executable, str(ROOT / "deploy" / "envoy_config.py"), "--secret-from-key-file", str(key_file)],
                             capture_output=True, text=True, cwd=ROOT, timeout=60)
    assert missing.returncode == 2 and "--secret NAME" in missing.stderr


def test_a_keyed_replica_behind_the_keyed_fleet_door_serves_what_the_door_let_in(tmp_path):
    # keys/envoy-keys.yaml in front of keys/replicas-keys.yaml: both check the same Secret's keys
    import threading
    import urllib.request
    from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer

    from prefillonly.contract.tenants import envoy_keys_resource, load_tenant_keys
    from prefillonly.serving.host.envoy import EnvoyProxy

    class Triton(BaseHTTPRequestHandler):  # answers 200 to everything (health checks too)
        def do_GET(self):
            self.send_response(200)
            self.send_header("content-length", "0")
            self.end_headers()

        def do_POST(self):
            self.rfile.read(int(self.headers.get("content-length") or 0))
            self.do_GET()

        def log_message(self, *args):
            pass

    key = "fleet-key-0123456789"
    (tmp_path / "keys.txt").write_text(f"{key} acme\n")
    (tmp_path / "api-keys.json").write_text(envoy_keys_resource(load_tenant_keys(key_file=tmp_path / "keys.txt"), "1"))
    keys_file = str(tmp_path / "api-keys.json")
    server = ThreadingHTTPServer(("127.0.0.1", 0), Triton)
    threading.Thread(target=server.serve_forever, daemon=True).start()
    port = server.server_address[1]
    replica_door = FrontDoor([Upstream("127.0.0.1", port, port, port)], http_port=0, grpc_port=0, api_keys_file=keys_file)
    try:
        with EnvoyProxy(replica_door).start().wait_ready(30) as replica:
            http, grpc = (int(url.rsplit(":", 1)[1]) for url in (replica.http_url, replica.grpc_url))
            fleet_door = FrontDoor([Upstream("127.0.0.1", http, grpc)], http_port=0, grpc_port=0, api_keys_file=keys_file,
                                   health_check_interval_s=0.2)
            with EnvoyProxy(fleet_door).start().wait_ready(30) as fleet:
                request = urllib.request.Request(f"{fleet.http_url}/v2/models/m/infer", data=b"{}",
                                                 headers={"Authorization": f"Bearer {key}"})
                status = _first_status(request)
    finally:
        server.shutdown()
    assert status == 200


def _first_status(request, attempts: int = 50) -> int:
    """The status of `request`, once the front door's health check has found its upstream (503 before)."""
    import time
    import urllib.error
    import urllib.request

    for _ in range(attempts):
        try:
            with urllib.request.urlopen(request, timeout=10) as r:
                return r.status
        except urllib.error.HTTPError as e:
            if e.code != 503:
                return e.code
        time.sleep(0.1)
    return 503
