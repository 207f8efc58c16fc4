"""Prefix K/V kept across requests (suffix K/V is never stored).

block_hash.py  chained block keys (model + namespace rooted)
index.py       PrefixIndex: tensor-free bookkeeping (hashes, refs, LRU, tiers)
kv_pool.py     KVPool: preallocated K/V slots
prefix_cache.py PrefixCache: begin/commit/abort around one forward
prefix_kv.py   PrefixKV and the source/sink protocols the executor uses
"""

from .index import CacheStats, PrefixIndex
from .prefix_cache import CacheTicket, PrefixCache
from .prefix_kv import CaptureSink, PrefixKV

__all__ = ["CacheStats", "PrefixIndex", "CacheTicket", "PrefixCache", "CaptureSink", "PrefixKV"]
