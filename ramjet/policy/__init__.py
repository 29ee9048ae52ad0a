"""Routing policies: the plugin interface, the registry, the baselines, the cost model
and the tier-aware candidate. Policies are pure and synchronous (see `base`)."""
