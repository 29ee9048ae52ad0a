"""Ramjet: a cache-aware request router for LLM serving.

The package never imports torch or triton: the router installs and starts without them.
The reference engine (`engine_stub`) and the simulator (`simulations`) import the shared
pieces from here (prefix keys, report envelope, profiles, cost model, policies).
"""

__version__ = "0.1.0"

# The compiled hot modules (ramjet/native.py) are not installed here: only the router's
# entry points do that (`ramjet serve`, ramjet/cli.py), so the engine, the simulator and
# any script that imports ramjet run from source.
