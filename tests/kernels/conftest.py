"""Where the kernel tests run the Triton kernels: the interpreter on CPU (default), or a
GPU with ``KERNELS_TEST_DEVICE=cuda`` (``benchmarks/gpu_check.sh``).

Interpreter, without changing other tests: Triton fixes interpreter mode when it is
first imported (its ``tl`` library functions are decorated then) and reads
``TRITON_INTERPRET`` again at every launch. So this file sets the variable, imports
triton and the kernel modules, and restores the environment at once; an autouse fixture
sets it again only around the tests of this directory. Tests elsewhere in the same
process keep their environment (``kernels.dispatch`` keeps choosing the torch path for
them), and processes they start do not inherit it.

The ``triton_call`` fixture runs one op through ``kernels.dispatch`` on the Triton path:
inputs moved to the test device, outputs brought back to the CPU, where the tests
compare them with the torch reference.
"""

from __future__ import annotations

import os
import sys
from collections.abc import Callable, Iterator
from typing import Any

import pytest
import torch

DEVICE = os.environ.get("KERNELS_TEST_DEVICE", "cpu")
if DEVICE not in ("cpu", "cuda"):
    raise pytest.UsageError(f"KERNELS_TEST_DEVICE must be cpu or cuda, got {DEVICE!r}")
if DEVICE == "cuda" and not torch.cuda.is_available():
    raise pytest.UsageError("KERNELS_TEST_DEVICE=cuda but torch sees no CUDA device")

if DEVICE == "cpu":
    if "triton" in sys.modules:
        from triton.language import standard as _standard

        if type(_standard.cdiv).__name__ != "InterpretedFunction":
            raise pytest.UsageError(
                "triton was imported in compiled mode before tests/kernels/conftest.py; "
                "the kernel tests need the interpreter: run them in their own pytest process"
            )
    _saved = os.environ.get("TRITON_INTERPRET")
    os.environ["TRITON_INTERPRET"] = "1"
    try:
        import triton  # noqa: F401  (decorates tl's own library in interpreter mode)

        from kernels import dispatch as _dispatch

        _dispatch.load_kernels()
    finally:
        if _saved is None:
            del os.environ["TRITON_INTERPRET"]
        else:
            os.environ["TRITON_INTERPRET"] = _saved


def _old_interpreter() -> bool:
    """Triton < 3.7's interpreter turns 1-element arrays into loop bounds with int(), which
    numpy deprecates (a DeprecationWarning) and, from 2.4, refuses."""
    import triton

    major, minor = (int(v) for v in triton.__version__.split(".")[:2])
    return DEVICE == "cpu" and (major, minor) < (3, 7)


if _old_interpreter():
    import numpy

    if tuple(int(v) for v in numpy.__version__.split(".")[:2]) >= (2, 4):
        raise pytest.UsageError(
            "the Triton interpreter of this Triton (< 3.7) cannot run with numpy >= 2.4 "
            "(int() of a 1-element array): use Triton >= 3.7 or numpy < 2.4 for the CPU "
            "kernel tests (the compiled kernels support Triton 3.6)"
        )


def pytest_collection_modifyitems(items: list[pytest.Item]) -> None:
    if not _old_interpreter():
        return
    here = os.path.dirname(__file__)
    for item in items:
        if str(item.path).startswith(here):
            item.add_marker(
                pytest.mark.filterwarnings("ignore:Conversion of an array with ndim > 0")
            )


@pytest.fixture(autouse=True)
def _triton_interpreter(monkeypatch: pytest.MonkeyPatch) -> Iterator[None]:
    if DEVICE == "cpu":
        monkeypatch.setenv("TRITON_INTERPRET", "1")
    yield


@pytest.fixture
def device() -> torch.device:
    return torch.device(DEVICE)


def _move(x: Any, dev: torch.device) -> Any:
    if isinstance(x, torch.Tensor):
        return x.to(dev)
    if isinstance(x, tuple):
        return tuple(_move(v, dev) for v in x)
    return x


@pytest.fixture
def triton_call() -> Callable[..., Any]:
    from kernels import dispatch

    def call(name: str, *args: Any, **kwargs: Any) -> Any:
        dev = torch.device(DEVICE)
        with dispatch.use_backend("triton"):
            out = getattr(dispatch, name)(*_move(args, dev), **kwargs)
        return _move(out, torch.device("cpu"))

    return call
