"""The sidecar beside a vLLM or SGLang engine: KV events in, signed reports out.

`wire` decodes the engines' ZMQ event format, `engine_hashes` recomputes their block
hashes, `tracker` keeps residency in router token-block keys, `stream` follows the event
sequence (gaps, replay, restarts), `scrape` and `probe` measure load and profile, and
`runner.Sidecar` ties them to the shared `ReportPublisher`. `ramjet sidecar` runs it.
pyzmq (the `[sidecar]` extra) is imported only when a stream starts.
"""
