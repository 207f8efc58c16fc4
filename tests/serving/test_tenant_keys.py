"""API keys, tenants and quotas without a server: the key file's rules and errors, the files the serve
command hands to Envoy and the model (and their reload), the model's per-tenant admission on a
fake clock, the tenant taken from a request's parameters, the generate passthrough's body rewrite,
and the front door's config with keys (checked by the real `envoy --mode validate`)."""

from __future__ import annotations

import json
import os

import pytest

from prefillonly.contract.errors import RateLimitedError
from prefillonly.contract.tenants import (DEFAULT_TENANT, TENANT_HEADER, Quota, TenantConfigError, envoy_keys_config,
                                          load_tenant_keys, parse_quota, read_tenants, retry_after_of, tenant_of_parameters,
                                          tenants_json, write_atomically)
from prefillonly.frontend.generate import with_tenant
from prefillonly.serving.host.api_keys import KeyFiles
from prefillonly.serving.host.envoy_config import (GENERATE_ROUTE, OPEN_GRPC_PATHS, OPEN_HTTP_PATHS, FrontDoor, Upstream,
                                                   envoy_config, validate_config)
from prefillonly.serving.model.tenant_gate import RELOAD_CHECK_S, TenantGate

KEY_A, KEY_B = "alpha-key-0123456789", "beta-key-0123456789ab"


def key_file(tmp_path, text: str):
    path = tmp_path / "keys.txt"
    path.write_text(text)
    return path


# -- the key file -------------------------------------------------------------------------------------
def test_a_key_file_maps_keys_to_tenants_with_their_quotas(tmp_path):
    path = key_file(tmp_path, f"# team keys\n\n{KEY_A} alpha in_flight=2 rps=5.5  # alpha's\n{KEY_B} beta\n")
    keys = load_tenant_keys(["gamma-key-0123456789"], path, default_quota=Quota(in_flight=9))
    assert keys.keys == {KEY_A: "alpha", KEY_B: "beta", "gamma-key-0123456789": DEFAULT_TENANT}
    assert keys.quota_of("alpha") == Quota(in_flight=2, rps=5.5)
    assert keys.quota_of("beta") == Quota(in_flight=9)  # the default quota
    assert keys.tenants() == ["alpha", "beta", "default"]


def test_no_keys_at_all_is_an_open_server_and_says_none():
    assert load_tenant_keys() is None


@pytest.mark.parametrize("text, problem", [
    ("short alpha\n", "line 1: an API key must be 16-256 characters"),
    (f"{KEY_A}\n", "line 1: expected `KEY TENANT"),
    (f"{KEY_A} al/pha\n", "line 1: tenant name 'al/pha'"),
    (f"{KEY_A} alpha\n{KEY_A} beta\n", "line 2: this key is already tenant 'alpha'"),
    (f"{KEY_A} alpha rps=1\n{KEY_B} alpha rps=2\n", "line 2: tenant 'alpha' already has quota"),
    (f"{KEY_A} alpha burst=3\n", "line 1: 'burst=3' is not one of in_flight=N, rps=N"),
    (f"{KEY_A} alpha in_flight=0\n", "line 1: in_flight must be positive"),
    (f"{KEY_A} alpha rps=fast\n", "line 1: rps must be a number"),
    ("# only comments\n\n", "lists no key"),
])
def test_a_bad_key_file_is_refused_naming_the_line(tmp_path, text, problem):
    with pytest.raises(TenantConfigError, match=None) as e:
        load_tenant_keys(key_file=key_file(tmp_path, text))
    assert problem in str(e.value)


def test_an_unreadable_key_file_is_refused_naming_it(tmp_path):
    with pytest.raises(TenantConfigError, match="cannot read the API key file"):
        load_tenant_keys(key_file=tmp_path / "missing.txt")


def test_quota_text():
    assert parse_quota("in_flight=3,rps=0.5") == Quota(3, 0.5)
    assert parse_quota("rps=2") == Quota(rps=2.0)
    with pytest.raises(TenantConfigError, match="positive"):
        parse_quota("rps=-1")


def test_envoy_gets_the_keys_the_model_gets_only_the_tenants(tmp_path):
    keys = load_tenant_keys(key_file=key_file(tmp_path, f"{KEY_A} alpha rps=2\n"), default_quota=Quota(in_flight=4))
    assert {c["key"]: c["client"] for c in envoy_keys_config(keys)["credentials"]} == {KEY_A: "alpha"}
    assert envoy_keys_config(keys)["forwarding"]["header"] == TENANT_HEADER
    model_side = tenants_json(keys)
    assert KEY_A not in model_side
    assert read_tenants(model_side) == ({"alpha": Quota(rps=2.0)}, Quota(in_flight=4))


