"""Reference-engine process: a full queue answers 503 with Retry-After, and a client that
disconnects mid-stream frees its slot."""

from __future__ import annotations

import json
import socket
import sys
import threading
import time
from pathlib import Path
from typing import Any

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "helpers"))

from engines import http_json, start_engine

PROMPT = {"prompt": "count slowly", "max_tokens": 40}


def test_full_queue_is_503_with_retry_after() -> None:
    with start_engine("e0", max_batch=1, max_queue=1, no_spec=True) as eng:
        results: list[int] = []

        def send() -> None:
            results.append(http_json(eng.url + "/v1/completions", PROMPT)[0])

        threads = [threading.Thread(target=send) for _ in range(2)]
        for t in threads:
            t.start()
            time.sleep(0.3)  # the first is running, the second waits
        status, headers, body = http_json(eng.url + "/v1/completions", PROMPT)
        for t in threads:
            t.join(timeout=60)
        assert status == 503 and int(headers["Retry-After"]) >= 1
        assert body["error"]["code"] == "queue_full"
        assert results == [200, 200]


def _running(eng: Any) -> int:
    return int(eng.health()["running"])


def test_client_disconnect_frees_the_slot() -> None:
    with start_engine("e0", max_batch=1, no_spec=True) as eng:
        body = json.dumps({"prompt": "stream forever", "max_tokens": 500, "stream": True}).encode()
        sock = socket.create_connection(("127.0.0.1", eng.port), timeout=30)
        sock.sendall(
            b"POST /v1/completions HTTP/1.1\r\nHost: x\r\nContent-Type: application/json\r\n"
            + f"Content-Length: {len(body)}\r\n\r\n".encode()
            + body
        )
        got = b""
        while b"data: " not in got:
            chunk = sock.recv(4096)
            assert chunk, "connection closed before the first event"
            got += chunk
        assert _running(eng) == 1
        sock.close()
        deadline = time.monotonic() + 10
        while _running(eng) and time.monotonic() < deadline:
            time.sleep(0.05)
        assert _running(eng) == 0
        status, _, done = http_json(eng.url + "/v1/completions", {"prompt": "hi", "max_tokens": 2})
        assert status == 200 and done["usage"]["completion_tokens"] == 2
