"""A shared pool of KV blocks in a directory (`Pool`): atomic publish, concurrent
readers, leases, LRU eviction under a byte capacity. Pure file operations, no torch:
the vLLM connector (`connectors/vllm_pool`) and the reference engine share it."""

from kvpool.pool import BlockInfo, Lease, Pool, PoolError, chain_stamp, check_key

__all__ = ["BlockInfo", "Lease", "Pool", "PoolError", "chain_stamp", "check_key"]
