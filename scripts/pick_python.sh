#!/usr/bin/env bash
# The interpreter the Makefile makes its venvs from (PY), unless PY is set.
#
# The distribution's /usr/bin/python3 first, when it is 3.11 or newer: Debian builds its
# CPython with PGO and LTO, and the router costs 0.73-0.88x the CPU per small request there
# that it costs on an interpreter built without them, as pyenv and a plain ./configure
# build it (docs/results/history-performance.md, "2026-12-02 00:44-00:55 UTC"). Else the first python3 on PATH.
# Prints a command name or path; never fails (make then reports what is missing).
set -u
for candidate in /usr/bin/python3 python3; do
    if command -v "$candidate" >/dev/null 2>&1 \
        && "$candidate" -c 'import sys; sys.exit(sys.version_info < (3, 11))' 2>/dev/null; then
        echo "$candidate"
        exit 0
    fi
done
echo python3
