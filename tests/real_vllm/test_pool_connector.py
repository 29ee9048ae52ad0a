"""`PoolConnector` without an engine: bad configs are refused with the reason and leave
the pool directory alone; the scheduler side counts, leases and releases pool blocks as
its contract says. The cases run in the real-vLLM venv (`pool_connector_cases.py`)."""

from __future__ import annotations

import subprocess
from pathlib import Path

import pytest
from engines import REPO
from vllm_engines import checkout_pythonpath, vllm_env

pytestmark = pytest.mark.timeout(300)


def test_pool_connector_cases(tmp_path: Path) -> None:
    env = vllm_env()
    script = Path(__file__).with_name("pool_connector_cases.py")
    proc = subprocess.run(
        [str(env.python), str(script), str(tmp_path / "pool")],
        cwd=REPO, capture_output=True, text=True, timeout=240,
        env={**checkout_pythonpath(), "VLLM_NO_USAGE_STATS": "1", "HF_HUB_OFFLINE": "1"},
    )  # fmt: skip
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
    lines = proc.stdout.splitlines()
    assert sum(line.startswith("refused: ") for line in lines) == 7, lines
    assert lines[-4:] == [
        "counted 4 of 5 blocks (never the last token's), 4 leases",
        "took 2: loads into pages 10, 11; 2 leases released",
        "a missing block ends the match; a finished request's leases are released",
        "3 full blocks saved, each with its parent's hash and tokens; the salted one marked",
    ], lines
