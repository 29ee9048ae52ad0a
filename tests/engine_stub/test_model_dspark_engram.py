"""DSpark: drafts are valid, confidences and acceptance lie in [0, 1], and speculative
decoding emits exactly plain greedy decoding (random, oracle and half-right drafts).
Engram: rows are deterministic, in range, in their own head's slice, from distinct primes,
a function of the last four compressed ids; the prefetch is accounted."""

from __future__ import annotations

import pytest
import torch

from engine_stub.model import MiniV4, ModelConfig
from engine_stub.model.forward import Segment


@pytest.fixture(scope="module")
def model() -> MiniV4:
    torch.set_num_threads(1)
    return MiniV4(ModelConfig.tiny(window=16, prefill_chunk=128), seed=0)


PROMPT = list(b"Speculative decoding must not change what greedy decoding says. ")


def _plain(model: MiniV4, n: int) -> list[int]:
    st = model.new_state()
    model.prefill(st, PROMPT)
    out = []
    for _ in range(n):
        tok = int(st.last_logits.argmax())  # type: ignore[union-attr]
        out.append(tok)
        model.decode_batch([st], [tok])
    return out


def test_draft_shapes_and_confidences(model: MiniV4) -> None:
    st = model.new_state()
    model.prefill(st, PROMPT)
    d = model.draft(st, 5)
    assert d.tokens.shape == (5,) and d.confidences.shape == (5,)
    assert all(0 <= t < 512 for t in d.tokens.tolist())
    assert bool(((d.confidences > 0) & (d.confidences < 1)).all())
    assert bool((d.survival[1:] <= d.survival[:-1]).all())
    assert d.first == int(st.last_logits.argmax())  # type: ignore[union-attr]
    with pytest.raises(ValueError):
        model.draft(st, 6)


def test_speculative_output_equals_plain_greedy(model: MiniV4) -> None:
    want = _plain(model, 24)
    st = model.new_state()
    model.prefill(st, PROMPT)
    got: list[int] = []
    rates = []
    while len(got) < 24:
        emitted, stats = model.verify(st, model.draft(st, 4).tokens)
        assert 1 <= len(emitted) == stats.emitted <= 5
        assert 0.0 <= stats.acceptance <= 1.0
        rates.append(stats.acceptance)
        got += emitted
    assert got[:24] == want
    assert st.tokens == PROMPT + got


def test_oracle_and_half_right_drafts(model: MiniV4) -> None:
    want = _plain(model, 12)
    st = model.new_state()
    model.prefill(st, PROMPT)
    emitted, stats = model.verify(st, want[1:6])  # all five right
    assert emitted == want[:6] and stats.accepted == 5 and stats.acceptance == 1.0
    wrong = (want[8] + 1) % 256
    emitted, stats = model.verify(st, [want[7], wrong, want[9]])  # first right only
    assert emitted == want[6:8] and stats.accepted == 1
    assert abs(stats.acceptance - 1 / 3) < 1e-9
    assert st.tokens == PROMPT + want[:8]
    # The rolled-back state continues exactly like plain decoding.
    emitted, _ = model.verify(st, [])
    assert emitted == [want[8]]


def test_engram_rows_deterministic_in_range_distinct_primes(model: MiniV4) -> None:
    cfg = model.cfg
    primes = torch.cat(
        [model.weights.engram[layer].primes.flatten() for layer in cfg.engram_layers]
    )
    assert primes.numel() == 2 * 24 and len(set(primes.tolist())) == 48
    assert int(primes.min()) > 1000
    st = model.new_state()
    ids = torch.tensor(list(b"Hello hello  HELLO\tworld"), dtype=torch.int64)
    seg = [Segment(st, ids, 0)]
    for layer in cfg.engram_layers:
        ew = model.weights.engram[layer]
        rows = model.backbone.engram_rows(layer, seg)
        assert torch.equal(rows, model.backbone.engram_rows(layer, seg))
        assert rows.shape == (ids.numel(), 24)
        lo = ew.offsets.flatten()[None, :]
        hi = lo + ew.primes.flatten()[None, :]
        assert bool(((rows >= lo) & (rows < hi)).all())
        assert int(rows.max()) < ew.table.shape[0]
        # "Hello" at 0..4 and "hello" at 6..10 share compressed ids: same rows once the
        # 4-gram window is inside the word (positions 3, 4 vs 9, 10).
        assert torch.equal(rows[3:5], rows[9:11])
        # "HELLO" matches "hello" from its 4th letter on ("  HE" vs " hel" differ before).
        assert torch.equal(rows[16:18], rows[9:11])
    other = MiniV4(cfg, seed=0)
    for layer in cfg.engram_layers:
        assert torch.equal(
            other.backbone.engram_rows(layer, seg), model.backbone.engram_rows(layer, seg)
        )


def test_engram_prefetch_is_accounted(model: MiniV4) -> None:
    before = model.engram_stats.bytes
    model.prefill(model.new_state(), list(b"abcdefgh"))
    per_row = 32 + 1  # 32 FP8 values + one exponent
    assert model.engram_stats.bytes - before == 8 * 24 * 2 * per_row
