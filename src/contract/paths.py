"""Where the engine keeps files on the host: one leaf module (no imports from this package), so
that the config, the GPU kernels' tile cache and the server tree can all ask without importing
each other."""

from __future__ import annotations

import os


def default_cache_dir() -> str:
    """The converted default model, the GPU kernels' tuned tiles and the tritonserver tree live
    here: $PREFILLONLY_CACHE_DIR or ~/.cache/prefillonly."""
    return os.environ.get("PREFILLONLY_CACHE_DIR") or os.path.join(os.path.expanduser("~"), ".cache", "prefillonly")
