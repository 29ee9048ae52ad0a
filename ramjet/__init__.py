"""Ramjet: a cache-aware request router for LLM serving.

The package never imports torch or triton: the router installs and starts without them.
The reference engine (`engine_stub`) and the simulator (`simulations`) import the shared
pieces from here (prefix keys, report envelope, profiles, cost model, policies).
"""

__version__ = "0.1.0"

# Compiled hot modules (ramjet/native.py): loaded only when build/native/ was built from
# exactly today's source, else everything runs from source. Must run before any other
# ramjet module is imported.
from ramjet.native import install_ramjet as _install_native

_install_native()
