"""Write (or --check) the test vectors of token-block keys, engine block hashes and KV
event messages: `tests/vectors/token_keys.json` and `tests/vectors/kv_events.json`.

Token keys follow `docs/prefix-keys.md` section 7 (`ramjet.keys.tokens`); engine hashes the
engines' documented algorithms (`ramjet.sidecar.engine_hashes`); event messages the wire
format of `ramjet.sidecar.wire` (both encodings, both replay framings), plus `tolerance`:
batches as a newer engine might send them (extra fields, an unknown event type, one
malformed event), written as plain msgpack values with the outcome the decoder must give
stated by hand. Overwriting a file that differs needs --force, so vectors never change
silently.
"""

from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path
from typing import Any

import msgspec

from ramjet.keys.tokens import compute_token_keys, token_key_seed
from ramjet.sidecar.engine_hashes import (
    VLLM_HASH_ALGOS,
    cbor_canonical,
    sglang_event_hash,
    sglang_page_digests,
    vllm_block_hashes,
    vllm_event_hash,
    vllm_none_hash,
)
from ramjet.sidecar.wire import (
    AllBlocksCleared,
    BlockRemoved,
    BlockStored,
    EventBatch,
    encode_batch,
    live_frames,
    replay_frames,
)

ROOT = Path(__file__).resolve().parents[1]
TOKENS = [1, 22, 333, 4444, 55555, 666666, 7777777, 2**32 - 1, 0, 9, 10, 11, 12]


def _hex(k: int) -> str:
    return f"{k:016x}"


def token_vectors() -> dict[str, Any]:
    cases = []
    for name, model, adapter, tokens, block in (
        ("three_blocks_and_tail", "m", None, TOKENS, 4),
        ("exact_blocks", "m", None, TOKENS[:8], 4),
        ("shorter_than_a_block", "m", None, TOKENS[:3], 4),
        ("adapter", "m", "lora-a", TOKENS, 4),
        ("other_model", "deepseek-ai/DeepSeek-V4.1-Flash", None, TOKENS, 4),
        ("block_16", "m", None, list(range(40)), 16),
    ):
        seed = token_key_seed(model, adapter)
        k = compute_token_keys(tokens, seed, block)
        cases.append(
            {
                "name": name,
                "model": model,
                "adapter": adapter,
                "block_tokens": block,
                "tokens": tokens,
                "seed": _hex(seed),
                "block_keys": [_hex(x) for x in k.blocks],
                "end_key": [k.boundaries[0][0], _hex(k.boundaries[0][1])],
            }
        )
    tokens, block = TOKENS[:12], 4
    vllm = {}
    for algo in VLLM_HASH_ALGOS:
        none = vllm_none_hash(algo, "ramjet-test")
        digests = vllm_block_hashes(tokens, block, algo, none)
        vllm[algo] = {
            "none_hash_seed": "ramjet-test",
            "none_hash": none.hex(),
            "digests": [d.hex() for d in digests],
            "event_hashes": [vllm_event_hash(d) for d in digests],
        }
    none = vllm_none_hash("sha256_cbor", "ramjet-test")
    first_input = cbor_canonical((none, tuple(tokens[:block]), None))
    sg = sglang_page_digests(tokens, block)
    return {
        "spec": "ramjet token-block keys (docs/prefix-keys.md section 7) and engine hashes",
        "generated_by": "scripts/gen_sidecar_vectors.py",
        "key_format": "16 lowercase hex digits",
        "cases": cases,
        "engine_hashes": {
            "tokens": tokens,
            "block_size": block,
            "vllm": vllm,
            "vllm_sha256_cbor_first_input_hex": first_input.hex(),
            "sglang": {
                "digests": [d.hex() for d in sg],
                "event_hashes": [sglang_event_hash(d) for d in sg],
            },
        },
    }


def _events() -> tuple[Any, ...]:
    return (
        BlockStored(
            block_hashes=(11, 2**64 - 1),
            parent_block_hash=None,
            token_ids=(1, 2, 3, 4, 5, 6, 7, 8),
            block_size=4,
            medium="GPU",
            kv_cache_spec_kind="full_attention",
        ),
        BlockStored(
            block_hashes=(b"\x01" * 8,),
            parent_block_hash=2**64 - 1,
            token_ids=(9, 10, 11, 12),
            block_size=4,
            lora_id=3,
            medium="CPU",
            lora_name="lora-a",
            extra_keys=(None,),
            group_idx=1,
            kv_cache_spec_kind="sliding_window",
            kv_cache_spec_sliding_window=128,
        ),
        # vLLM's OffloadingConnector: a CPU copy named by hash alone (no tokens, size 0)
        BlockStored(
            block_hashes=(11,), parent_block_hash=None, token_ids=(), block_size=0, medium="CPU"
        ),
        BlockRemoved(block_hashes=(11,), medium="GPU"),
        BlockRemoved(block_hashes=(2**64 - 1,), medium="CPU_PINNED", group_idx=1),
        AllBlocksCleared(),
    )


