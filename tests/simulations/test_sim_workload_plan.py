"""Trace loaders, the capacity planner and the lower bounds."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
from sim_helpers import PROFILE, req, workload

from simulations import __main__ as cli
from simulations.bounds import floor, srpt_merged
from simulations.plan import GB, Deployment
from simulations.workload import TraceError, load_trace, replicate


def test_deployment_arithmetic() -> None:
    d = Deployment()
    assert d.usable_gib == pytest.approx(382.37, abs=0.005)
    assert d.usable_gib_per_gpu == pytest.approx(95.59, abs=0.005)
    assert d.checkpoint_miss_gib == pytest.approx(92.88, abs=0.005)
    assert d.engram_fp4_saving_bytes / GB == pytest.approx(98.0)
    low, high = Deployment(loaded_weights_gib=300), Deployment(loaded_weights_gib=320)
    assert low.hbm_kv_tokens > high.hbm_kv_tokens > 50_000_000
    assert d.swa_sessions == int(0.1 * 1024 * 1024**3 // (128 * 528 * 40))


def test_mooncake_and_agent_lines(tmp_path: Path) -> None:
    p = tmp_path / "t.jsonl"
    lines = [
        {"timestamp": 0, "input_length": 1000, "output_length": 5, "hash_ids": [1, 2]},
        {"timestamp": 2500, "input_length": 1500, "output_length": 5, "hash_ids": [1, 2, 3]},
    ]
    p.write_text("\n".join(json.dumps(x) for x in lines))
    reqs, block = load_trace(p)
    assert block == 512
    assert [r.block_tokens for r in reqs] == [[512, 488], [512, 512, 476]]
    assert reqs[1].block_keys[:2] == reqs[0].block_keys
    assert reqs[1].boundaries == ((512, reqs[0].block_keys[0]),)
    jittered, _ = load_trace(p, jitter_s=3.0, seed=5)
    again, _ = load_trace(p, jitter_s=3.0, seed=5)
    assert [r.arrival_s for r in jittered] == [r.arrival_s for r in again]
    assert all(0 <= r.arrival_s < 3.0 for r in jittered)
    a = tmp_path / "a.jsonl"
    a.write_text(
        json.dumps(
            {
                "timestamp": 0.0,
                "session_id": "x",
                "turn": 0,
                "input_length": 130,
                "output_length": 1,
                "hash_ids": [1, 2, 3],
            }
        )
    )
    (r,), block = load_trace(a)
    assert block == 64 and r.session == "x" and r.block_tokens == [64, 64, 2]


def test_azure_sessions_are_generated(tmp_path: Path) -> None:
    p = tmp_path / "az.csv"
    rows = ["TIMESTAMP,ContextTokens,GeneratedTokens"]
    rows += [f"2023-11-16 18:17:{i:02d}.5000000,{1000 + 300 * i},10" for i in range(40)]
    p.write_text("\n".join(rows))
    reqs, block = load_trace(p, seed=1)
    assert len(reqs) == 40 and block == 512
    assert reqs[0].arrival_s == 0.0 and reqs[-1].arrival_s == pytest.approx(39.0)
    shared = sum(1 for r in reqs if r.boundaries)
    assert shared > 5
    again, _ = load_trace(p, seed=1)
    assert [r.block_keys for r in again] == [r.block_keys for r in reqs]


@pytest.mark.parametrize(
    "text",
    [
        '{"timestamp": 0}',
        "not json",
        '{"timestamp": 0, "input_length": -1, "output_length": 1, "hash_ids": []}',
    ],
)
def test_bad_trace_lines_are_refused(tmp_path: Path, text: str) -> None:
    p = tmp_path / "bad.jsonl"
    p.write_text(text)
    with pytest.raises(TraceError, match=r"bad\.jsonl:1"):
        load_trace(p)


def test_floor_and_srpt_bound() -> None:
    a = list(range(1, 11))
    reqs = workload([req(0.0, a), req(0.0, [*a, 20]), req(0.5, [30, 31])])
    fl = floor(reqs, PROFILE)
    assert fl.new_tokens == [640, 64, 128]
    # request 0 ended at block 10, so the bound credits live SWA state there: no replay
    assert fl.work_s[1] == pytest.approx(PROFILE.prefill_seconds(64, 640))
    assert fl.work_s[2] == pytest.approx(PROFILE.prefill_seconds(128, 0))
    resp = srpt_merged(reqs, fl.work_s)
    # the short job runs first at double speed, then the long one, the late one preempts
    assert resp[1] == pytest.approx(fl.work_s[1] / 2)
    assert min(resp) >= 0 and sum(resp) <= sum(fl.work_s)


def test_cli_run_writes_table_csv_and_plot(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    # shared/ lies beside the checkout (CI lays a copy there)
    trace = Path(__file__).resolve().parents[3] / "shared/data/traces/agent/taubench_raw_b64.jsonl"
    if not trace.exists():
        trace = tmp_path / "t.jsonl"
        trace.write_text(
            "\n".join(
                json.dumps(
                    {
                        "timestamp": i * 100,
                        "input_length": 700,
                        "output_length": 3,
                        "hash_ids": [1, i + 2],
                    }
                )
                for i in range(60)
            )
        )
    code = cli.main(
        [
            "run",
            "--trace",
            str(trace),
            "--policies",
            "tier_aware,smg_cache_aware",
            "--rate-scale",
            "1,2",
            "--limit",
            "60",
            "--out",
            str(tmp_path / "o"),
            "--quiet",
        ]
    )
    assert code == 0
    printed = capsys.readouterr().out
    assert (
        "rate scale x2" in printed
        and "smg_cache_aware:real" in printed
        and "bound:alone" in printed
    )
    for f in ("results.csv", "table.md", "ttft_vs_load.png"):
        assert (tmp_path / "o" / f).stat().st_size > 0
    assert (
        cli.main(["run", "--trace", str(trace), "--policies", "nope", "--out", str(tmp_path / "x")])
        == 2
    )


def test_cli_plan(capsys: pytest.CaptureFixture[str]) -> None:
    assert cli.main(["plan"]) == 0
    out = capsys.readouterr().out
    assert "382.37 GiB" in out and "92.88 GiB" in out and "98.0 GB" in out


def test_replicate_keeps_sessions_and_gaps() -> None:
    a, b = list(range(1, 5)), list(range(10, 14))
    base = workload(
        [req(0.0, a, session="x"), req(1.0, [*a, 5], session="x"), req(9.0, b, session="y")]
    )
    rep = replicate(base, 3, 64, seed=2)
    assert len(rep) == 9
    sessions: dict[str, list] = {}
    for r in rep:
        sessions.setdefault(r.session or "", []).append(r)
    assert len(sessions) == 6
    for group in sessions.values():
        assert all(0.0 <= r.arrival_s <= 9.0 for r in group)
        if len(group) == 2:
            assert group[1].arrival_s - group[0].arrival_s == pytest.approx(1.0)
            assert group[1].block_keys[:4] == group[0].block_keys
    assert len({r.block_keys[0] for r in rep}) == 6


def test_floor_in_any_order_credits_blocks_a_later_request_holds() -> None:
    # request 1 holds request 0's first 10 blocks but is listed after it: in list order
    # request 0 is cold; a schedule may run request 1 first, so in any order it is not
    a = list(range(1, 11))
    reqs = workload([req(0.0, [*a, 20]), req(0.0, a), req(0.5, [30, 31])])
    assert floor(reqs, PROFILE).new_tokens == [704, 0, 128]
    fl = floor(reqs, PROFILE, any_order=True)
    assert fl.new_tokens == [64, 0, 128]
    assert all(x <= y for x, y in zip(fl.work_s, floor(reqs, PROFILE).work_s, strict=True))
