"""Token-block prefix keys: the key mode for engines that tokenize (vLLM, SGLang).

Spec: `docs/prefix-keys.md` section 7; vectors: `tests/vectors/token_keys.json`.

Text keys (`ramjet.keys.prefix`) chain over 256-byte blocks of Ramjet's canonical rendering,
which is exact for the byte-level reference engine. A real engine caches blocks of *its*
tokens (the model's chat template, rendered and tokenized), so for its pool the router
keys the same token sequence the engine hashes:

    seed  = xxh3_64( UTF-8("ramjet-tokens-v1" "\\0" model "\\0" adapter) )
    K[i]  = xxh3_64( le32(t) for t in tokens[iB:(i+1)B], seed = K[i-1] ),  K[-1] = seed

over full blocks of `B` tokens (the engine's block size: vLLM `--block-size`, SGLang
`--page-size`), each token as a 4-byte little-endian unsigned integer. The one boundary
key is the whole prompt: `xxh3_64(le32 tokens[jB:n], seed=K[j-1])`, j = n // B.

The sidecar computes the same keys from the `token_ids` an engine's `BlockStored` events
carry (`chain_keys`, from the parent block's key), so the router and the sidecar agree
on the key of every block without either reproducing the engine's own hash.

Tokenizers: `ByteTokenizer` is the reference engine's (the canonical rendering, one token
per byte); `HFTokenizer` loads a `tokenizer.json` (HF `tokenizers`, the `[tokens]` extra)
and a Jinja chat template from files: nothing is downloaded. Both are imported lazily so
the router installs without them.
"""

from __future__ import annotations

import json
import struct
from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Protocol, cast

import xxhash

from ramjet.errors import ConfigError
from ramjet.keys.prefix import PrefixKeys, PromptError, render_chat, render_completion
from ramjet.types import PrefixKey

TOKENS_SPEC_VERSION = 1
_xxh3 = xxhash.xxh3_64_intdigest


def token_key_seed(model: str, adapter: str | None = None) -> int:
    tag = f"ramjet-tokens-v{TOKENS_SPEC_VERSION}\x00{model}\x00{adapter or ''}"
    return _xxh3(tag.encode("utf-8", "surrogatepass"))


def pack_tokens(tokens: Sequence[int]) -> bytes:
    """Tokens as 4-byte little-endian unsigned integers (ValueError outside 0..2**32-1)."""
    try:
        return struct.pack(f"<{len(tokens)}I", *tokens)
    except struct.error:
        raise ValueError("token ids must be integers in [0, 2**32)") from None


def chain_keys(tokens: Sequence[int], parent: int, block_tokens: int) -> list[PrefixKey]:
    """Keys of the full blocks of `tokens`, chained on from `parent` (a block key, or the
    seed for the first block of a prompt)."""
    if block_tokens <= 0:
        raise ValueError("block_tokens must be positive")
    raw = pack_tokens(tokens)
    step = 4 * block_tokens
    h = parent
    x = _xxh3
    return cast(
        list[PrefixKey],
        [h := x(raw[s : s + step], h) for s in range(0, len(raw) - step + 1, step)],
    )


def compute_token_keys(tokens: Sequence[int], seed: int, block_tokens: int) -> PrefixKeys:
    """Block keys and the whole-prompt boundary key of a token sequence. The result's
    `block_bytes` and `length` are in tokens (so `bytes_per_token` is 1 for it)."""
    blocks = chain_keys(tokens, seed, block_tokens)
    n = len(tokens)
    j = n // block_tokens
    tail = pack_tokens(tokens[j * block_tokens :])
    end = PrefixKey(_xxh3(tail, seed if j == 0 else blocks[j - 1]))
    return PrefixKeys(seed, block_tokens, tuple(blocks), ((n, end),), n)


# -- tokenizers ------------------------------------------------------------------------------


class PromptTokenizer(Protocol):
    """Tokenizes a request's prompt the way its engine does."""

    def encode_chat(self, messages: Sequence[Any], tools: Sequence[Any] | None) -> list[int]: ...

    def encode_text(self, text: str) -> list[int]: ...


