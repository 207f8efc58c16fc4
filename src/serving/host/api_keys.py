"""The serve command's API keys: read from --api-key / --api-key-file, handed to Envoy and to the
Triton model as files they watch, and re-read on SIGHUP.

    keys = KeyFiles.create(api_keys=["..."], key_file="keys.txt")   # None: no keys, the server is open
    FrontDoor(..., api_keys_file=keys.envoy_path)                     # Envoy checks the keys
    TritonServer(env={TENANTS_FILE_ENV: keys.tenants_path, ...})      # the model reads tenants and quotas
    keys.reload()                                                     # SIGHUP: both files swapped by rename

The supervisor also reloads when the key file changes (checked every half second), so a key file
rewritten in place or a Kubernetes Secret updated takes effect without a signal.
A reload that fails (a bad line, an unreadable file) keeps the keys in use and says why: a typo in
the key file never locks every client out nor opens the server. Requests in flight are not touched:
Envoy applies new keys to new requests, and the model its new quotas to new requests.
"""

from __future__ import annotations

import os
import shutil
import tempfile
import threading
from dataclasses import dataclass, field
from pathlib import Path

from ...contract.tenants import (TENANT_HEADER, Quota, TenantKeys, envoy_keys_resource, load_tenant_keys, tenants_json,
                                 write_atomically)

# tritonserver copies this header into each request's parameters, where the model reads the tenant
TRITON_FORWARD_ARGS = (f"--grpc-header-forward-pattern={TENANT_HEADER}", f"--http-header-forward-pattern={TENANT_HEADER}")


@dataclass
class KeyFiles:
    api_keys: tuple[str, ...]
    key_file: str | None
    default_quota: Quota
    directory: str
    keys: TenantKeys
    version: int = 0
    signature: tuple | None = None  # the key file's (inode, size, mtime) when last read
    # SIGHUP's handler may run while the watchdog reloads, on the same thread: reentrant
    _lock: threading.RLock = field(default_factory=threading.RLock, repr=False)

    @classmethod
    def create(cls, api_keys=(), key_file: str | None = None, default_quota: Quota = Quota()) -> "KeyFiles | None":
        """The keys' files in a new private directory; None when no key is given. TenantConfigError
        names what is wrong."""
        keys = load_tenant_keys(api_keys, key_file, default_quota)
        if keys is None:
            return None
        directory = tempfile.mkdtemp(prefix="prefillonly-keys-")  # mode 0700: the keys are secrets
        # the path as given, not resolved: a Kubernetes Secret volume swaps its files by relinking
        out = cls(tuple(api_keys), str(Path(key_file).absolute()) if key_file else None, default_quota, directory, keys)
        out.signature = out._signature()
        out._write()
        return out

    def _signature(self) -> tuple | None:
        try:
            st = os.stat(self.key_file) if self.key_file else None
        except OSError:
            return None
        return st and (st.st_ino, st.st_size, st.st_mtime_ns)

    def changed(self) -> bool:
        """Whether the key file changed since it was last read (the supervisor then reloads it,
        as on SIGHUP: a Secret updated in place takes effect without a signal)."""
        return self.key_file is not None and self._signature() not in (self.signature, None)

    @property
    def envoy_path(self) -> str:
        return os.path.join(self.directory, "api-keys.json")

    @property
    def tenants_path(self) -> str:
        return os.path.join(self.directory, "tenants.json")

    def describe(self) -> str:
        tenants = self.keys.tenants()
        return f"{len(self.keys.keys)} API key(s) of {len(tenants)} tenant(s): {', '.join(tenants)}"

    def reload(self) -> str:
        """Re-read the keys; what changed, in words. TenantConfigError (the old keys stay) on a bad file."""
        with self._lock:
            return self._reload()

    def _reload(self) -> str:
        self.signature = self._signature()  # a bad file is not re-read until it changes again
        keys = load_tenant_keys(self.api_keys, self.key_file, self.default_quota)
        before = set(self.keys.tenants())
        self.keys = keys
        self._write()
        after = set(keys.tenants())
        added, removed = sorted(after - before), sorted(before - after)
        return (f"API keys reloaded: {self.describe()}" + (f"; tenants added: {', '.join(added)}" if added else "")
                + (f"; tenants removed: {', '.join(removed)}" if removed else ""))

    def _write(self) -> None:
        self.version += 1
        # the tenants first: a new tenant's quota is known before Envoy lets its key in
        write_atomically(self.tenants_path, tenants_json(self.keys))
        write_atomically(self.envoy_path, envoy_keys_resource(self.keys, str(self.version)))

    def remove(self) -> None:
        shutil.rmtree(self.directory, ignore_errors=True)

