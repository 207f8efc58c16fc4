"""The scoring-API frontend (prefillonly.frontend) as a child process of the serve command.

    frontend = FrontendProcess(model_repository, triton_grpc="127.0.0.1:9001").start().wait_ready()
    ... Envoy routes the scoring paths to frontend.port ...
    frontend.stop()

It binds 127.0.0.1 only (Envoy is its front door, with the body limit) and reaches the engine
over Triton's gRPC port. Standard library only: the frontend's own imports stay in its process.
"""

from __future__ import annotations

import os
import sys

from .addresses import free_ports
from .process import LoggedProcess, http_status


class FrontendError(RuntimeError):
    """The frontend could not start (a preset refused, the tokenizer missing) or become ready."""


class FrontendProcess(LoggedProcess):
    name = "prefillonly-frontend"
    error = FrontendError

    def __init__(self, model_repository: str | os.PathLike, triton_grpc: str, port: int = 0,
                 log_path: str | os.PathLike | None = None, env: dict | None = None, triton_http: str | None = None):
        """triton_http: Triton's HTTP host:port, for its generate endpoints passed through with the
        caller's tenant (API keys on); None: not served here."""
        super().__init__()
        self.triton_http = triton_http
        self.model_repository = str(model_repository)
        self.triton_grpc = triton_grpc
        self.port = port
        self._wanted_log = log_path
        self._env = env

    def start(self) -> "FrontendProcess":
        if self.port == 0:
            self.port = free_ports(1)[0]
        self._spawn([sys.executable, "-m", "prefillonly.frontend", "--model-repository", self.model_repository,
                     "--triton-grpc", self.triton_grpc, "--host", "127.0.0.1", "--port", str(self.port),
                     *(["--triton-http", self.triton_http] if self.triton_http else [])],
                    self._wanted_log, env=self._env)
        return self

    @property
    def url(self) -> str:
        return f"http://127.0.0.1:{self.port}"

    def is_ready(self) -> bool:
        return http_status(f"{self.url}/health") != 0  # answering HTTP (503 only says the engine is not ready)

    def wait_ready(self, timeout: float = 120.0) -> "FrontendProcess":
        return super().wait_ready(timeout, step=0.2)

    # stop(): LoggedProcess's (on SIGTERM uvicorn finishes the calls in flight, for at most its
    # graceful timeout; SIGKILL after `timeout`)

    def describe(self) -> str:
        return self.url
