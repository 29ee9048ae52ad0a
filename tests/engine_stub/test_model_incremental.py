"""The model's incremental state: causality (perturbing future tokens leaves earlier
outputs unchanged, including rows whose compressed group is still incomplete), chunked
prefill == prefill at once, decode after prefill == prefill of the longer sequence
(tolerance 1e-2 on logits of magnitude ~5: fp32 summation order differs with the chunk
shape, and now and then that flips one FP8/FP4 rounding, which moves logits by ~1e-3;
measured max 4e-4 here)."""

from __future__ import annotations

import pytest
import torch

from engine_stub.model import MiniV4, ModelConfig

TOL = 1e-2


@pytest.fixture(scope="module")
def model() -> MiniV4:
    torch.set_num_threads(1)
    return MiniV4(ModelConfig.tiny(window=16, prefill_chunk=64), seed=0)


def _ids(n: int, seed: int = 0) -> list[int]:
    g = torch.Generator().manual_seed(seed)
    return torch.randint(0, 256, (n,), generator=g).tolist()


def test_causality_future_tokens_never_reach_earlier_rows(model: MiniV4) -> None:
    ids = _ids(90)
    base = model.prefill(model.new_state(), ids, all_logits=True)
    # Position 41 is the second token of compressed group 20 (m = 2): row 40 must not see
    # the group, nor may any row before 41 see token 41 or later.
    for cut in (41, 64, 89):
        other = ids[:cut] + [(t + 7) % 256 for t in ids[cut:]]
        got = model.prefill(model.new_state(), other, all_logits=True)
        assert torch.equal(got[:cut], base[:cut]), cut
        assert not torch.equal(got[cut:], base[cut:])


def test_incomplete_group_is_not_visible(model: MiniV4) -> None:
    st = model.new_state()
    model.prefill(st, _ids(41))
    for f in (2, 8, 14):
        assert st.glob[f].n == 20  # 41 tokens: 20 complete pairs, one token waits
        assert st.pending_kv[f].shape[0] == 1
    assert st.glob[20].n == 41 and st.pending_kv[20].shape[0] == 0


def test_chunked_prefill_equals_prefill_at_once(model: MiniV4) -> None:
    ids = _ids(200, seed=1)
    once = model.prefill(model.new_state(), ids, all_logits=True)  # internal 64-chunks
    st = model.new_state()
    parts = [
        model.prefill(st, ids[a:b], all_logits=True) for a, b in ((0, 37), (37, 38), (38, 200))
    ]
    assert (torch.cat(parts) - once).abs().max().item() < TOL
    big = MiniV4(ModelConfig.tiny(window=16, prefill_chunk=256), seed=0)
    whole = big.prefill(big.new_state(), ids, all_logits=True)  # one chunk
    assert (whole - once).abs().max().item() < TOL


def test_decode_after_prefill_equals_longer_prefill(model: MiniV4) -> None:
    ids = _ids(120, seed=2)
    want = model.prefill(model.new_state(), ids, all_logits=True)
    st = model.new_state()
    model.prefill(st, ids[:100])
    got = torch.stack([model.decode_batch([st], [t])[0] for t in ids[100:]])
    assert (got - want[100:]).abs().max().item() < TOL
    assert st.n_tokens == 120 and st.tokens == ids


def test_batched_decode_equals_single(model: MiniV4) -> None:
    a, b = model.new_state(), model.new_state()
    model.prefill(a, _ids(70, seed=3))
    model.prefill(b, _ids(33, seed=4))
    a1, b1 = a.clone(), b.clone()
    batch = model.decode_batch([a, b], [5, 9])
    assert (batch[0] - model.decode_batch([a1], [5])[0]).abs().max().item() < TOL
    assert (batch[1] - model.decode_batch([b1], [9])[0]).abs().max().item() < TOL


def test_bad_inputs_are_refused_and_change_nothing(model: MiniV4) -> None:
    st = model.new_state()
    model.prefill(st, _ids(10))
    snap = (st.n_tokens, list(st.tokens))
    with pytest.raises(ValueError):
        model.prefill(st, [1, 512])
    with pytest.raises(ValueError):
        model.prefill(st, [])
    with pytest.raises(ValueError):
        model.decode_batch([st, st], [1, 2])
    with pytest.raises(ValueError):
        model.decode_batch([st], [1, 2])
    assert (st.n_tokens, st.tokens) == snap
