"""The `ramjet` command line as a process: a closed pipe stops it quietly."""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]


def test_a_reader_that_went_away_stops_the_command_without_a_traceback() -> None:
    read_end, write_end = os.pipe()
    os.close(read_end)  # `ramjet native | head -0`: every write gets EPIPE
    try:
        proc = subprocess.run(
            [sys.executable, "-m", "ramjet", "native"],
            stdout=write_end,
            stderr=subprocess.PIPE,
            cwd=ROOT,
            timeout=60,
            check=False,
        )
    finally:
        os.close(write_end)
    assert b"Traceback" not in proc.stderr, proc.stderr.decode()
    assert b"BrokenPipeError" not in proc.stderr
    assert proc.returncode == 1


def test_a_command_writing_to_an_open_pipe_exits_with_its_own_code() -> None:
    proc = subprocess.run(
        [sys.executable, "-m", "ramjet", "native"],
        capture_output=True,
        cwd=ROOT,
        timeout=60,
        check=False,
        env={**os.environ, "RAMJET_NATIVE": "0"},
    )
    assert proc.returncode == 0, proc.stderr.decode()
    assert proc.stdout.startswith(b"native: pure Python (off")