class ByteTokenizer:
    """The reference engine's tokenizer: Ramjet's canonical rendering, one token per byte."""

    def encode_chat(self, messages: Sequence[Any], tools: Sequence[Any] | None) -> list[int]:
        return list(render_chat(messages, tools).text)

    def encode_text(self, text: str) -> list[int]:
        return list(render_completion(text).text)


class TokenizerFileError(ConfigError, ValueError):
    """A tokenizer or chat template that cannot be loaded from its files."""


@dataclass(frozen=True, slots=True)
class _Specials:
    bos: str
    eos: str


def _token_text(v: Any) -> str:
    if isinstance(v, str):
        return v
    if isinstance(v, Mapping) and isinstance(v.get("content"), str):
        return str(v["content"])
    return ""


class HFTokenizer:
    """A Hugging Face `tokenizer.json` and the model's chat template, from files.

    `chat_template` is a Jinja file, or a `tokenizer_config.json` whose `chat_template`
    (and `bos_token`/`eos_token`) are used. The template is rendered with
    `add_generation_prompt=True`, as vLLM's and SGLang's chat endpoints do, and the text
    tokenized without adding special tokens (the template writes them).
    """

    def __init__(self, tokenizer_file: str | Path, chat_template: str | Path | None = None) -> None:
        try:
            from tokenizers import Tokenizer
        except ImportError:  # pragma: no cover - the extra is part of dev
            raise TokenizerFileError(
                "token keys need the 'tokenizers' package: pip install 'ramjet[tokens]'"
            ) from None
        try:
            self._tok = Tokenizer.from_file(str(tokenizer_file))
        except Exception as exc:  # the Rust side raises its own Exception type
            raise TokenizerFileError(f"{tokenizer_file}: cannot load tokenizer: {exc}") from None
        self._template: Any = None
        self._specials = _Specials("", "")
        if chat_template is not None:
            self._template, self._specials = _load_template(Path(chat_template))

    def encode_text(self, text: str) -> list[int]:
        return list(self._tok.encode(text, add_special_tokens=False).ids)

    def render_chat(self, messages: Sequence[Any], tools: Sequence[Any] | None) -> str:
        if self._template is None:
            raise PromptError("this pool has no chat template; chat requests cannot be keyed")
        try:
            return str(
                self._template.render(
                    messages=list(messages),
                    tools=list(tools) if tools else None,
                    add_generation_prompt=True,
                    bos_token=self._specials.bos,
                    eos_token=self._specials.eos,
                )
            )
        except Exception as exc:  # a template that raises on this input (raise_exception)
            raise PromptError(f"chat template failed on these messages: {exc}") from None

    def encode_chat(self, messages: Sequence[Any], tools: Sequence[Any] | None) -> list[int]:
        return self.encode_text(self.render_chat(messages, tools))


def _load_template(path: Path) -> tuple[Any, _Specials]:
    try:
        import jinja2
        from jinja2.sandbox import ImmutableSandboxedEnvironment
    except ImportError:  # pragma: no cover
        raise TokenizerFileError(
            "chat templates need jinja2: pip install 'ramjet[tokens]'"
        ) from None
    try:
        text = path.read_text("utf-8")
    except OSError as exc:
        raise TokenizerFileError(f"{path}: cannot read chat template: {exc}") from None
    specials = _Specials("", "")
    if path.suffix == ".json":
        try:
            cfg = json.loads(text)
        except json.JSONDecodeError as exc:
            raise TokenizerFileError(f"{path}: not JSON: {exc}") from None
        tpl = cfg.get("chat_template") if isinstance(cfg, dict) else None
        if not isinstance(tpl, str):
            raise TokenizerFileError(f"{path}: no string 'chat_template' in this file")
        specials = _Specials(_token_text(cfg.get("bos_token")), _token_text(cfg.get("eos_token")))
        text = tpl

    def raise_exception(message: str) -> None:
        raise jinja2.TemplateError(message)

    env = ImmutableSandboxedEnvironment(trim_blocks=True, lstrip_blocks=True)
    env.globals["raise_exception"] = raise_exception
    try:
        return env.from_string(text), specials
    except jinja2.TemplateError as exc:
        raise TokenizerFileError(f"{path}: bad chat template: {exc}") from None
