"""The engine-facing client: the `EngineTransport` contract and `fetch` (`base`), and its
HTTP/1.1 implementation (`http1`). Used by the proxy, the sidecar and the reports."""
