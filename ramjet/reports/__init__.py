"""Authenticated cache-tier reports (spec: `docs/protocol.md`).

- `envelope`: the one envelope implementation: canonical bytes, Ed25519 sign/decode.
- `bodies`: the delta / snapshot / load / profile bodies (pydantic).
- `keys`: the router's key ring (public keys per engine, key ids, retired ids).
- `verify`: the checks a report passes before it may change anything.
- `processor`: per-engine sequence/epoch/trust state; applies accepted reports.
- `publisher`: the engine side: sign, sequence, ring, serve (pull) and push.
- `ingest`: the router side: pull loop per engine and the push endpoint.
- `transport`: paths, headers and batch framing shared by publisher and ingest.
- `metrics`: rejection/accept/gap/snapshot counters; trust, epoch, staleness gauges.
- `runtime`: `ReportsRuntime.build(...)`: key ring + processor + ingest from the policy.
- `config`: the `reports:` and `keys:` sections of the policy file.
"""
