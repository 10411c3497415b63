"""A worker's KV cache below the step loop: the paged pool and its layout, the block manager
(its prefix hashes are `engine/block_hash.py`'s, which sequences and the router share), KV
events, the host and disk tiers with their files, and how many blocks fit the memory budget.
The engine's `kv_cache.py` ties these to the scheduler."""
