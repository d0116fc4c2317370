"""Scheduler side (the engine-core process): what vLLM's scheduler and KV-cache manager
call, and the startup sizing that decides their pools.

* :mod:`.block_pool`: ``BlockPool``, the drop-in for vLLM's pool on the Rust core;
* :mod:`.manager_patches`: batched replacements for four per-block loops of vLLM's managers;
* :mod:`.pool_set`: one Rust pool per KV-cache group (``PoolSet``), elastic or static;
* :mod:`.coordinator`: the per-group coordinators, vLLM's hybrid coordinator with the
  running requests' table, and ``allocate_slots``;
* :mod:`.quiet_step`: the running requests' table (Rust) that answers decode steps;
* :mod:`.engine_sizing`: the engine core's per-group sizing (``get_kv_cache_configs``).
"""
