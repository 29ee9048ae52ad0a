"""ramjet.keys.prefix against the committed test vectors (tests/vectors/prefix_keys.json)."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path
from typing import Any

import pytest
import xxhash

from ramjet.keys.prefix import (
    BLOCK_BYTES,
    SPEC_VERSION,
    compute_keys,
    key_seed,
    render_chat,
    render_completion,
)

ROOT = Path(__file__).resolve().parents[3]
VECTORS = ROOT / "tests" / "vectors" / "prefix_keys.json"
DOC = json.loads(VECTORS.read_text("utf-8"))
CASES = {c["name"]: c for c in DOC["cases"]}


def _render(case: dict[str, Any]) -> Any:
    if case["kind"] == "chat":
        return render_chat(case["input"]["messages"], case["input"].get("tools"))
    return render_completion(case["input"]["prompt"])


def test_file_header_matches_implementation() -> None:
    assert DOC["spec_version"] == SPEC_VERSION
    assert DOC["block_bytes"] == BLOCK_BYTES


def test_vectors_cover_the_required_cases() -> None:
    lengths = {c["name"]: c["length"] for c in DOC["cases"]}
    assert lengths["chat_exactly_one_block"] == BLOCK_BYTES
    edge = CASES["chat_boundary_on_block_edge"]
    assert edge["boundaries"][0] == BLOCK_BYTES and edge["length"] == 2 * BLOCK_BYTES
    kinds = {c["kind"] for c in DOC["cases"]}
    assert kinds == {"chat", "completion"}
    assert any("tools" in c["input"] for c in DOC["cases"])
    assert any(c["adapter"] for c in DOC["cases"])
    assert any(c.get("cache_salt") for c in DOC["cases"])


@pytest.mark.parametrize("name", sorted(CASES))
def test_vector(name: str) -> None:
    case = CASES[name]
    rendered = _render(case)
    assert rendered.text.hex() == case["rendering_hex"]
    assert rendered.text.decode("utf-8") == case["rendering_text"]
    assert list(rendered.boundaries) == case["boundaries"]
    seed = key_seed(case["model"], case["adapter"], case.get("cache_salt"))
    assert f"{seed:016x}" == case["seed"]
    keys = compute_keys(rendered, seed)
    assert [f"{k:016x}" for k in keys.blocks] == case["block_keys"]
    assert [[o, f"{k:016x}"] for o, k in keys.boundaries] == case["boundary_keys"]
    assert keys.length == case["length"]


@pytest.mark.parametrize("name", sorted(CASES))
def test_vector_chaining_from_the_spec(name: str) -> None:
    """Re-derive the keys from the rendering bytes with xxhash directly, as the spec
    states them, independent of compute_keys."""
    case = CASES[name]
    text = bytes.fromhex(case["rendering_hex"])
    tag = f"ramjet-prefix-v{SPEC_VERSION}\x00{case['model']}\x00{case['adapter'] or ''}"
    if case.get("cache_salt") is not None:
        tag += f"\x00salt\x00{case['cache_salt']}"
    seed = xxhash.xxh3_64_intdigest(tag.encode())
    chain = [seed]
    for i in range(len(text) // BLOCK_BYTES):
        chain.append(
            xxhash.xxh3_64_intdigest(text[i * BLOCK_BYTES : (i + 1) * BLOCK_BYTES], chain[-1])
        )
    assert [f"{k:016x}" for k in chain[1:]] == case["block_keys"]
    for off, hexkey in case["boundary_keys"]:
        j = off // BLOCK_BYTES
        k = xxhash.xxh3_64_intdigest(text[j * BLOCK_BYTES : off], chain[j])
        assert f"{k:016x}" == hexkey


def test_worked_example_keys_are_pinned() -> None:
    """The keys quoted in docs/prefix-keys.md; a change here is a spec change."""
    case = CASES["worked_example"]
    assert case["seed"] == "c30b08808e6fea1f"
    assert case["block_keys"] == ["f172d71edd95601e"]
    assert case["boundary_keys"][-1] == [493, "72c063d50b61dd3f"]
    doc = (ROOT / "docs" / "prefix-keys.md").read_text("utf-8")
    for k in [case["seed"], *case["block_keys"], *(h for _, h in case["boundary_keys"])]:
        assert k in doc


def test_turn1_vector_is_a_prefix_of_the_worked_example() -> None:
    a, b = CASES["worked_example_turn1"], CASES["worked_example"]
    assert b["rendering_hex"].startswith(a["rendering_hex"])
    assert b["boundary_keys"][: len(a["boundary_keys"])] == a["boundary_keys"]


def test_generator_agrees_with_the_committed_file_and_refuses_silent_rewrites(
    tmp_path: Path,
) -> None:
    script = ROOT / "scripts" / "gen_prefix_vectors.py"
    ok = subprocess.run(
        [sys.executable, str(script), "--check"], cwd=ROOT, capture_output=True, timeout=60
    )
    assert ok.returncode == 0, ok.stderr.decode()
    tampered = tmp_path / "v.json"
    tampered.write_text(VECTORS.read_text("utf-8").replace(CASES["chat_minimal"]["seed"], "0" * 16))
    before = tampered.read_text()
    refused = subprocess.run(
        [sys.executable, str(script), "--out", str(tampered)],
        cwd=ROOT,
        capture_output=True,
        timeout=60,
    )
    assert refused.returncode == 1 and b"--force" in refused.stderr
    assert tampered.read_text() == before
