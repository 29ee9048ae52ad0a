"""The dispatcher's choice: Triton for CUDA tensors or under TRITON_INTERPRET=1 (set around
every CPU test of this directory by conftest.py), torch otherwise; ``use_backend`` wins."""

from __future__ import annotations

import pytest
import torch

from kernels import dispatch as K
from kernels import reference as R


def test_choice_rules_and_override(monkeypatch: pytest.MonkeyPatch, device: torch.device) -> None:
    monkeypatch.delenv("TRITON_INTERPRET", raising=False)
    cpu = torch.zeros(2, 32)
    assert K.active_backend(cpu) == "torch"
    assert K.active_backend(cpu, None) == "torch"
    if device.type == "cuda":
        assert K.active_backend(cpu, cpu.to(device)) == "triton"
    monkeypatch.setenv("TRITON_INTERPRET", "1")
    assert K.active_backend(cpu) == "triton"
    monkeypatch.delenv("TRITON_INTERPRET")
    with K.use_backend("triton"):
        assert K.active_backend(cpu) == "triton"
        with K.use_backend("torch"):
            assert K.active_backend(cpu) == "torch"
        assert K.active_backend(cpu) == "triton"
    assert K.active_backend(cpu) == "torch"
    with pytest.raises(ValueError, match="backend"), K.use_backend("cuda"):
        pass


def test_auto_path_agrees_with_reference(device: torch.device) -> None:
    x = torch.randn(3, 64)
    with K.use_backend("torch"):
        a = K.fp8_qdq(x)
    b = K.fp8_qdq(x.to(device)).cpu()  # Triton: interpreter on CPU (env set), or CUDA
    assert torch.equal(a, b) and torch.equal(a, R.fp8_qdq(x))
    if device.type == "cpu":
        assert K.triton_interpreted()
