"""ramjet.runtime.malloc: glibc accepts the thresholds (in a child process, since they
change the allocator of whatever process calls it) and bad values are refused."""

from __future__ import annotations

import platform
import subprocess
import sys

import pytest

from ramjet.runtime.malloc import MMAP_THRESHOLD_MAX, tune_malloc


def test_bad_thresholds_are_refused() -> None:
    with pytest.raises(ValueError):
        tune_malloc(mmap_threshold_bytes=MMAP_THRESHOLD_MAX + 1)
    with pytest.raises(ValueError):
        tune_malloc(trim_threshold_bytes=0)


def test_glibc_accepts_the_thresholds() -> None:
    code = "from ramjet.runtime.malloc import tune_malloc; print(tune_malloc())"
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=60)
    assert out.returncode == 0, out.stderr
    expected = "True" if platform.libc_ver()[0] == "glibc" else "False"
    assert out.stdout.strip() == expected
