"""Prefix K/V kept across requests (suffix K/V is never stored).

index.py       PrefixIndex: tensor-free bookkeeping (hashes, refs, LRU, tiers) and a request's
               ticket from begin to commit/abort (match, pin, keep rule, stats); the block keys
               it matches on are contract/block_keys.py's
kv_pool.py     KVPool: preallocated K/V slots
prefix_cache.py PrefixCache: the pools beside the index; executes the index's data moves and
               gives the executor its view of a ticket (access: the pool-backed source and sink
               of the protocols in prefix_io.py)

Nothing is imported here: the tensor-free half (index.py) loads without torch, which the
scheduler and the simulator rely on.
"""
