"""Ports and addresses for the servers we start: free ports to bind, and the host a client dials
for a bind address. Standard library only."""

from __future__ import annotations

import socket


def free_ports(n: int, host: str = "127.0.0.1") -> list[int]:
    """`n` distinct ports free on `host` right now (all held open together while choosing)."""
    family = socket.AF_INET6 if ":" in host else socket.AF_INET
    bind_host = "" if host in ("0.0.0.0", "::") else host
    socks = []
    try:
        for _ in range(n):
            s = socket.socket(family, socket.SOCK_STREAM)
            s.bind((bind_host, 0))
            socks.append(s)
        return [s.getsockname()[1] for s in socks]
    finally:
        for s in socks:
            s.close()


def client_host(host: str) -> str:
    """The host part of a URL that reaches a server bound to `host` (wildcards -> loopback,
    IPv6 in brackets)."""
    if host in ("", "0.0.0.0"):
        return "127.0.0.1"
    if host == "::":
        return "[::1]"
    return f"[{host}]" if ":" in host and not host.startswith("[") else host


def dial(host: str, port: int, scheme: str | None = "http") -> str:
    """What a client dials to reach a server bound to host:port: "http://host:port", or with
    scheme None the bare "host:port" that tritonclient.grpc.InferenceServerClient(url=...) takes."""
    address = f"{client_host(host)}:{port}"
    return address if scheme is None else f"{scheme}://{address}"