# -- the serve command's files and their reload --------------------------------------------------------
def test_key_files_reload_and_a_bad_reload_keeps_the_keys_in_use(tmp_path):
    path = key_file(tmp_path, f"{KEY_A} alpha\n")
    files = KeyFiles.create(key_file=str(path))
    try:
        assert oct(os.stat(files.directory).st_mode & 0o777) == "0o700"  # the keys are secrets
        assert not files.changed()
        path.write_text(f"{KEY_B} beta in_flight=1\n")
        assert files.changed()
        assert "tenants added: beta; tenants removed: alpha" in files.reload()
        written = json.loads(open(files.envoy_path).read())
        assert written["version_info"] == "2"
        assert written["resources"][0]["typed_config"]["credentials"] == [{"key": KEY_B, "client": "beta"}]
        assert read_tenants(open(files.tenants_path).read())[0] == {"beta": Quota(in_flight=1)}
        path.write_text("not-a-key beta\n")
        with pytest.raises(TenantConfigError):
            files.reload()
        assert files.keys.keys == {KEY_B: "beta"} and not files.changed()  # kept, and not retried until it changes
        assert json.loads(open(files.envoy_path).read())["version_info"] == "2"
    finally:
        files.remove()
    assert not os.path.exists(files.directory)


# -- the tenant of a request ----------------------------------------------------------------------------
def test_the_tenant_comes_from_the_parameters_once():
    assert tenant_of_parameters("") is None
    assert tenant_of_parameters('{"triton_x": 1}') is None
    assert tenant_of_parameters(json.dumps({TENANT_HEADER: "alpha"})) == "alpha"
    # a client's own beside the front door's: Triton lists both, the request is refused
    with pytest.raises(ValueError, match="set by the front door"):
        tenant_of_parameters(f'{{"{TENANT_HEADER}": "beta", "{TENANT_HEADER}": "alpha"}}')
    with pytest.raises(ValueError, match="tenant name"):
        tenant_of_parameters(json.dumps({TENANT_HEADER: "a b"}))


def test_generate_bodies_carry_only_the_front_doors_tenant():
    body = json.dumps({"text_input": "x", TENANT_HEADER: "victim", "parameters": {TENANT_HEADER: "victim", "k": 1}}).encode()
    doc = json.loads(with_tenant(body, "alpha"))
    assert TENANT_HEADER not in doc and doc["parameters"] == {"k": 1, TENANT_HEADER: "alpha"}
    assert json.loads(with_tenant(b'{"text_input": "x"}', "alpha"))["parameters"] == {TENANT_HEADER: "alpha"}
    assert TENANT_HEADER not in json.loads(with_tenant(body, None))["parameters"]
    assert with_tenant(b"not json", "alpha") == b"not json"  # Triton refuses it in its own words
    assert with_tenant(b"[1, 2]", "alpha") == b"[1, 2]"


# -- the model's admission --------------------------------------------------------------------------------
class Clock:
    def __init__(self):
        self.t = 100.0

    def __call__(self):
        return self.t


def gate_with(tmp_path, tenants: dict, default: Quota = Quota()):
    path = tmp_path / "tenants.json"
    write_atomically(path, json.dumps({"tenants": {t: q.to_dict() for t, q in tenants.items()},
                                       "default_quota": default.to_dict()}))
    clock = Clock()
    return TenantGate(str(path), clock=clock), clock, path


def test_in_flight_quota_is_exact_and_a_slot_comes_back_with_the_answer(tmp_path):
    gate, _, _ = gate_with(tmp_path, {"alpha": Quota(in_flight=2)})
    first, second = gate.admit("alpha"), gate.admit("alpha")
    with pytest.raises(RateLimitedError, match="2 requests in flight") as e:
        gate.admit("alpha")
    assert e.value.code == "rate_limited" and retry_after_of(str(e.value)) == 1.0
    first()
    third = gate.admit("alpha")
    assert gate.snapshot()["alpha"].in_flight == 2 and gate.snapshot()["alpha"].rate_limited == 1
    second(), third()
    assert gate.snapshot()["alpha"].in_flight == 0


def test_requests_per_second_allow_one_seconds_burst_then_refill(tmp_path):
    gate, clock, _ = gate_with(tmp_path, {"beta": Quota(rps=4)})
    for _ in range(4):
        gate.admit("beta")()
    with pytest.raises(RateLimitedError) as e:
        gate.admit("beta")
    assert retry_after_of(str(e.value)) == pytest.approx(0.25)
    clock.t += 0.25
    gate.admit("beta")()
    with pytest.raises(RateLimitedError):
        gate.admit("beta")


def test_other_tenants_and_unknown_ones_are_counted_apart(tmp_path):
    gate, _, _ = gate_with(tmp_path, {"alpha": Quota(in_flight=1)}, default=Quota(in_flight=3))
    gate.admit("alpha")
    for _ in range(3):
        gate.admit("newcomer")  # not in the file yet: the default quota
    with pytest.raises(RateLimitedError):
        gate.admit("newcomer")
    assert gate.admit(None) is None  # no tenant (the supervisor's probe): not counted


