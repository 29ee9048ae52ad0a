"""benchmarks/e2e_vllm.py --from-json: a recorded run's tables and bars are recomputed
from its requests without starting an engine, and a bad file is refused."""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]
RECORDED = ROOT / "docs" / "results" / "e2e_vllm_two_rounds.json"


def _reprint(path: Path) -> subprocess.CompletedProcess[str]:
    return subprocess.run(
        [sys.executable, str(ROOT / "benchmarks" / "e2e_vllm.py"), "--from-json", str(path)],
        capture_output=True,
        text=True,
        timeout=120,
        cwd=ROOT,
    )


def test_a_recorded_run_is_reprinted_with_the_error_split_by_later_batchmates() -> None:
    done = _reprint(RECORDED)
    assert done.returncode == 0, done.stderr
    bars = [x.strip() for x in done.stdout.splitlines() if "TTFT |rel err|" in x]
    assert len(bars) == 8  # four routers with predictions, two shapes
    assert all("shared their first-token step with a later arrival" in x for x in bars)
    assert "MISS agent: ramjet_observe TTFT |rel err| p50 31% (<= 15%), p90 70%" in done.stdout
    assert "host noise: 72 runs of requests alone on their engine" in done.stdout  # moving


def test_an_unreadable_results_file_is_refused(tmp_path: Path) -> None:
    bad = tmp_path / "r.json"
    bad.write_text("{not json")
    done = _reprint(bad)
    assert done.returncode != 0 and "--from-json: cannot read" in done.stderr