def event_vectors() -> dict[str, Any]:
    batch = EventBatch(1764406800.25, _events(), 0)
    out: dict[str, Any] = {
        "spec": "vLLM/SGLang KV-event wire format (ramjet/sidecar/wire.py docstring)",
        "generated_by": "scripts/gen_sidecar_vectors.py",
        "batch": {"ts": batch.ts, "dp_rank": batch.dp_rank, "n_events": len(batch.events)},
        "messages": [],
    }
    for tagged in (True, False):
        payload = encode_batch(batch, tagged=tagged)
        enc = "tagged_map" if tagged else "tag_first_array"
        out["messages"].append(
            {
                "name": f"live_{enc}",
                "kind": "live",
                "encoding": enc,
                "frames_hex": [f.hex() for f in live_frames(7, payload, b"kv@v0")],
            }
        )
        for topic, fr in ((b"kv@v0", "with_topic"), (None, "without_topic")):
            out["messages"].append(
                {
                    "name": f"replay_{fr}_{enc}",
                    "kind": "replay",
                    "encoding": enc,
                    "frames_hex": [f.hex() for f in replay_frames(7, payload, topic)],
                }
            )
    for topic, fr in ((b"kv@v0", "with_topic"), (None, "without_topic")):
        out["messages"].append(
            {
                "name": f"replay_end_{fr}",
                "kind": "replay_end",
                "encoding": None,
                "frames_hex": [f.hex() for f in replay_frames(None, b"", topic)],
            }
        )
    out["tolerance"] = tolerance_vectors()
    return out


def tolerance_vectors() -> list[dict[str, Any]]:
    """Newer-engine batches: each event's expected fate is stated, not computed."""
    stored = {
        "type": "BlockStored",
        "block_hashes": [21],
        "parent_block_hash": None,
        "token_ids": [1, 2, 3, 4],
        "block_size": 4,
        "medium": "GPU",
        "cache_level": 2,  # a field no release read here has
    }
    pinned = {"type": "BlockPinned", "block_hashes": [21]}  # a type no release has
    bad_store = {**stored, "block_size": "4"}  # wrong type: dropped, under-reports only
    bad_removal = {"type": "BlockRemoved", "block_hashes": 21}  # not an array: resync
    removed = {"type": "BlockRemoved", "block_hashes": [21], "medium": "GPU", "reason": "lru"}
    none5 = [None] * 5
    arrays = [
        # the 14 known fields (vLLM 0.32.0's, session_id last), then one more
        ["BlockStored", [21], None, [1, 2, 3, 4], 4, None, "GPU", None, None, 0, *none5, "x"],
        ["BlockPinned", [21]],
        ["BlockRemoved", [21], "GPU", 0, None, None, "x"],  # 5 known, then one more
    ]
    return [
        {
            "name": "map_batch_extra_fields_unknown_type",
            "payload_hex": msgspec.msgpack.encode(
                {
                    "ts": 1.5,
                    "events": [stored, pinned, removed],
                    "data_parallel_rank": 0,
                    "producer": "vllm-next",
                }
            ).hex(),
            "expect": {
                "events": ["BlockStored", "BlockRemoved"],
                "unknown_fields": [
                    ["EventBatch", "producer"],
                    ["BlockStored", "cache_level"],
                    ["BlockRemoved", "reason"],
                ],
                "skipped": [[1, "BlockPinned", False, False]],
                "resync_from": None,
            },
        },
        {
            "name": "array_batch_trailing_fields_unknown_type",
            "payload_hex": msgspec.msgpack.encode([1.5, arrays, 0, "extra"]).hex(),
            "expect": {
                "events": ["BlockStored", "BlockRemoved"],
                "unknown_fields": [
                    ["EventBatch", "[3]"],
                    ["BlockStored", "[15]"],
                    ["BlockRemoved", "[6]"],
                ],
                "skipped": [[1, "BlockPinned", False, False]],
                "resync_from": None,
            },
        },
        {
            "name": "malformed_store_and_removal",
            "payload_hex": msgspec.msgpack.encode(
                [1.5, [stored, bad_store, bad_removal, removed], 0]
            ).hex(),
            "expect": {
                "events": ["BlockStored", "BlockRemoved"],
                "unknown_fields": [["BlockStored", "cache_level"], ["BlockRemoved", "reason"]],
                "skipped": [[1, "BlockStored", True, False], [2, "BlockRemoved", True, True]],
                "resync_from": 1,
            },
        },
    ]


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__)
    ap.add_argument("--check", action="store_true")
    ap.add_argument("--force", action="store_true")
    args = ap.parse_args()
    bad = 0
    for path, data in (
        (ROOT / "tests/vectors/token_keys.json", token_vectors()),
        (ROOT / "tests/vectors/kv_events.json", event_vectors()),
    ):
        text = json.dumps(data, indent=1, ensure_ascii=False) + "\n"
        same = path.exists() and path.read_text("utf-8") == text
        if args.check:
            print(f"{path.name}: {'ok' if same else 'DIFFERS'}")
            bad += not same
        elif path.exists() and not same and not args.force:
            print(f"{path}: differs; pass --force to overwrite", file=sys.stderr)
            bad += 1
        else:
            path.write_text(text, "utf-8")
            print(f"wrote {path}")
    return 1 if bad else 0


if __name__ == "__main__":
    sys.exit(main())