def test_new_quotas_are_read_when_the_file_changes(tmp_path):
    gate, clock, path = gate_with(tmp_path, {"alpha": Quota(in_flight=1)})
    gate.admit("alpha")
    write_atomically(path, json.dumps({"tenants": {"alpha": {"in_flight": 3}}, "default_quota": {}}))
    os.utime(path, ns=(1, 10 ** 18))  # an mtime that differs whatever the file system's resolution
    clock.t += RELOAD_CHECK_S
    gate.admit("alpha"), gate.admit("alpha")
    with pytest.raises(RateLimitedError, match="3 requests"):
        gate.admit("alpha")


def test_answers_are_counted_per_tenant(tmp_path):
    from prefillonly.request import RequestFuture

    gate, _, _ = gate_with(tmp_path, {})
    futures = [RequestFuture() for _ in range(3)]
    for f, (prompt, cached) in zip(futures[:2], ((10, 4), (3, 0))):  # the third never started
        f.started_at, f.prompt_tokens, f.cached_tokens = 1.0, prompt, cached
    gate.finished("alpha", futures, None, [0.5, 0.25])
    gate.finished("alpha", futures, RuntimeError("x"), [0.5])  # failed: its waits count, its tokens do not
    usage = gate.snapshot()["alpha"]
    assert (usage.completed, usage.failed, usage.prompt_tokens, usage.cached_tokens, usage.started) == (1, 1, 13, 4, 3)
    assert usage.queue_s == pytest.approx(1.25)


# -- the front door's config with keys -------------------------------------------------------------------
def _routes(config: dict, listener: int) -> list[dict]:
    hcm = config["static_resources"]["listeners"][listener]["filter_chains"][0]["filters"][0]["typed_config"]
    return hcm["route_config"]["virtual_hosts"][0]["routes"]


def _filters(config: dict, listener: int) -> list[str]:
    hcm = config["static_resources"]["listeners"][listener]["filter_chains"][0]["filters"][0]["typed_config"]
    return [f["name"] for f in hcm["http_filters"]]


@pytest.mark.parametrize("fleet", [False, True])
def test_front_door_with_keys_passes_envoys_own_validation(tmp_path, fleet):
    files = KeyFiles.create(api_keys=[KEY_A])
    try:
        upstreams = [Upstream("127.0.0.1", 1, 2, 3), Upstream("127.0.0.2", 1, 2, 3)][: 1 + fleet]
        config = envoy_config(FrontDoor(upstreams, api_keys_file=files.envoy_path))
        validate_config(config)
    finally:
        files.remove()
    for listener, open_paths in ((0, OPEN_HTTP_PATHS), (1, OPEN_GRPC_PATHS)):
        assert _filters(config, listener)[:2] == ["prefillonly_strip_tenant", "prefillonly_api_keys"]
        routes = _routes(config, listener)
        opened = [r["match"]["path"] for r in routes if "prefillonly_api_keys" in r.get("typed_per_filter_config", {})]
        assert opened == list(open_paths)
        hashed = [r["route"]["hash_policy"] for r in routes if "hash_policy" in r.get("route", {})]
        assert len(hashed) == (len(routes) - len(opened)) // 2 if fleet else not hashed
        assert all(p[0]["header"]["header_name"] == TENANT_HEADER for p in hashed)
    generate = [r for r in _routes(config, 0) if r["match"].get("safe_regex") == GENERATE_ROUTE["safe_regex"]]
    assert generate and all(r["route"]["cluster"].startswith("frontend_http") for r in generate)


def test_front_door_without_keys_has_no_key_filter():
    config = envoy_config(FrontDoor([Upstream("127.0.0.1", 1, 2, 3)]))
    assert "prefillonly_api_keys" not in _filters(config, 0) + _filters(config, 1)
    assert "x-prefillonly-tenant" not in json.dumps(config)


def test_with_the_picker_too_the_health_paths_stay_open(tmp_path):
    files = KeyFiles.create(api_keys=[KEY_A])
    try:
        config = envoy_config(FrontDoor([Upstream("127.0.0.1", 1, 2), Upstream("127.0.0.2", 1, 2)],
                                        api_keys_file=files.envoy_path, picker="127.0.0.1:9"))
        validate_config(config)
    finally:
        files.remove()
    opened = [r for r in _routes(config, 0) if "prefillonly_api_keys" in r.get("typed_per_filter_config", {})]
    assert [r["match"]["path"] for r in opened] == ["/v2/health/ready", "/v2/health/live"]  # no frontend: no /health
    assert all("envoy.filters.http.ext_proc" in r["typed_per_filter_config"] for r in opened)


@pytest.mark.parametrize("options, problem", [({"proxy": False}, "--no-proxy"), ({"frontend": False}, "--no-frontend")])
def test_keys_need_the_front_door_and_the_frontend(tmp_path, options, problem):
    from prefillonly.serving.host.supervisor import ServeOptions, Supervisor

    sup = Supervisor(ServeOptions(model_repository=str(tmp_path), api_keys=[KEY_A], **options), say=lambda m: None)
    with pytest.raises(TenantConfigError, match=problem):
        sup.start()
    assert sup.server is None and sup.keys is None  # refused before anything started
