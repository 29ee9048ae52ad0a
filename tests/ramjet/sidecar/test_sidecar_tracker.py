"""Engine events -> residency in router keys: copies per medium, demotion, groups and
their kinds, AllBlocksCleared, and events that must change nothing."""

from __future__ import annotations

from ramjet.keys.tokens import chain_keys, token_key_seed
from ramjet.reports.bodies import DeltaBuilder
from ramjet.sidecar.tracker import SGLANG_MEDIA, VLLM_MEDIA, ResidencyTracker
from ramjet.sidecar.wire import AllBlocksCleared, BlockRemoved, BlockStored
from ramjet.types import Tier

B = 4
TOKS = list(range(100, 112))  # three blocks
KEYS = chain_keys(TOKS, token_key_seed("m"), B)


def stored(hashes, parent=None, toks=TOKS, medium=None, group=0, kind=None, **kw):  # type: ignore[no-untyped-def]
    return BlockStored(tuple(hashes), parent, tuple(toks), B, medium=medium, group_idx=group,
                       kv_cache_spec_kind=kind, **kw)  # fmt: skip


def apply(t: ResidencyTracker, *events):  # type: ignore[no-untyped-def]
    b = DeltaBuilder()
    t.apply(list(events), b)
    return b.build()


def test_keys_follow_token_blocks_and_chain_across_events() -> None:
    t = ResidencyTracker("m", VLLM_MEDIA, B)
    d = apply(t, stored([1, 2], toks=TOKS[:8]), stored([3], parent=2, toks=TOKS[8:]))
    assert sorted(d.stored[0].keys) == sorted(KEYS) and d.stored[0].tier == "hbm"
    assert t.key_of(3) == KEYS[2]


def test_copies_are_removed_one_by_one_and_demotion_moves_to_host() -> None:
    t = ResidencyTracker("m", SGLANG_MEDIA, B)
    apply(t, stored([1, 2, 3], medium="GPU"))
    d = apply(t, stored([1, 2, 3], medium="CPU_PINNED"))  # host backup: still in HBM
    assert d.is_empty()
    d = apply(t, BlockRemoved((3,), "GPU"))  # SGLang demotion: GPU copy gone, host stays
    assert d.moved[0].tier == "host" and d.moved[0].keys == (KEYS[2],)
    d = apply(t, BlockRemoved((3,), "CPU_PINNED"))
    assert d.evicted == (KEYS[2],) and t.tier_of(KEYS[2]) is None
    # a removal of a copy that is not there, and of an unknown hash, change nothing
    before = t.resident()
    assert apply(t, BlockRemoved((3,), "GPU"), BlockRemoved((99,), "GPU")).is_empty()
    assert t.resident() == before and t.stats["unknown_removed"] == 2


def test_vllm_media_and_storage_tier() -> None:
    t = ResidencyTracker("m", VLLM_MEDIA, B)
    apply(t, stored([1], toks=TOKS[:4], medium="STORAGE"))
    assert t.tier_of(KEYS[0]) == Tier.SSD
    apply(t, stored([1], toks=TOKS[:4], medium="CPU"))
    assert t.tier_of(KEYS[0]) == Tier.HOST
    # an unknown medium changes nothing
    assert apply(t, stored([2], parent=1, toks=TOKS[4:8], medium="NVME")).is_empty()
    assert t.stats["unknown_medium"] == 1


def test_groups_gate_residency_and_swa_groups_do_not() -> None:
    t = ResidencyTracker("m", VLLM_MEDIA, B)
    apply(t, stored([1, 2, 3], group=0, kind="full_attention"))
    # a second full-attention group: a key is resident only where both hold it
    d = apply(t, stored([11], toks=TOKS[:4], group=1, kind="mla_attention"))
    assert set(d.evicted) == {KEYS[1], KEYS[2]} and t.tier_of(KEYS[0]) == Tier.HBM
    # an SWA group's stores never gate nor add residency
    d = apply(t, stored([21, 22, 23], group=2, kind="sliding_window"))
    assert d.is_empty() and t.group_kinds()[2] == "sliding_window"
    # the slowest group's fastest copy decides the tier
    apply(t, stored([11], toks=TOKS[:4], group=1, medium="CPU"), BlockRemoved((11,), "GPU", 1))
    assert t.tier_of(KEYS[0]) == Tier.HOST


