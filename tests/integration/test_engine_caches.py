"""Reference-engine processes on loopback: where a conversation's prompt comes from
(HBM, host, SSD, SWA, replay) across turns, TTLs, demotion and restarts."""

from __future__ import annotations

import sys
import time
from pathlib import Path
from typing import Any

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "helpers"))

from engines import start_engine

WINDOW = 16


def convo(tag: str) -> list[dict[str, Any]]:
    # ~600 bytes of system prompt: the rendering holds two full 256-token blocks
    return [
        {"role": "system", "content": f"[{tag}] You are a careful coding agent. " * 16},
        {"role": "user", "content": f"{tag}: read main.py"},
    ]


def turn(eng: Any, msgs: list[dict[str, Any]], max_tokens: int = 3) -> dict[str, Any]:
    body = eng.chat(msgs, max_tokens=max_tokens)
    msgs.append({"role": "assistant", "content": body["choices"][0]["message"]["content"]})
    msgs.append({"role": "user", "content": "go on"})
    return body["usage"]


def test_turn_two_hits_hbm_on_its_engine_only_then_replays_one_window_after_swa_ttl() -> None:
    with start_engine("e0", swa_ttl=3) as e0, start_engine("e1", swa_ttl=3) as e1:
        msgs = convo("a")
        u1 = turn(e0, msgs)
        assert u1["prompt_tokens_details"]["cached_tokens"] == 0
        assert u1["prompt_work"]["prefilled_tokens"] == u1["prompt_tokens"] >= 512
        u2 = turn(e0, msgs)
        w2 = u2["prompt_work"]
        assert w2["hbm_tokens"] == 512 and w2["replayed_tokens"] == 0
        assert u2["prompt_tokens_details"]["cached_tokens"] == u1["prompt_tokens"]
        assert w2["epoch"] == e0.health()["epoch"]
        other = e1.chat(msgs, max_tokens=1)["usage"]  # the other engine holds nothing
        assert other["prompt_tokens_details"]["cached_tokens"] == 0
        time.sleep(3.5)  # SWA state expires; global KV does not
        w3 = turn(e0, msgs)["prompt_work"]
        assert w3["replayed_tokens"] == WINDOW
        assert w3["hbm_tokens"] + w3["host_tokens"] + w3["ssd_tokens"] >= 512
        assert w3["swa_tokens"] == 0


def test_demotion_restores_from_host_then_ssd_and_ssd_takes_longer() -> None:
    # HBM and host hold one conversation's two blocks each; three conversations push
    # the first to SSD and the second to host.
    with start_engine("e0", hbm_tokens=512, host_tokens=512, ssd_tokens=8192) as eng:
        a, b, c = convo("a"), convo("b"), convo("c")
        for m in (a, b, c):
            turn(eng, m)
        wb = turn(eng, b)["prompt_work"]
        assert (wb["host_tokens"], wb["ssd_tokens"], wb["replayed_tokens"]) == (512, 0, 0)
        wa = turn(eng, a)["prompt_work"]
        assert (wa["ssd_tokens"], wa["host_tokens"], wa["replayed_tokens"]) == (512, 0, 0)
        wc = turn(eng, c)["prompt_work"]  # c went to host when b was promoted
        assert wc["host_tokens"] + wc["ssd_tokens"] == 512
        assert wa["restore_io_ms"] > wb["restore_io_ms"] > 0


def test_restart_changes_epoch_empties_volatile_tiers_and_rereads_disk(tmp_path: Path) -> None:
    with start_engine("e0", cache_dir=tmp_path, hbm_tokens=512, host_tokens=0) as eng:
        a, b = convo("a"), convo("b")
        turn(eng, a)
        turn(eng, b)  # a's blocks go straight to SSD (no host tier)
        epoch = eng.health()["epoch"]
        eng.restart()
        assert eng.health()["epoch"] != epoch
        wb = turn(eng, b)["prompt_work"]  # b lived in HBM: gone
        assert wb["hbm_tokens"] + wb["host_tokens"] + wb["ssd_tokens"] + wb["swa_tokens"] == 0
        wa = turn(eng, a)["prompt_work"]  # a lived on disk: re-read, SWA gone -> replay
        assert wa["ssd_tokens"] == 512 and wa["replayed_tokens"] == WINDOW
        assert wa["epoch"] != epoch
