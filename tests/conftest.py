"""The whole suite runs the router in process, so it loads the compiled hot modules as
`ramjet serve` does (ramjet/native.py): before any test module imports ramjet. With
`RAMJET_NATIVE=0` (the Makefile's pure-Python run) or without a current build, the
suite runs from source."""

from ramjet.native import install_ramjet

install_ramjet()
