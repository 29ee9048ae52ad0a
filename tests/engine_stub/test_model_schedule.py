"""The 40 + 3 layer schedule, the roles and the reuse wiring at the real indices; the
memory model (890 bytes/token at full size) from the config and from the CLI; the byte
tokenizer and Engram's compressed ids."""

from __future__ import annotations

import subprocess
import sys

import pytest

from engine_stub.model import ByteTokenizer, ModelConfig, memory_model

CFG = ModelConfig.tiny(window=16)


def test_ratios_and_roles_at_the_real_indices() -> None:
    assert [CFG.ratio(i) for i in range(43)] == [0, 0] + [2] * 18 + [1] * 20 + [0] * 3
    roles = {i: CFG.role(i) for i in range(43)}
    assert [i for i, r in roles.items() if r == "window"] == [0, 1, 40, 41, 42]
    assert [i for i, r in roles.items() if r == "full"] == [2, 8, 14, 20]
    assert [i for i, r in roles.items() if r == "reindex"] == [24, 28, 32, 36]
    reuse = [i for i, r in roles.items() if r == "reuse"]
    assert reuse == [i for i in range(2, 40) if i not in (2, 8, 14, 20, 24, 28, 32, 36)]
    assert CFG.candidate_source == 20
    assert CFG.engram_layers == (1, 14)


def test_reuse_wiring() -> None:
    for layer in (0, 1, 40, 41, 42):
        assert CFG.kv_source(layer) is None and CFG.topk_source(layer) is None
    # Encoder: each reuse layer reads the latest full layer's KV and positions.
    for layer in range(2, 20):
        src = max(f for f in (2, 8, 14) if f <= layer)
        assert CFG.kv_source(layer) == src and CFG.topk_source(layer) == src
    # Decoder: KV always from layer 20 (which compresses the final encoder state);
    # positions from the latest of 20 / the reindex layers.
    for layer in range(20, 40):
        assert CFG.kv_source(layer) == 20
        assert CFG.topk_source(layer) == max(s for s in (20, 24, 28, 32, 36) if s <= layer)


def test_memory_model_full_size() -> None:
    mm = memory_model(ModelConfig.full())
    assert mm.global_kv_bytes_per_token == 890
    assert mm.global_kv_bytes_per_block == 890 * 256
    assert mm.swa_bytes_per_sequence == 128 * 528 * 40
    assert mm.engram_modules == 2
    assert 195e9 < mm.engram_params < 197e9  # "196B parameters in the two modules"


def test_memory_model_tiny_follows_the_same_formula() -> None:
    mm = memory_model(CFG)
    # (32/2 + 32/16) KV + (32/2 + 32/32) index key, x (3 x 0.5 + 1) entries per token.
    assert mm.global_kv_bytes_per_token == (18 + 17) * 2.5
    assert mm.swa_bytes_per_sequence == 16 * 33 * 40
    assert CFG.global_bytes(256) == 256 * 87.5


def test_memory_cli_prints_890_for_full() -> None:
    out = subprocess.run(
        [sys.executable, "-m", "engine_stub", "memory", "--config", "full"],
        capture_output=True,
        text=True,
        check=True,
        timeout=120,
    ).stdout
    assert "global_kv_bytes_per_token: 890\n" in out
    assert f"swa_bytes_per_sequence: {128 * 528 * 40} (128 x 528 x 40)" in out


def test_tokenizer_round_trips_any_text() -> None:
    tok = ByteTokenizer()
    for text in ("", "hello", "naïve café — 東京 🚀", "a\x00b\tc\n"):
        ids = tok.encode(text)
        assert ids == list(text.encode("utf-8"))
        assert tok.decode(ids) == text
    assert tok.decode([tok.bos, *tok.encode("x"), tok.eos]) == "x"


def test_compressed_ids() -> None:
    c = ByteTokenizer().compressed_ids()
    assert len(c) == 512
    assert c[ord("A")] == c[ord("a")]
    assert c[ord("Z")] == c[ord("z")] != c[ord("a")]
    assert len({c[ord(w)] for w in " \t\n\r\x0b\x0c"}) == 1
    assert len({c[b] for b in range(128, 256)}) == 128  # UTF-8 fragments keep their ids
    assert all(c[i] == i for i in range(256, 512))
    assert all(c[c[i]] == c[i] for i in range(512))  # a compressed id is its own class


def test_config_rejects_bad_widths() -> None:
    with pytest.raises(ValueError):
        ModelConfig.tiny(window=1)
    with pytest.raises(ValueError):
        ModelConfig(head_dim=24)
