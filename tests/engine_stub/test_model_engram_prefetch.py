"""Engram prefetch: overlapped fetching gives bitwise the same logits as the inline fetch
(chunked prefill, batched decode, verification); the fetch runs in the model's one worker
thread while layer 0 computes; the caller's forced kernels backend reaches the worker; a
failing fetch fails its pass and leaves nothing behind; close() joins the worker; the
engine exports bytes, fetch time and exposed wait."""

from __future__ import annotations

import threading
from collections.abc import Callable, Iterator
from typing import Any

import pytest
import torch

from engine_stub.engine import Engine, EngineSettings
from engine_stub.model import MiniV4, ModelConfig
from kernels import dispatch as K

CFG = ModelConfig.tiny(window=16, prefill_chunk=32)
PROMPTS = [list(b"Engram rows come from token ids, so fetch them early. "), list(b"n-grams!")]


@pytest.fixture(scope="module")
def models() -> Iterator[tuple[MiniV4, MiniV4]]:
    torch.set_num_threads(1)
    on, off = MiniV4(CFG, seed=3), MiniV4(CFG, seed=3, engram_prefetch=False)
    yield on, off
    on.close()
    off.close()


def _spy_gather(
    monkeypatch: pytest.MonkeyPatch, before: Callable[[torch.Tensor], None]
) -> list[threading.Thread]:
    """Wrap the dispatcher's engram_gather: run `before(table)` first, record the thread."""
    seen: list[threading.Thread] = []
    real = K.engram_gather

    def spy(table: torch.Tensor, exp: torch.Tensor, rows: torch.Tensor) -> Any:
        seen.append(threading.current_thread())
        before(table)
        return real(table, exp, rows)

    monkeypatch.setattr(K, "engram_gather", spy)
    return seen


def _run(model: MiniV4) -> list[torch.Tensor]:
    """Chunked prefill of two prompts, three batched decode steps, one verification."""
    states = [model.new_state() for _ in PROMPTS]
    out = [model.prefill(st, p, all_logits=True) for st, p in zip(states, PROMPTS, strict=True)]
    for _ in range(3):
        toks = [int(st.last_logits.argmax()) for st in states]  # type: ignore[union-attr]
        out.append(model.decode_batch(states, toks))
    _, _ = model.verify(states[0], [101, 102, 103])
    out.append(states[0].last_logits)  # type: ignore[arg-type]
    return out


def test_overlap_gives_the_inline_logits_and_the_same_bytes(models: tuple[MiniV4, MiniV4]) -> None:
    on, off = models
    b_on, b_off = on.engram_stats, off.engram_stats
    got, want = _run(on), _run(off)
    assert len(got) == len(want)
    for g, w in zip(got, want, strict=True):
        assert torch.equal(g, w)
    d_on, d_off = on.engram_stats, off.engram_stats
    passes = d_on.forwards - b_on.forwards
    assert passes == d_off.forwards - b_off.forwards >= 2 + 3 + 1
    assert d_on.bytes - b_on.bytes == d_off.bytes - b_off.bytes > 0
    assert d_on.rows - b_on.rows == d_off.rows - b_off.rows
    # Inline, every second of the fetch is waited for; its wait covers the fetch.
    assert d_off.wait_seconds - b_off.wait_seconds >= d_off.seconds - b_off.seconds > 0


def test_fetch_runs_in_the_worker_while_layer_0_computes(
    models: tuple[MiniV4, MiniV4], monkeypatch: pytest.MonkeyPatch
) -> None:
    on, off = models
    layer0_started = threading.Event()
    real_attn = K.sparse_attention

    def attn(*args: Any) -> Any:
        layer0_started.set()
        return real_attn(*args)

    monkeypatch.setattr(K, "sparse_attention", attn)
    waited_for_layer0: list[bool] = []

    def hold_layer1(table: torch.Tensor) -> None:
        # Layer 1's fetch finishes only once the forward has reached layer 0's attention:
        # possible only if the fetch does not hold up the layers before it.
        if table is on.weights.engram[1].table:
            waited_for_layer0.append(layer0_started.wait(timeout=10))

    seen = _spy_gather(monkeypatch, hold_layer1)
    on.prefill(on.new_state(), PROMPTS[1])
    assert waited_for_layer0 == [True]
    assert len(seen) == 2 and all(t.name.startswith("engram-prefetch") for t in seen)
    assert seen[0] is seen[1]  # one worker per model

    seen.clear()
    off.prefill(off.new_state(), PROMPTS[1])
    assert seen == [threading.current_thread()] * 2


