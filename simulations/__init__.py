"""Trace-driven discrete-event simulation of the engine pair, running the router's own
policy objects (`ramjet.policy`) against re-implementations of peer routers' policies.

Layout: `workload` (traces → requests), `plan` (capacity planner), `preset` (engine
calibration), `cache` (tiered global KV, SWA pool), `engine` (prefill queue, decode),
`views` (residency views the policies see), `simulator` (the event loop), `peers/`
(peer routers' policies), `lineup` (named policies and their knowledge), `bounds`
(lower bounds), `summary` (metrics), `report` (tables, CSV, plots), `__main__` (CLI).
See `docs/simulation.md`.
"""