def test_all_blocks_cleared_and_unmappable_stores() -> None:
    t = ResidencyTracker("m", VLLM_MEDIA, B)
    apply(t, stored([1, 2, 3]))
    d = apply(t, AllBlocksCleared())
    assert sorted(d.evicted) == sorted(KEYS) and not t.resident()
    # unknown parent (history lost), another block size, extra keys: not mapped
    assert apply(t, stored([5], parent=777, toks=TOKS[:4])).is_empty()
    assert apply(t, BlockStored((6,), None, tuple(TOKS[:8]), 8)).is_empty()
    assert apply(t, stored([7], toks=TOKS[:4], extra_keys=(("img", 1),))).is_empty()
    assert (t.stats["unknown_parent"], t.stats["block_size_mismatch"], t.stats["extra_keys"]) == (
        1, 1, 1,
    )  # fmt: skip
    # lora blocks chain from the adapter's seed
    apply(t, stored([8], toks=TOKS[:4], lora_name="a"))
    assert t.key_of(8) == chain_keys(TOKS[:4], token_key_seed("m", "a"), B)[0]


def test_snapshot_lists_resident_keys_by_tier() -> None:
    t = ResidencyTracker("m", VLLM_MEDIA, B)
    apply(t, stored([1, 2, 3]), stored([3], parent=2, toks=TOKS[8:], medium="CPU"),
          BlockRemoved((3,), "GPU"))  # fmt: skip
    snap = {tk.tier: set(tk.keys) for tk in t.snapshot()}
    assert snap == {"hbm": {KEYS[0], KEYS[1]}, "host": {KEYS[2]}}
    t.reset()
    assert t.snapshot() == [] and t.key_of(1) is None


def test_hash_only_cpu_store_adds_a_copy_of_a_known_block_only() -> None:
    """vLLM's OffloadingConnector stores a CPU copy by hash alone (no tokens, size 0)."""
    t = ResidencyTracker("m", VLLM_MEDIA, B)
    apply(t, stored([1, 2], toks=TOKS[:8], medium="GPU"))
    cpu = BlockStored((2, 77), None, (), 0, medium="CPU")
    assert apply(t, cpu).is_empty()  # block 2 still in HBM; 77 was never described
    assert t.stats["hash_only_unknown"] == 1 and t.key_of(77) is None
    d = apply(t, BlockRemoved((2,), "GPU"))  # the GPU copy goes, the CPU copy stays
    assert d.moved[0].tier == "host" and d.moved[0].keys == (KEYS[1],)
    d = apply(t, BlockRemoved((2,), "CPU"))
    assert d.evicted == (KEYS[1],) and t.tier_of(KEYS[1]) is None


def test_a_re_store_on_the_same_medium_is_not_a_new_copy() -> None:
    """vLLM re-sends BlockStored for reused blocks when a client asks for
    `kv_cache_report_mode: full`; each must not count as another copy, or one removal no
    longer clears the block (issue 15, problem 1: 31 reported where the engine held 22).
    A duplicate the engine really holds twice in one medium is then dropped at its first
    removal: an under-report until it is stored again, never an over-report."""
    t = ResidencyTracker("m", VLLM_MEDIA, B)
    apply(t, stored([1, 2, 3]))
    for _ in range(3):  # the client-driven re-reports
        assert apply(t, stored([1, 2, 3])).is_empty()
    d = apply(t, BlockRemoved((2, 3), "GPU"))
    assert sorted(d.evicted) == sorted(KEYS[1:]) and set(t.resident()) == {KEYS[0]}
    apply(t, stored([1], toks=TOKS[:4], medium="CPU"))  # another medium is another copy
    d = apply(t, BlockRemoved((1,), "GPU"))
    assert d.moved[0].tier == "host" and t.tier_of(KEYS[0]) == Tier.HOST


def test_two_engine_hashes_of_one_router_key_removed_both() -> None:
    """Issue 29: the engine keyed the same tokens under two hashes; removing both raised
    KeyError (and killed the sidecar's event thread)."""
    t = ResidencyTracker("m", VLLM_MEDIA, B)
    apply(t, stored([1], toks=TOKS[:4]), stored([2], toks=TOKS[:4]))
    assert t.key_of(1) == t.key_of(2) == KEYS[0]
    d = apply(t, BlockRemoved((1,)), BlockRemoved((2,)))
    assert list(d.evicted) == [KEYS[0]] and t.resident() == {}
    assert t.key_of(2) is None and t.stats["removed_absent_copy"] == 1
    d = apply(t, stored([3], toks=TOKS[:4]))  # stored again: reported again
    assert list(d.stored[0].keys) == [KEYS[0]]
