"""Token-block keys (docs/prefix-keys.md section 7) and the engines' block hashes against
tests/vectors/token_keys.json, re-derived here from the written algorithms with
hashlib, pickle and xxhash alone; a real HF tokenizer built in the test; key pools."""

from __future__ import annotations

import hashlib
import json
import pickle
import struct
from pathlib import Path

import pytest
import xxhash

from ramjet.config import PolicyFileError, parse_policy
from ramjet.keys.pools import KeyPoolConfig, KeyPools
from ramjet.keys.prefix import render_chat
from ramjet.keys.tokens import (
    ByteTokenizer,
    HFTokenizer,
    TokenizerFileError,
    chain_keys,
    compute_token_keys,
    token_key_seed,
)
from ramjet.request.parse import ParseLimits, RequestError, parse_request
from ramjet.sidecar.engine_hashes import (
    HASH_FUNCTIONS,
    cbor_canonical,
    engine_block_hashes,
    sglang_event_hash,
    sglang_page_digests,
    vllm_block_hashes,
    vllm_none_hash,
)
from ramjet.types import EngineId

V = json.loads(
    (Path(__file__).resolve().parents[2] / "vectors" / "token_keys.json").read_text("utf-8")
)


@pytest.mark.parametrize("case", V["cases"], ids=lambda c: c["name"])
def test_token_keys_match_vectors_and_spec(case: dict) -> None:
    seed = token_key_seed(case["model"], case["adapter"])
    assert f"{seed:016x}" == case["seed"]
    tag = f"ramjet-tokens-v1\0{case['model']}\0{case['adapter'] or ''}".encode()
    assert xxhash.xxh3_64_intdigest(tag) == seed
    b, toks = case["block_tokens"], case["tokens"]
    keys = compute_token_keys(toks, seed, b)
    assert [f"{k:016x}" for k in keys.blocks] == case["block_keys"]
    # re-derive from the spec's words: xxh3 over little-endian u32 tokens, chained
    h, expect = seed, []
    for i in range(len(toks) // b):
        h = xxhash.xxh3_64_intdigest(struct.pack(f"<{b}I", *toks[i * b : (i + 1) * b]), h)
        expect.append(h)
    assert list(keys.blocks) == expect
    j = len(toks) // b
    tail = struct.pack(f"<{len(toks) - j * b}I", *toks[j * b :])
    end = xxhash.xxh3_64_intdigest(tail, expect[j - 1] if j else seed)
    assert keys.boundaries == ((len(toks), end),)
    assert case["end_key"] == [len(toks), f"{end:016x}"]
    # a chain continued from a block key equals the whole chain's tail
    if j >= 2:
        assert chain_keys(toks[b:], keys.blocks[0], b) == list(keys.blocks[1:])


def test_token_ids_outside_32_bits_are_refused() -> None:
    with pytest.raises(ValueError, match="2\\*\\*32"):
        chain_keys([2**32], 1, 1)
    with pytest.raises(ValueError, match="2\\*\\*32"):
        chain_keys([-1], 1, 1)


EH = V["engine_hashes"]


@pytest.mark.parametrize("algo", ["sha256", "sha256_cbor", "xxhash", "xxhash_cbor"])
def test_vllm_hashes_match_vectors_and_documented_algorithm(algo: str) -> None:
    toks, b, vec = EH["tokens"], EH["block_size"], EH["vllm"][algo]
    none = vllm_none_hash(algo, vec["none_hash_seed"])  # type: ignore[arg-type]
    assert none.hex() == vec["none_hash"]
    got = vllm_block_hashes(toks, b, algo, none)  # type: ignore[arg-type]
    assert [d.hex() for d in got] == vec["digests"]
    assert [int.from_bytes(d, "big") & (2**64 - 1) for d in got] == vec["event_hashes"]

    # independently: hash_fn((parent or NONE_HASH, tuple(tokens), None))
    def fn(v: object) -> bytes:
        raw = (
            pickle.dumps(v, protocol=pickle.HIGHEST_PROTOCOL)
            if "cbor" not in algo
            else (cbor_canonical(v))
        )
        return (
            hashlib.sha256(raw).digest() if algo.startswith("sha") else xxhash.xxh3_128_digest(raw)
        )

    assert fn(vec["none_hash_seed"]) == none
    prev = none
    for i, d in enumerate(got):
        prev = fn((prev, tuple(toks[i * b : (i + 1) * b]), None))
        assert prev == d
    assert engine_block_hashes("vllm", toks, b, algo=algo, none_hash=none) == vec["event_hashes"]  # type: ignore[arg-type]


def test_cbor_input_is_rfc8949_canonical() -> None:
    """(NONE_HASH, (1, 22, 333, 4444), None): array(3), bytes(32), array(4) of shortest
    uints, null, byte by byte."""
    none = vllm_none_hash("sha256_cbor", "ramjet-test")
    want = (
        b"\x83" + b"\x58\x20" + none
        + b"\x84" + b"\x01" + b"\x16" + b"\x19\x01\x4d" + b"\x19\x11\x5c"
        + b"\xf6"
    )  # fmt: skip
    assert cbor_canonical((none, (1, 22, 333, 4444), None)) == want
    assert want.hex() == EH["vllm_sha256_cbor_first_input_hex"]
    assert (
        HASH_FUNCTIONS["sha256_cbor"]((none, (1, 22, 333, 4444), None))
        == hashlib.sha256(want).digest()
    )


def test_sglang_page_hashes_match_vectors_and_algorithm() -> None:
    toks, b = EH["tokens"], EH["block_size"]
    got = sglang_page_digests(toks, b)
    assert [d.hex() for d in got] == EH["sglang"]["digests"]
    prev = b""
    for i, d in enumerate(got):
        page = b"".join(t.to_bytes(4, "little") for t in toks[i * b : (i + 1) * b])
        prev = hashlib.sha256(prev + page).digest()
        assert prev == d
    # SGLang's hash_str_to_int64: the hex digest's first 16 digits as a signed int64
    want = []
    for d in got:
        u = int(d.hex()[:16], 16)
        want.append(u - 2**64 if u >= 2**63 else u)
    assert want == EH["sglang"]["event_hashes"]
    assert engine_block_hashes("sglang", toks, b) == EH["sglang"]["event_hashes"]
    # a digest whose first bit is set wraps to a negative int64, as SGLang publishes it
    assert sglang_event_hash(b"\xff" * 8 + b"\x00" * 24) == -1
    assert sglang_event_hash(b"\x80" + b"\x00" * 31) == -(2**63)


# -- tokenizers and key pools --------------------------------------------------------------

TEMPLATE = (
    "{{ bos_token }}{% for m in messages %}<|{{ m.role }}|>{{ m.content }}<|end|>{% endfor %}"
    "{% if add_generation_prompt %}<|assistant|>{% endif %}"
)


@pytest.fixture(scope="module")
def hf_files(tmp_path_factory: pytest.TempPathFactory) -> tuple[Path, Path]:
    """A real (tiny) BPE tokenizer.json, trained here with the tokenizers library, and a
    tokenizer_config.json carrying a chat template and a BOS token."""
    from tokenizers import Tokenizer, models, pre_tokenizers, trainers

    tok = Tokenizer(models.BPE(unk_token="<unk>"))
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    trainer = trainers.BpeTrainer(
        vocab_size=300,
        special_tokens=["<unk>", "<s>", "<|user|>", "<|assistant|>", "<|system|>", "<|end|>"],
        initial_alphabet=pre_tokenizers.ByteLevel.alphabet(),
    )
    corpus = ["the quick brown fox jumps over the lazy dog " * 20, "hello world " * 50]
    tok.train_from_iterator(corpus, trainer)
    d = tmp_path_factory.mktemp("tok")
    tok.save(str(d / "tokenizer.json"))
    (d / "tokenizer_config.json").write_text(
        json.dumps(
            {"chat_template": TEMPLATE, "bos_token": {"content": "<s>"}, "eos_token": "</s>"}
        )
    )
    return d / "tokenizer.json", d / "tokenizer_config.json"


def test_hf_tokenizer_renders_template_and_tokenizes(hf_files: tuple[Path, Path]) -> None:
    tj, cfg = hf_files
    tok = HFTokenizer(tj, cfg)
    msgs = [{"role": "user", "content": "the quick brown fox"}]
    text = tok.render_chat(msgs, None)
    assert text == "<s><|user|>the quick brown fox<|end|><|assistant|>"
    ids = tok.encode_chat(msgs, None)
    from tokenizers import Tokenizer

    raw = Tokenizer.from_file(str(tj))
    assert ids == raw.encode(text, add_special_tokens=False).ids
    assert ids[0] == raw.token_to_id("<s>") and ids[-1] == raw.token_to_id("<|assistant|>")
    # turn 2 starts with turn 1's prompt: its leading full blocks share keys
    msgs2 = [*msgs, {"role": "assistant", "content": "jumps"}, {"role": "user", "content": "ok"}]
    ids2 = tok.encode_chat(msgs2, None)
    assert ids2[: len(ids)] == ids
    seed = token_key_seed("m")
    k1, k2 = compute_token_keys(ids, seed, 4), compute_token_keys(ids2, seed, 4)
    assert k1.blocks and k2.blocks[: len(k1.blocks)] == k1.blocks


def test_tokenizer_files_that_do_not_load(tmp_path: Path) -> None:
    with pytest.raises(TokenizerFileError, match="cannot load tokenizer"):
        HFTokenizer(tmp_path / "missing.json")
    bad = tmp_path / "tokenizer.json"
    bad.write_text("{}")
    with pytest.raises(TokenizerFileError):
        HFTokenizer(bad)


def _policy(pools: list[dict]) -> dict:
    return {
        "engines": [
            {"id": "v0", "url": "http://127.0.0.1:1"},
            {"id": "t0", "url": "http://127.0.0.1:2"},
        ],
        "incumbent": {"name": "round_robin"},
        "key_pools": pools,
    }


def test_key_pools_in_the_policy_file() -> None:
    cfg = parse_policy(_policy([{"name": "v", "engines": ["v0"], "keys_mode": "tokens",
                                 "tokenizer": "bytes", "block_tokens": 256}]))  # fmt: skip
    assert cfg.key_pools[0].block_tokens == 256
    for pools, msg in (
        ([{"name": "v", "engines": ["nope"]}], "not in engines"),
        ([{"name": "v", "engines": ["v0"]}, {"name": "w", "engines": ["v0"]}], "key pools"),
        ([{"name": "v", "engines": ["v0"], "keys_mode": "tokens"}], "tokenizer_file"),
        ([{"name": "v", "engines": ["v0"], "block_tokens": 0}], "greater than 0"),
    ):
        with pytest.raises(PolicyFileError, match=msg):
            parse_policy(_policy(pools))


def _parse(body: dict) -> object:
    path = "/v1/chat/completions" if "messages" in body else "/v1/completions"
    return parse_request(path, json.dumps(body).encode(), {}, ParseLimits())


def test_rekey_by_pool(hf_files: tuple[Path, Path]) -> None:
    tj, cfg = hf_files
    pools = KeyPools(
        [
            KeyPoolConfig(
                name="v",
                engines=("v0",),
                keys_mode="tokens",
                tokenizer_file=str(tj),
                chat_template_file=str(cfg),
                block_tokens=4,
                forward_token_ids=True,
            ),
            KeyPoolConfig(
                name="r", engines=("r0",), keys_mode="tokens", tokenizer="bytes", block_tokens=256
            ),
        ]
    )
    assert pools
    msgs = [{"role": "user", "content": "hello world hello world"}]
    parsed = _parse({"model": "m", "messages": msgs})
    v = pools.rekey(parsed, [EngineId("v0")])  # type: ignore[arg-type]
    ids = HFTokenizer(tj, cfg).encode_chat(msgs, None)
    assert v.keys == compute_token_keys(ids, token_key_seed("m"), 4)
    assert v.prompt_tokens == len(ids) and v.body == parsed.body  # type: ignore[attr-defined]
    # the reference engine's pool: bytes of the canonical rendering
    r = pools.rekey(parsed, [EngineId("r0")])  # type: ignore[arg-type]
    text = render_chat(msgs).text
    assert r.keys == compute_token_keys(list(text), token_key_seed("m"), 256)
    assert ByteTokenizer().encode_chat(msgs, None) == list(text)
    # mixed pools, or engines in no pool: text keys unchanged
    assert pools.rekey(parsed, [EngineId("v0"), EngineId("r0")]) is parsed  # type: ignore[arg-type]
    assert pools.rekey(parsed, [EngineId("x")]) is parsed  # type: ignore[arg-type]
    # completions: forward_token_ids rewrites a string prompt to the ids keyed
    comp = _parse({"model": "m", "prompt": "hello world", "max_tokens": 3})
    c = pools.rekey(comp, [EngineId("v0")])  # type: ignore[arg-type]
    sent = json.loads(c.body)  # type: ignore[attr-defined]
    assert sent["prompt"] == HFTokenizer(tj).encode_text("hello world") and sent["max_tokens"] == 3
    ids_req = _parse({"model": "m", "prompt": [5, 6, 7, 8, 9]})
    assert pools.rekey(ids_req, [EngineId("v0")]).keys.blocks == tuple(  # type: ignore[arg-type]
        chain_keys([5, 6, 7, 8], token_key_seed("m"), 4)
    )
    huge = _parse({"model": "m", "prompt": [2**33]})
    with pytest.raises(RequestError) as err:
        pools.rekey(huge, [EngineId("v0")])  # type: ignore[arg-type]
    assert err.value.status == 400
    # a cache_salt seeds the keys: no salted request matches an unsalted block or another
    # salt's (vLLM and SGLang share no cached block between salts); the body is untouched
    salted = [
        pools.rekey(_parse({"model": "m", "messages": msgs, "cache_salt": s}), [EngineId("v0")])  # type: ignore[arg-type]
        for s in ("a", "a", "b", {"k": 1})
    ]
    assert salted[0].keys == compute_token_keys(ids, token_key_seed("m", salt="a"), 4)
    assert salted[0].keys == salted[1].keys
    blocks = [set(x.keys.blocks) for x in (v, salted[0], salted[2], salted[3])]
    assert all(not (b & c) for i, b in enumerate(blocks) for c in blocks[i + 1 :])
    assert token_key_seed("m", salt=None) == token_key_seed("m")  # unsalted keys unchanged
    nulled = _parse({"model": "m", "messages": msgs, "cache_salt": None})
    assert pools.rekey(nulled, [EngineId("v0")]).keys == v.keys  # type: ignore[arg-type]