def test_forced_backend_reaches_the_worker(
    models: tuple[MiniV4, MiniV4], monkeypatch: pytest.MonkeyPatch
) -> None:
    on, _ = models
    backends: list[str] = []
    seen = _spy_gather(monkeypatch, lambda table: backends.append(K.active_backend(table)))
    with K.use_backend("reference"):
        on.prefill(on.new_state(), PROMPTS[1])
    assert backends == ["reference", "reference"]
    assert all(t is not threading.current_thread() for t in seen)


def test_a_failing_fetch_fails_its_pass_and_leaves_no_job(
    models: tuple[MiniV4, MiniV4], monkeypatch: pytest.MonkeyPatch
) -> None:
    on, off = models

    def fail_layer14(table: torch.Tensor) -> None:
        if table is on.weights.engram[14].table:
            raise RuntimeError("host table unreadable")

    with monkeypatch.context() as mp:
        _spy_gather(mp, fail_layer14)
        before = on.engram_stats.forwards
        with pytest.raises(RuntimeError, match="host table unreadable"):
            on.prefill(on.new_state(), PROMPTS[1])
        assert on.engram_stats.forwards == before + 1
    st_on, st_off = on.new_state(), off.new_state()
    assert torch.equal(on.prefill(st_on, PROMPTS[1]), off.prefill(st_off, PROMPTS[1]))


def test_concurrent_forwards_on_one_model_match_sequential(models: tuple[MiniV4, MiniV4]) -> None:
    on, off = models
    want = [off.prefill(off.new_state(), p) for p in PROMPTS]
    got: dict[int, torch.Tensor] = {}

    def go(i: int) -> None:
        got[i] = on.prefill(on.new_state(), PROMPTS[i])

    threads = [threading.Thread(target=go, args=(i,)) for i in range(len(PROMPTS))]
    for t in threads:
        t.start()
    for t in threads:
        t.join(timeout=60)
    assert all(torch.equal(got[i], want[i]) for i in range(len(PROMPTS)))


def test_close_joins_the_worker_and_later_passes_fetch_inline(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    model = MiniV4(CFG, seed=3)
    seen = _spy_gather(monkeypatch, lambda table: None)
    first = model.prefill(model.new_state(), PROMPTS[1])
    worker = seen[0]
    assert worker is not threading.current_thread() and worker.is_alive()
    model.close()
    model.close()  # idempotent
    assert not worker.is_alive()
    seen.clear()
    assert torch.equal(model.prefill(model.new_state(), PROMPTS[1]), first)
    assert seen == [threading.current_thread()] * 2


def test_engine_exports_engram_bytes_time_and_wait() -> None:
    engine = Engine(EngineSettings(window=16, profile_mode="skip"))
    try:
        engine.model.prefill(engine.model.new_state(), PROMPTS[0])
        engine.refresh_gauges()
        stats = engine.model.engram_stats
        sample = engine.registry.get_sample_value
        assert sample("engine_engram_prefetch_bytes_total") == stats.bytes > 0
        assert sample("engine_engram_prefetch_seconds_total") == pytest.approx(stats.seconds)
        assert sample("engine_engram_wait_seconds_total") == pytest.approx(stats.wait_seconds)
        assert sample("engine_engram_prefetch_forwards_total") == stats.forwards == 1
        pool = engine.model.backbone.engram._pool
        assert pool is not None
        workers = list(pool._threads)
    finally:
        engine.close()
    assert workers and not any(t.is_alive() for t in workers)


def test_batched_rows_equal_rows_per_sequence(models: tuple[MiniV4, MiniV4]) -> None:
    from engine_stub.model.forward import Segment

    on, _ = models
    states = [on.new_state() for _ in PROMPTS]
    for st, p in zip(states, PROMPTS, strict=True):
        on.prefill(st, p)
    segs = [
        Segment(st, torch.tensor(t, dtype=torch.int64), st.n_tokens)
        for st, t in zip(states, ([65], [66, 67, 68]), strict=True)
    ]
    segs.append(Segment(on.new_state(), torch.tensor([69, 70], dtype=torch.int64), 0))
    for layer in CFG.engram_layers:
        batched = on.backbone.engram_rows(layer, segs)
        alone = torch.cat([on.backbone.engram_rows(layer, [sg]) for sg in segs])
        assert batched.shape == (1 + 3 + 2, 24) and torch.equal(batched, alone)
