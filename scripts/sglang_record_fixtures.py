"""Record KV-event fixtures from SGLang's own event module (issue 15).

    .venv/bin/python scripts/sglang_record_fixtures.py       # writes the file below

`tests/vectors/sglang_events.json`, which `tests/ramjet/sidecar/test_sidecar_sglang_fixtures.py`
reads:

1. `cases`: batches built from SGLang's classes (`sglang.srt.disaggregation.kv_events`:
   `KVEventBatch`, `BlockStored` with every field set, each `StorageMedium`, signed
   64-bit hashes as SGLang's namespaced hashes are, `BlockRemoved`, `AllBlocksCleared`),
   encoded as its publisher encodes them (`msgspec.msgpack.Encoder().encode(batch)`),
   with each event's fields as `msgspec.structs.asdict` gives them.
2. `live` and `replay`: what SGLang's own `ZmqEventPublisher` (PUB on an `ipc://`
   endpoint, ROUTER replay endpoint, a topic) put on the wire for those batches: the
   frames a SUB socket received, and the replay socket's answer to `[b"", seq 0]` frame
   by frame, end marker included.

SGLang has no CPU build to serve a model here, but its event module imports on CPU:
`pip install --no-deps sglang==0.5.23` plus the three modules its import chain needs
that the vLLM environment lacks (orjson, IPython, traitlets), into `.cache/sglang-events`
(a `--target` directory, not a venv), run with `.venv-vllm`'s Python (msgspec, pyzmq,
pydantic and torch come from there). About 30 s the first time; nothing else is
downloaded; sockets are `ipc://` in a temporary directory.
"""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT / "tests" / "helpers"))
sys.path.insert(0, str(ROOT / "scripts"))

from vllm_record_fixtures import VECTORS  # noqa: E402

SGLANG = "sglang==0.5.23"
EXTRA = ("orjson==3.13.0", "ipython==9.18.1", "traitlets==5.16.1")
TARGET = ROOT / ".cache" / "sglang-events"

