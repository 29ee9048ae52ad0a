"""`ramjet pool-reporter`: a bad argument or key is refused with exit status 2 and a
message naming it, and nothing is created."""

from __future__ import annotations

from pathlib import Path

import pytest

from ramjet.cli import main
from ramjet.reports.keys import write_keypair


@pytest.mark.parametrize(
    ("extra", "message"),
    [
        (["--id", "bad id!"], "--id"),
        (["--key-map", "nope"], "--key-map"),
        (["--interval", "0"], "--interval"),
        (["--port", "70000"], "--port"),
    ],
)
def test_a_bad_argument_is_refused_and_creates_nothing(
    tmp_path: Path, capsys: pytest.CaptureFixture[str], extra: list[str], message: str
) -> None:
    priv, _, _ = write_keypair(tmp_path / "keys", "host0-a")
    pool = tmp_path / "pool"
    args = ["pool-reporter", "--pool-dir", str(pool), "--id", "host0", "--tier", "host",
            "--key", str(priv), "--key-id", "host0-a", "--port", "0"]  # fmt: skip
    assert main([*args, *extra]) == 2
    assert message in capsys.readouterr().err
    assert not pool.exists()


def test_a_missing_key_is_refused(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    pool = tmp_path / "pool"
    code = main(["pool-reporter", "--pool-dir", str(pool), "--id", "host0", "--tier", "swa",
                 "--key", str(tmp_path / "none.key"), "--key-id", "k", "--port", "0"])  # fmt: skip
    assert code == 2 and "pool-reporter:" in capsys.readouterr().err
    assert not pool.exists()
