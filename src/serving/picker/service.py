"""The endpoint picker as a process: Envoy's external-processing (ext_proc) gRPC service.

    python -m prefillonly.serving.picker --port 9002 --members-file members.json

Envoy's HTTP listener calls it on each request to Triton's model routes: on the headers, and for a
request with a body on the body too (buffered), so that the prompt's token ids give its prefix
blocks. It answers with the chosen replica in DESTINATION_HEADER, the header the Gateway API
Inference Extension's endpoint pickers set, and Envoy routes the request to that address (an
ORIGINAL_DST cluster reading the header: envoy_config.py, FrontDoor.picker). A request it cannot
read (no JSON `input_ids`) is picked on its user alone (a one-token prompt to the model).

Whose cache a request reads: its user's within its tenant. With API keys on, Envoy's key filter
sets TENANT_HEADER from the key before the picker's filter runs (envoy_config._connection_manager),
and the engine keeps each tenant's cache apart; so does the picker, naming a request's cache by the
engine's rule (contract.tenants.tenant_namespace): the same user name of two tenants is two users,
their prefixes two chains.

What the picker knows of the replicas (choice.py): the members (a members file, a JSON list of
{"key", "destination", "metrics_url"} that LocalFleet rewrites, or on Kubernetes the replicas'
headless Service name, reresolved; either reread every report interval, so membership follows the
fleet) and each member's Prometheus metrics, scraped every `report_interval_s`
(`prefillonly_queued_work_seconds`, `prefillonly_jct_coefficient`); a member whose scrape fails
`max_scrape_failures` times in a row leaves the set until it answers again.

Every decision is appended to `decisions_log` (JSON lines: time, user, tenant, prompt tokens, the
chosen key and destination, each member's predicted seconds, the report's age, the microseconds the
decision took): what the tests check the routed replica against and what the benchmark reads.
"""

from __future__ import annotations

import json
import socket
import threading
import time
from collections.abc import Iterator
from pathlib import Path

from ...contract.block_keys import block_hashes, namespace_root
from ...contract.jct import JctCoefficients
from ...contract.tenants import TENANT_HEADER, tenant_namespace
from ...contract.wire import USER_HEADER
from ..host.prometheus import by_series, scrape
from .choice import Picker

DESTINATION_HEADER = "x-gateway-destination-endpoint"
PICKED_HEADER = "x-prefillonly-picked"  # on the request to the replica: the picker chose it (not Maglev)
_NAMESPACE_MODEL = "picker"  # block keys need only be equal for equal prefixes, within the picker


class Members:
    """The fleet's members as the members file lists them: key -> (destination, metrics_url)."""

    def __init__(self, path: str | Path):
        self.path = Path(path)
        self.by_key: dict[str, tuple[str, str]] = {}

    def reload(self) -> bool:
        """Reread the file; True if the members changed. A missing or half-written file keeps the last."""
        try:
            listed = json.loads(self.path.read_text())
            by_key = {m["key"]: (m["destination"], m["metrics_url"]) for m in listed}
        except (OSError, ValueError, KeyError, TypeError):
            return False
        changed = by_key != self.by_key
        self.by_key = by_key
        return changed


class DnsMembers(Members):
    """The members as one DNS name resolves (a Kubernetes headless Service: one A record per ready
    replica pod), reresolved at every reload; each address's HTTP and metrics ports are given."""

    def __init__(self, name: str, http_port: int, metrics_port: int):
        self.name, self.http_port, self.metrics_port = name, http_port, metrics_port
        self.by_key = {}

    def reload(self) -> bool:
        try:
            infos = socket.getaddrinfo(self.name, self.http_port, socket.AF_INET, socket.SOCK_STREAM)
        except OSError:
            return False  # a resolver hiccup keeps the last members (their scrapes decide)
        ips = sorted({info[4][0] for info in infos})
        by_key = {f"{ip}:{self.http_port}": (f"{ip}:{self.http_port}", f"http://{ip}:{self.metrics_port}/metrics") for ip in ips}
        changed = by_key != self.by_key
        self.by_key = by_key
        return changed


def coefficients_of(values: dict[str, float]) -> JctCoefficients | None:
    terms = [values.get(f'prefillonly_jct_coefficient{{term="{t}"}}', 0.0) for t in ("fixed_s", "per_token_s", "attention_s")]
    return JctCoefficients(*terms) if any(terms) else None


