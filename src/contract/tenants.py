"""Tenants: API keys, the tenant each key belongs to, and each tenant's quota. Standard library only:
the serve command, the fleet's config generator and the Triton model all read these rules.

Where each piece lives at run time:
- the keys are checked by Envoy (its api_key_auth filter): the serve command writes them, with
  their tenants, into a file Envoy watches (`envoy_keys_resource`), so a reload (SIGHUP) swaps them
  without a restart or a dropped request. Envoy then sets TENANT_HEADER on the request (after
  removing any the client sent) and passes it on; the key itself never reaches the engine.
- the tenants and their quotas (never the keys) go to the Triton model in a JSON file named by
  TENANTS_FILE_ENV (`tenants_json`), which the model re-reads when it changes.
- the model reads the tenant from the request's parameters (`tenant_of_parameters`): Triton copies
  TENANT_HEADER into them (--grpc-header-forward-pattern / --http-header-forward-pattern) on gRPC
  and HTTP infer; HTTP generate forwards no header, so with keys on the front door sends generate
  through the scoring-API frontend, which writes the tenant into the JSON body's parameters.
  A client's own parameter of that name comes in beside Envoy's: a request with two is refused.

Key file: one key per line, `KEY TENANT [in_flight=N] [rps=R]`; `#` starts a comment; blank
lines are skipped. A tenant's quota may be written on any of its lines (the same on each).
"""

from __future__ import annotations

import json
import math
import os
import re
from dataclasses import dataclass, field
from pathlib import Path

from .wire import RATE_LIMITED

TENANT_HEADER = "x-prefillonly-tenant"  # set by Envoy from the key; what the engine isolates by
DEFAULT_TENANT = "default"  # the tenant of a key given as --api-key
TENANTS_FILE_ENV = "PREFILLONLY_TENANTS_FILE"  # the model's tenants and quotas (tenants_json)
# a tenant name goes into headers, metric labels and cache namespaces: plain and short
_TENANT_NAME = re.compile(r"[A-Za-z0-9._-]{1,64}")
# a key is a bearer token (RFC 6750's b64token characters): no spaces, no quotes
_KEY = re.compile(r"[A-Za-z0-9._~+/=-]{16,256}")
QUOTA_FIELDS = ("in_flight", "rps")
# marks a tenant's cache namespace (tenant_namespace); the engine refuses it in a client's
# cache_namespace and user, so no client namespace can take a tenant's form
TENANT_MARK = "\x1f"


class TenantConfigError(ValueError):
    """A key file, key or quota that cannot be used; the message names the line and the problem."""


def tenant_name_problem(name) -> str | None:
    """Why `name` cannot be a tenant's name, or None."""
    if not isinstance(name, str):
        return f"a tenant name is a string, not {type(name).__name__}"
    if not _TENANT_NAME.fullmatch(name):
        return f"tenant name {name!r} must be 1-64 characters of A-Z a-z 0-9 . _ -"
    return None


def tenant_namespace(tenant: str | None, namespace: str | None) -> str | None:
    """The cache namespace of a request of `tenant` (a valid name, or None) whose client namespace is
    `namespace`: inside the tenant's, so cache hits never cross tenants whatever cache_namespace or
    user a client sends. With no tenant, the client's namespace as it is (a tenant's cache is not
    the key-less one). The engine and the fleet's picker both name caches by this rule."""
    if tenant is None:
        return namespace
    return f"{TENANT_MARK}{tenant}{TENANT_MARK}{namespace or ''}"


@dataclass(frozen=True)
class Quota:
    """Per tenant, per replica: requests in flight at once and requests per second (a token bucket
    of one second's burst). None: no bound."""
    in_flight: int | None = None
    rps: float | None = None

    def to_dict(self) -> dict:
        return {name: getattr(self, name) for name in QUOTA_FIELDS if getattr(self, name) is not None}


def parse_quota(text: str, where: str = "quota") -> Quota:
    """`in_flight=N,rps=R` (either or both; commas or spaces between) -> Quota."""
    values = {}
    for part in text.replace(",", " ").split():
        name, eq, value = part.partition("=")
        if not eq or name not in QUOTA_FIELDS:
            raise TenantConfigError(f"{where}: {part!r} is not one of {', '.join(f + '=N' for f in QUOTA_FIELDS)}")
        try:
            number = int(value) if name == "in_flight" else float(value)
        except ValueError:
            raise TenantConfigError(f"{where}: {name} must be a number, not {value!r}") from None
        if not (math.isfinite(number) and number > 0):
            raise TenantConfigError(f"{where}: {name} must be positive, not {value!r}")
        values[name] = number
    return Quota(**values)


@dataclass
class TenantKeys:
    """API key -> tenant, and tenant -> quota (tenants without one get `default_quota`)."""
    keys: dict[str, str] = field(default_factory=dict)
    quotas: dict[str, Quota] = field(default_factory=dict)
    default_quota: Quota = Quota()

    def add_key(self, key: str, tenant: str, where: str) -> None:
        if not _KEY.fullmatch(key):
            raise TenantConfigError(f"{where}: an API key must be 16-256 characters of A-Z a-z 0-9 . _ ~ + / = - "
                                    f"(a bearer token), got one of {len(key)} characters that is not")
        problem = tenant_name_problem(tenant)
        if problem:
            raise TenantConfigError(f"{where}: {problem}")
        if key in self.keys and self.keys[key] != tenant:
            raise TenantConfigError(f"{where}: this key is already tenant {self.keys[key]!r}'s")
        self.keys[key] = tenant

    def set_quota(self, tenant: str, quota: Quota, where: str) -> None:
        if tenant in self.quotas and self.quotas[tenant] != quota:
            raise TenantConfigError(f"{where}: tenant {tenant!r} already has quota {self.quotas[tenant].to_dict()}")
        self.quotas[tenant] = quota

    def tenants(self) -> list[str]:
        return sorted(set(self.keys.values()))

    def quota_of(self, tenant: str) -> Quota:
        return self.quotas.get(tenant, self.default_quota)


