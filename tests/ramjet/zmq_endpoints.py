"""Free loopback TCP endpoints for ZMQ sockets in tests."""

from __future__ import annotations

import socket


def free_endpoint() -> str:
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as s:
        s.bind(("127.0.0.1", 0))
        return f"tcp://127.0.0.1:{s.getsockname()[1]}"
