"""Prefix K/V kept across requests (suffix K/V is never stored).

block_hash.py  chained block keys (model + namespace rooted)
index.py       PrefixIndex: tensor-free bookkeeping (hashes, refs, LRU, tiers) and the
               tensor-free half of a request's begin/commit/abort (match, pin, keep rule, stats)
kv_pool.py     KVPool: preallocated K/V slots
prefix_cache.py PrefixCache: begin/commit/abort around one forward, with the pool-backed
               source and sink of the executor's protocols (prefix_io.py)

Nothing is imported here: the tensor-free half (index.py, block_hash.py) loads without torch,
which the scheduler and the simulator rely on.
"""