def parse_key_file(text: str, source: str, into: TenantKeys) -> TenantKeys:
    """Add the keys (and quotas) of a key file's text to `into`; TenantConfigError names the line."""
    for number, line in enumerate(text.splitlines(), 1):
        words = line.split("#", 1)[0].split()
        if not words:
            continue
        where = f"{source}, line {number}"
        if len(words) < 2:
            raise TenantConfigError(f"{where}: expected `KEY TENANT [in_flight=N] [rps=R]`")
        into.add_key(words[0], words[1], where)
        if len(words) > 2:
            into.set_quota(words[1], parse_quota(" ".join(words[2:]), where), where)
    return into


def load_tenant_keys(api_keys=(), key_file: str | os.PathLike | None = None,
                     default_quota: Quota = Quota()) -> TenantKeys | None:
    """The keys of `--api-key` (tenant DEFAULT_TENANT) and of `--api-key-file`; None when there are
    none at all (the server is open). A key file that lists no key is an error, not an open server."""
    if not api_keys and key_file is None:
        return None
    out = TenantKeys(default_quota=default_quota)
    for i, key in enumerate(api_keys, 1):
        out.add_key(key, DEFAULT_TENANT, f"--api-key #{i}")
    if key_file is not None:
        try:
            text = Path(key_file).read_text()
        except (OSError, UnicodeDecodeError) as e:
            raise TenantConfigError(f"cannot read the API key file {key_file}: {e}") from None
        parse_key_file(text, str(key_file), out)
        if not out.keys:
            raise TenantConfigError(f"the API key file {key_file} lists no key (lines `KEY TENANT`)")
    return out


# -- what each process is given ------------------------------------------------------------------
API_KEY_FILTER = "prefillonly_api_keys"  # the name of Envoy's key filter (and of its watched resource)
_API_KEY_TYPE = "type.googleapis.com/envoy.extensions.filters.http.api_key_auth.v3.ApiKeyAuth"


def envoy_keys_config(keys: TenantKeys) -> dict:
    """Envoy's api_key_auth filter config: the keys from the Authorization header (`Bearer KEY`, which
    the openai, cohere, langchain and huggingface_hub clients send; gRPC metadata is a header too),
    the tenant written into TENANT_HEADER. The key goes on: a replica behind a fleet's front door
    checks it again, and the scoring frontend passes it on to the fleet door it calls. Behind the
    door it reaches only 127.0.0.1 processes, and Triton copies the tenant header, not the key, into
    what the model sees."""
    return {"@type": _API_KEY_TYPE,
            "credentials": [{"key": key, "client": tenant} for key, tenant in sorted(keys.keys.items())],
            "key_sources": [{"header": "authorization"}],
            "forwarding": {"header": TENANT_HEADER, "hide_credentials": False}}


def envoy_keys_resource(keys: TenantKeys, version: str) -> str:
    """The file Envoy watches for the key filter (extension config discovery from a path), as JSON."""
    resource = {"@type": "type.googleapis.com/envoy.config.core.v3.TypedExtensionConfig",
                "name": API_KEY_FILTER, "typed_config": envoy_keys_config(keys)}
    return json.dumps({"version_info": version, "resources": [resource]}, indent=1)


def tenants_json(keys: TenantKeys) -> str:
    """What the Triton model reads (TENANTS_FILE_ENV): each tenant's quota, and the quota of a tenant
    it does not know yet (a key added a moment before the model re-read the file). No keys."""
    return json.dumps({"tenants": {t: keys.quota_of(t).to_dict() for t in keys.tenants()},
                       "default_quota": keys.default_quota.to_dict()}, indent=1, sort_keys=True)


def read_tenants(text: str) -> tuple[dict[str, Quota], Quota]:
    """tenants_json's text -> (tenant -> Quota, the default Quota)."""
    doc = json.loads(text)
    return {name: Quota(**q) for name, q in doc["tenants"].items()}, Quota(**doc.get("default_quota", {}))


def write_atomically(path: str | os.PathLike, text: str) -> None:
    """Write by rename: a watcher (Envoy, the model) never reads half a file."""
    path = Path(path)
    tmp = path.with_name(f".{path.name}.tmp")
    tmp.write_text(text)
    os.replace(tmp, path)


def tenant_of_parameters(parameters: str) -> str | None:
    """The tenant in a Triton request's parameters (JSON, as the Python backend gives them), or None.
    ValueError when the name comes twice (a client's own beside the front door's) or is not a
    tenant's name."""
    pairs = json.loads(parameters or "{}", object_pairs_hook=list)
    values = [value for name, value in pairs if name == TENANT_HEADER]
    if not values:
        return None
    if len(values) > 1:
        raise ValueError(f"{TENANT_HEADER} is set by the front door from the API key; a request may not send its own")
    problem = tenant_name_problem(values[0])
    if problem:
        raise ValueError(problem)
    return values[0]


# -- over quota -------------------------------------------------------------------------------------
_RETRY_AFTER = re.compile(r"retry after ([0-9]+(?:\.[0-9]+)?) s")


def rate_limited_message(what: str, retry_after_s: float) -> str:
    """The engine's refusal of a request over its tenant's quota; HTTP routes answer it 429 with
    Retry-After read back from the text (retry_after_of)."""
    return f"{RATE_LIMITED}: {what}; retry after {retry_after_s:.2f} s"


def retry_after_of(message: str) -> float | None:
    found = _RETRY_AFTER.search(message)
    return float(found.group(1)) if found else None
