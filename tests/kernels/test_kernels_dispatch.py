"""The dispatcher's choice: Triton for CUDA tensors or under TRITON_INTERPRET=1 (set around
every CPU test of this directory by conftest.py), torch_fast otherwise; ``use_backend``
wins, and each backend name runs that backend's implementation."""

from __future__ import annotations

import pytest
import torch

from kernels import dispatch as K
from kernels import reference as R
from kernels import torch_fast as F


def test_choice_rules_and_override(monkeypatch: pytest.MonkeyPatch, device: torch.device) -> None:
    monkeypatch.delenv("TRITON_INTERPRET", raising=False)
    cpu = torch.zeros(2, 32)
    assert K.active_backend(cpu) == "torch_fast"
    assert K.active_backend(cpu, None) == "torch_fast"
    if device.type == "cuda":
        assert K.active_backend(cpu, cpu.to(device)) == "triton"
    monkeypatch.setenv("TRITON_INTERPRET", "1")
    assert K.active_backend(cpu) == "triton"
    monkeypatch.delenv("TRITON_INTERPRET")
    with K.use_backend("triton"):
        assert K.active_backend(cpu) == "triton"
        with K.use_backend("reference"):
            assert K.active_backend(cpu) == "reference"
        assert K.active_backend(cpu) == "triton"
    assert K.active_backend(cpu) == "torch_fast"
    with pytest.raises(ValueError, match="backend"), K.use_backend("torch"):
        pass
    assert K.active_backend(cpu) == "torch_fast"


def test_each_backend_runs_its_own_implementation(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.delenv("TRITON_INTERPRET", raising=False)
    x = torch.randn(3, 64)
    seen: list[str] = []
    for name, mod in (("reference", R), ("torch_fast", F)):
        real = mod.fp8_qdq

        def spy(*args: object, name: str = name, real: object = real) -> object:
            seen.append(name)
            return real(*args)  # type: ignore[operator]

        monkeypatch.setattr(mod, "fp8_qdq", spy)
    a = K.fp8_qdq(x)  # auto on CPU without the interpreter: torch_fast
    with K.use_backend("reference"):
        b = K.fp8_qdq(x)
    assert seen == ["torch_fast", "reference"]
    assert torch.equal(a, b)


def test_auto_path_agrees_with_reference(device: torch.device) -> None:
    x = torch.randn(3, 64)
    with K.use_backend("reference"):
        a = K.fp8_qdq(x)
    b = K.fp8_qdq(x.to(device)).cpu()  # Triton: interpreter on CPU (env set), or CUDA
    assert torch.equal(a, b) and torch.equal(a, R.fp8_qdq(x))
    if device.type == "cpu":
        assert K.triton_interpreted()