RECORD = r"""
import base64, json, os, sys, tempfile, time
import msgspec, zmq
from importlib.metadata import version
from sglang.srt.disaggregation.kv_events import (
    AllBlocksCleared, BlockRemoved, BlockStored, KVEventBatch, StorageMedium, ZmqEventPublisher,
)

def b64(b):
    return base64.b64encode(b).decode()

stored = BlockStored(
    block_hashes=[-(2**63) + 5, 2**63 - 1, 17], parent_block_hash=-42,
    token_ids=list(range(48)), block_size=16, lora_id=7, medium=StorageMedium.GPU.value,
    cache_salt="salt-1", session_id="sess-1", lora_name="adapter-a",
)
first = BlockStored(
    block_hashes=[123456789], parent_block_hash=None, token_ids=list(range(100, 116)),
    block_size=16, lora_id=None,
)
host = BlockStored(
    block_hashes=[17], parent_block_hash=None, token_ids=list(range(16)), block_size=16,
    lora_id=None, medium=StorageMedium.CPU.value,
)
disk = BlockStored(
    block_hashes=[17], parent_block_hash=None, token_ids=list(range(16)), block_size=16,
    lora_id=None, medium=StorageMedium.DISK.value,
)
external = BlockStored(
    block_hashes=[99], parent_block_hash=None, token_ids=list(range(16)), block_size=16,
    lora_id=None, medium=StorageMedium.EXTERNAL.value,
)
removed = BlockRemoved(block_hashes=[17, -(2**63) + 5], medium=StorageMedium.GPU.value)
removed_host = BlockRemoved(block_hashes=[17], medium=StorageMedium.CPU.value)
cases = {
    "stored_every_field": KVEventBatch(ts=1.5, events=[stored], attn_dp_rank=None),
    "first_block_defaults": KVEventBatch(ts=2.0, events=[first]),
    "host_disk_external_copies": KVEventBatch(ts=2.5, events=[host, disk, external], attn_dp_rank=1),
    "removed_and_cleared": KVEventBatch(
        ts=3.0, events=[removed, removed_host, AllBlocksCleared()], attn_dp_rank=0
    ),
}
enc = msgspec.msgpack.Encoder()
out = {"sglang": version("sglang"), "cases": {}}
for name, batch in cases.items():
    out["cases"][name] = {
        "payload_b64": b64(enc.encode(batch)),
        "ts": batch.ts, "attn_dp_rank": batch.attn_dp_rank,
        "events": [{"type": type(e).__name__, **msgspec.structs.asdict(e)} for e in batch.events],
    }

# the same batches through SGLang's own publisher
tmp = tempfile.mkdtemp(prefix="sgl-events-")
pub_ep, replay_ep = f"ipc://{tmp}/pub", f"ipc://{tmp}/replay"
ctx = zmq.Context.instance()
sub = ctx.socket(zmq.SUB)
sub.setsockopt(zmq.SUBSCRIBE, b"")
pub = ZmqEventPublisher(0, endpoint=pub_ep, replay_endpoint=replay_ep, topic="kv-events")
sub.connect(pub_ep)
time.sleep(0.5)  # the SUB joins before the first batch
for batch in cases.values():
    pub.publish(batch)
live = []
while len(live) < len(cases) and sub.poll(5000):
    live.append(sub.recv_multipart())
dealer = ctx.socket(zmq.DEALER)
dealer.setsockopt(zmq.LINGER, 0)
dealer.connect(replay_ep)
dealer.send_multipart([b"", (0).to_bytes(8, "big")])
replay = []
while dealer.poll(5000):
    msg = dealer.recv_multipart()
    replay.append(msg)
    if (-1).to_bytes(8, "big", signed=True) in msg:
        break
pub.shutdown()
sub.close(0)
dealer.close(0)
assert len(live) == len(cases), f"{len(live)} live frames of {len(cases)}"
assert replay and (-1).to_bytes(8, "big", signed=True) in replay[-1], "no replay end marker"
out["publisher"] = {"endpoint": "ipc://.../pub", "replay_endpoint": "ipc://.../replay",
                    "topic": "kv-events"}
out["live"] = [{"frames_b64": [b64(x) for x in f]} for f in live]
out["replay"] = [{"frames_b64": [b64(x) for x in m]} for m in replay]
json.dump(out, sys.stdout)
"""


def install(python: Path) -> None:
    """SGLang without its dependencies, and what its event module's imports need."""
    stamp = TARGET / ".ready"
    want = " ".join((SGLANG, *EXTRA))
    if stamp.exists() and stamp.read_text() == want:
        return
    TARGET.mkdir(parents=True, exist_ok=True)
    print(f"installing {want} into {TARGET} (--no-deps)", flush=True)
    subprocess.run(
        [str(python), "-m", "pip", "install", "-q", "--no-deps", "--upgrade",
         "--target", str(TARGET), SGLANG, *EXTRA],
        check=True,
    )  # fmt: skip
    stamp.write_text(want)


def main() -> int:
    from vllm_engines import vllm_env

    python = vllm_env().python
    install(python)
    env = {"PYTHONPATH": str(TARGET), "PATH": "/usr/bin:/bin"}
    proc = subprocess.run(
        [str(python), "-c", RECORD], capture_output=True, text=True, env=env, check=False
    )
    if proc.returncode != 0:
        raise SystemExit(f"SGLang event recording failed:\n{proc.stderr[-3000:]}")
    data = json.loads(proc.stdout)
    data["recorded_by"] = (
        "scripts/sglang_record_fixtures.py (SGLang's own classes and ZmqEventPublisher, "
        f"{SGLANG} --no-deps in .venv-vllm)"
    )
    path = VECTORS / "sglang_events.json"
    path.write_text(json.dumps(data, indent=1) + "\n")
    print(f"wrote {path}: {len(data['cases'])} class batches, {len(data['live'])} live "
          f"messages, {len(data['replay'])} replay messages")  # fmt: skip
    return 0


if __name__ == "__main__":
    sys.exit(main())
