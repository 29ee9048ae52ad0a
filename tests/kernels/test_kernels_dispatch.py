"""The dispatcher's choice: torch on CPU, Triton under TRITON_INTERPRET=1 (set around
every test of this directory by conftest.py), and the ``use_backend`` override."""

from __future__ import annotations

import pytest
import torch

from kernels import dispatch as K
from kernels import reference as R


def test_env_chooses_triton_and_override_wins(monkeypatch: pytest.MonkeyPatch) -> None:
    x = torch.zeros(2, 32)
    assert K.active_backend(x) == "triton"
    monkeypatch.delenv("TRITON_INTERPRET")
    assert K.active_backend(x) == "torch"
    with K.use_backend("triton"):
        assert K.active_backend(x) == "triton"
        with K.use_backend("torch"):
            assert K.active_backend(x) == "torch"
        assert K.active_backend(x) == "triton"
    assert K.active_backend(x) == "torch"
    with pytest.raises(ValueError, match="backend"), K.use_backend("cuda"):
        pass


def test_interpreter_is_on_and_both_paths_agree() -> None:
    assert K.triton_interpreted()
    x = torch.randn(3, 64)
    with K.use_backend("torch"):
        a = K.fp8_qdq(x)
    b = K.fp8_qdq(x)  # TRITON_INTERPRET=1 -> Triton
    assert torch.equal(a, b) and torch.equal(a, R.fp8_qdq(x))
