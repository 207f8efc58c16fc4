"""Chained block hashes: block i's key covers every token before it and the namespace root.

Equal hashes therefore mean equal prefixes (up to a 128-bit collision); a one-token change
anywhere before a block changes that block's hash and every later one. The root binds the
model identity and the cache namespace, so hits never cross models or tenants.
"""

from __future__ import annotations

import hashlib
from collections.abc import Sequence

import numpy as np

DIGEST_BYTES = 16


def namespace_root(model_id: str, namespace: str | None) -> bytes:
    data = f"prefillonly\0{model_id}\0{namespace or ''}".encode("utf-8", "surrogatepass")
    return hashlib.blake2b(data, digest_size=DIGEST_BYTES).digest()


def block_hashes(token_ids: Sequence[int], block_size: int, root: bytes, max_blocks: int | None = None) -> list[bytes]:
    """Hashes of the full blocks of `token_ids` (a trailing partial block has none)."""
    n_blocks = len(token_ids) // block_size
    if max_blocks is not None:
        n_blocks = min(n_blocks, max_blocks)
    ids = np.asarray(token_ids[: n_blocks * block_size], dtype=np.int64)
    out, h = [], root
    for b in range(n_blocks):
        h = hashlib.blake2b(h + ids[b * block_size : (b + 1) * block_size].tobytes(), digest_size=DIGEST_BYTES).digest()
        out.append(h)
    return out
