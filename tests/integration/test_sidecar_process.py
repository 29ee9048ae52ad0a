"""`ramjet sidecar` as a process (issue 15, problems 3 and 5):

- pointed at a tcp endpoint nobody binds (vLLM *connects* its PUB socket for a
  `tcp://HOST:PORT` endpoint, here a PUB that connects and publishes, as it would), the
  sidecar receives nothing; after `--events-warn-after` it says so in its log, naming
  what to check, and `ramjet_sidecar_events_silent` is 1 on its /metrics, beside the
  events-decoded counter and the event-to-report histogram;
- being long-polled by a router (`wait=20`), it exits promptly on SIGTERM (it took
  about 20 s: the poll was held to its deadline), answering the poll first.
"""

from __future__ import annotations

import sys
import threading
import time
import urllib.request
from pathlib import Path

import pytest

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "helpers"))

from engines import free_port
from sidecars import SidecarProcess

pytestmark = pytest.mark.timeout(60)


def test_silent_tcp_endpoint_warns_and_sigterm_is_prompt(tmp_path: Path) -> None:
    import msgspec
    import zmq

    from ramjet.reports.keys import write_keypair

    priv, _pub, _ = write_keypair(tmp_path / "keys", "v0-sc")
    ev = f"tcp://127.0.0.1:{free_port()}"
    ctx = zmq.Context()
    pub = ctx.socket(zmq.PUB)
    pub.setsockopt(zmq.LINGER, 0)
    pub.connect(ev)  # what vLLM does with a tcp://HOST:PORT endpoint
    stop = threading.Event()

    def publish() -> None:
        seq = 0
        while not stop.is_set():
            batch = msgspec.msgpack.encode([time.time(), [{"type": "AllBlocksCleared"}], None])
            pub.send_multipart([b"", seq.to_bytes(8, "big"), batch])
            seq += 1
            time.sleep(0.05)

    t = threading.Thread(target=publish, daemon=True)
    t.start()
    port = free_port()
    argv = [sys.executable, "-m", "ramjet", "sidecar", "--engine-kind", "vllm",
            "--engine-id", "v0", "--engine-url", "http://127.0.0.1:9", "--events", ev,
            "--key", str(priv), "--key-id", "v0-sc", "--model", "m", "--block-tokens", "32",
            "--port", str(port), "--profile", "skip", "--no-scrape",
            "--events-warn-after", "0.5", "--log-level", "INFO"]  # fmt: skip
    sc = SidecarProcess(argv, port, tmp_path / "sidecar.log")
    try:
        deadline = time.monotonic() + 10
        while "ramjet_sidecar_events_silent 1.0" not in sc.metrics_text():
            assert time.monotonic() < deadline, sc.metrics_text()
            time.sleep(0.1)
        text = sc.metrics_text()
        assert 'ramjet_sidecar_events_decoded_total{event="BlockStored"} 0.0' in text
        assert "ramjet_sidecar_event_to_report_seconds_bucket" in text
        log = sc.log.read_text()
        assert "no KV event from " + ev in log and "must BIND" in log, log[-2000:]
        assert sc.health()["last_event_seq"] is None

        h = sc.health()
        got: dict[str, float] = {}

        def long_poll() -> None:
            url = f"{sc.url}/ramjet/reports?epoch={h['epoch']}&after={h['seq']}&wait=20"
            t0 = time.monotonic()
            with urllib.request.urlopen(url, timeout=30) as resp:
                resp.read()
                got["status"] = resp.status
            got["s"] = time.monotonic() - t0

        poller = threading.Thread(target=long_poll)
        poller.start()
        time.sleep(0.5)  # the poll is parked
        took = sc.stop(timeout_s=15)
        poller.join(5)
        assert took < 3.0, f"sidecar took {took:.1f} s to exit on SIGTERM"
        assert sc.proc.returncode == 0, sc.log.read_text()[-2000:]
        assert got.get("status") == 200 and got["s"] < 5, got
    finally:
        sc.stop()
        stop.set()
        t.join(2)
        pub.close(0)
        ctx.term()
