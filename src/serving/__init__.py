"""Serving prefillonly behind Triton Inference Server: the wire format (protocol.py) and the server launcher."""

# The launcher (prefillonly.serving.launcher) is loaded on first use only, so that model.py's
# `prefillonly.serving.protocol` import inside the Triton stub does not pull it in.
_LAUNCHER_NAMES = ("TritonServer", "ServerError", "PerfAnalyzerUnavailable", "prepare_server_dir", "server_env",
                   "perf_analyzer_path", "perf_analyzer_env")


def __getattr__(name):
    if name in _LAUNCHER_NAMES:
        from . import launcher

        return getattr(launcher, name)
    raise AttributeError(f"module {__name__!r} has no attribute {name!r}")