class PickerState:
    """The Picker, its members and its reports, behind one lock (gRPC serves on many threads)."""

    def __init__(self, picker: Picker, members: Members, report_interval_s: float, max_scrape_failures: int = 3,
                 decisions_log: str | Path | None = None):
        self.picker, self.members = picker, members
        self.report_interval_s, self.max_scrape_failures = report_interval_s, max_scrape_failures
        self.lock = threading.Lock()
        self._failures: dict[str, int] = {}
        self._log = open(decisions_log, "a", buffering=1) if decisions_log else None  # noqa: SIM115 (closed in close())
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._report_loop, name="picker-reports", daemon=True)

    def start(self) -> "PickerState":
        self.refresh()
        self._thread.start()
        return self

    def close(self) -> None:
        self._stop.set()
        if self._thread.is_alive():  # never started: nothing to wait for
            self._thread.join(5)
        if self._log:
            self._log.close()

    def _report_loop(self) -> None:
        while not self._stop.wait(self.report_interval_s):
            self.refresh()

    def refresh(self) -> None:
        """Reread the members, scrape each, and hand the picker the live ones' reports."""
        self.members.reload()
        live, reports = [], []
        for key, (_, metrics_url) in self.members.by_key.items():
            try:
                values = by_series(scrape(metrics_url, timeout_s=max(0.5, self.report_interval_s)), ("prefillonly_",))
            except Exception:  # refused, timed out, not Prometheus text: a failure either way
                self._failures[key] = self._failures.get(key, 0) + 1
                if self._failures[key] < self.max_scrape_failures and key in self.picker.replicas:
                    live.append(key)
                continue
            self._failures[key] = 0
            live.append(key)
            reports.append((key, values.get("prefillonly_queued_work_seconds", 0.0), coefficients_of(values)))
        now = time.monotonic()
        with self.lock:
            self.picker.set_members(live)
            for key, queued, coef in reports:
                self.picker.report(key, queued, coef, now)

    def decide(self, user: str | None, prompt_ids: list[int] | None, tenant: str | None = None) -> str | None:
        """The destination (host:port) of a request of `user` (of `tenant`, with API keys); None
        when no member is live."""
        started = time.perf_counter()
        tokens = len(prompt_ids) if prompt_ids else 1
        root = namespace_root(_NAMESPACE_MODEL, tenant_namespace(tenant, user))
        keys = block_hashes(prompt_ids, self.picker.block_size, root) if prompt_ids else []
        now = time.monotonic()
        with self.lock:
            if not self.picker.replicas:
                return None
            choice = self.picker.pick(None if user is None else (tenant, user), keys, tokens, now)
            view = self.picker.replicas[choice.replica]
            age = None if view.reported_at is None else now - view.reported_at
            destination = self.members.by_key[choice.replica][0]
            if self._log:
                self._log.write(json.dumps({"t": time.time(), "user": user, "tenant": tenant, "prompt_tokens": tokens,
                                            "key": choice.replica,
                                            "destination": destination, "cached_blocks": choice.cached_blocks,
                                            "predicted_s": choice.predicted_s, "report_age_s": age,
                                            "decide_us": (time.perf_counter() - started) * 1e6}) + "\n")
        return destination


def prompt_ids_of(body: bytes) -> list[int] | None:
    """The token ids of a generate-style JSON body ({"input_ids": [...]}), else None."""
    try:
        data = json.loads(body)
    except ValueError:
        return None
    ids = data.get("input_ids") if isinstance(data, dict) else None
    if isinstance(ids, list) and ids and all(isinstance(i, int) and not isinstance(i, bool) for i in ids):
        return ids
    return None


def header_map(http_headers) -> dict[str, str]:
    """Envoy's HeaderMap as {lower-case name: value} (its values come as raw_value bytes)."""
    out = {}
    for h in http_headers.headers.headers:
        out[h.key.lower()] = h.raw_value.decode("utf-8", "replace") if h.raw_value else h.value
    return out


def servicer(state: PickerState):
    """The ExternalProcessor servicer over `state` (the generated classes imported here: only the
    picker process needs Envoy's protos)."""
    from envoy.config.core.v3 import base_pb2
    from envoy.service.ext_proc.v3 import external_processor_pb2 as pb
    from envoy.service.ext_proc.v3 import external_processor_pb2_grpc as pb_grpc

    def routed(headers: dict, body: bytes | None):
        """The CommonResponse that routes the request: the destination set (and the route
        recomputed), or nothing changed (Envoy's own routing) for what the picker does not pick."""
        if headers.get(":method") != "POST":
            return pb.CommonResponse()
        destination = state.decide(headers.get(USER_HEADER) or None, prompt_ids_of(body) if body else None,
                                   tenant=headers.get(TENANT_HEADER) or None)
        if destination is None:
            return pb.CommonResponse()
        overwrite = base_pb2.HeaderValueOption.HeaderAppendAction.OVERWRITE_IF_EXISTS_OR_ADD
        sets = [base_pb2.HeaderValueOption(header=base_pb2.HeaderValue(key=name, raw_value=value.encode()), append_action=overwrite)
                for name, value in ((DESTINATION_HEADER, destination), (PICKED_HEADER, "1"))]
        return pb.CommonResponse(header_mutation=pb.HeaderMutation(set_headers=sets), clear_route_cache=True)

    class Service(pb_grpc.ExternalProcessorServicer):
        def Process(self, request_iterator: Iterator, context) -> Iterator:
            """One request's stream, closed (cleanly) as soon as it is routed: Envoy then goes on
            without the picker. Left open, a stream would hold one of the server's worker threads
            until the request's response was sent, seconds to minutes later, and with more
            requests in flight than workers the next ones would wait past Envoy's message
            timeout and fall back to Maglev unpicked (seen: half the requests of a bursty run)."""
            headers: dict = {}
            for message in request_iterator:
                kind = message.WhichOneof("request")
                if kind == "request_headers":
                    headers = header_map(message.request_headers)
                    if message.request_headers.end_of_stream:  # no body: pick on the headers
                        yield pb.ProcessingResponse(request_headers=pb.HeadersResponse(response=routed(headers, None)))
                        return
                    yield pb.ProcessingResponse(request_headers=pb.HeadersResponse())  # the body follows (buffered): pick then
                elif kind == "request_body":
                    yield pb.ProcessingResponse(request_body=pb.BodyResponse(response=routed(headers, message.request_body.body)))
                    return
                else:  # the filter's processing mode sends nothing else; answer "unchanged" if it does
                    yield pb.ProcessingResponse(**{kind: pb.HeadersResponse() if kind.endswith("headers") else pb.BodyResponse()})

    return Service(), pb_grpc.add_ExternalProcessorServicer_to_server
