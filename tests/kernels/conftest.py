"""Run the Triton kernels under the interpreter on CPU, without changing other tests.

Triton fixes interpreter mode when it is first imported (its ``tl`` library functions
are decorated then) and reads ``TRITON_INTERPRET`` again at every launch. So this file
sets the variable, imports triton and the kernel modules, and restores the environment
at once; an autouse fixture sets it again only around the tests of this directory.
Tests elsewhere in the same process keep their environment (and ``kernels.dispatch``
keeps choosing the torch path for them), and processes they start do not inherit it.
"""

from __future__ import annotations

import os
import sys
from collections.abc import Iterator

import pytest

if "triton" in sys.modules:
    from triton.language import standard as _standard

    if type(_standard.cdiv).__name__ != "InterpretedFunction":
        raise pytest.UsageError(
            "triton was imported in compiled mode before tests/kernels/conftest.py; the "
            "kernel tests need the interpreter: run them in their own pytest process"
        )

_saved = os.environ.get("TRITON_INTERPRET")
os.environ["TRITON_INTERPRET"] = "1"
try:
    import triton  # noqa: F401  (decorates tl's own library in interpreter mode)

    from kernels import dispatch

    dispatch.load_kernels()
finally:
    if _saved is None:
        del os.environ["TRITON_INTERPRET"]
    else:
        os.environ["TRITON_INTERPRET"] = _saved


@pytest.fixture(autouse=True)
def _triton_interpreter(monkeypatch: pytest.MonkeyPatch) -> Iterator[None]:
    monkeypatch.setenv("TRITON_INTERPRET", "1")
    yield
