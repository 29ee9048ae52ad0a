"""A vLLM V1 KV connector over the shared `kvpool` directory (`connector.PoolConnector`).

Installed into the real-vLLM venv by `scripts/vllm_env.sh` (as the top-level package
`vllm_pool`, next to `kvpool`); load it with
`--kv-transfer-config '{"kv_connector":"PoolConnector","kv_connector_module_path":"vllm_pool.connector","kv_role":"kv_both","kv_connector_extra_config":{"pool_dir":"/dev/shm/..."}}'`.
Nothing here is imported by `ramjet/` (the router stays free of torch)."""
