"""The router's two residency tables: global-KV residency (by tier) and SWA sessions.

`ResidencyTables` (tables.py) is the facade the router and the report processor use;
`ResidencyStore` (store.py) is the storage contract behind it, with the in-process
`MemoryStore`; `ResidencyConfig` (config.py) holds TTLs and caps.
"""
