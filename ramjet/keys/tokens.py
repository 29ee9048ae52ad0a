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
from datetime import datetime
from pathlib import Path
from typing import Any, Literal, Protocol, cast

import xxhash

from ramjet.errors import ConfigError
from ramjet.keys.prefix import PrefixKeys, PromptError, render_chat, render_completion
from ramjet.types import PrefixKey

TOKENS_SPEC_VERSION = 1
_xxh3 = xxhash.xxh3_64_intdigest


def token_key_seed(model: str, adapter: str | None = None, salt: str | None = None) -> int:
    """The seed of a prompt's first block key. `salt`: the request's `cache_salt`: an
    engine shares no cached block between salts (vLLM hashes it into the first block,
    SGLang namespaces every hash by it), so a salted request's keys start from their own
    seed and match no unsalted block (the sidecar keys no salted block either)."""
    tag = f"ramjet-tokens-v{TOKENS_SPEC_VERSION}\x00{model}\x00{adapter or ''}"
    if salt is not None:
        tag += f"\x00salt\x00{salt}"
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

    def encode_completion(self, text: str, add_special_tokens: bool = True) -> list[int]:
        """A `/v1/completions` prompt (engines add special tokens there by default)."""
        ...


class ByteTokenizer:
    """The reference engine's tokenizer: Ramjet's canonical rendering, one token per byte."""

    def encode_chat(self, messages: Sequence[Any], tools: Sequence[Any] | None) -> list[int]:
        return list(render_chat(messages, tools).text)

    def encode_text(self, text: str) -> list[int]:
        return list(render_completion(text).text)

    def encode_completion(self, text: str, add_special_tokens: bool = True) -> list[int]:
        return self.encode_text(text)  # the reference engine has no special tokens


class TokenizerFileError(ConfigError, ValueError):
    """A tokenizer or chat template that cannot be loaded from its files."""


SPECIAL_TOKEN_NAMES = (
    "bos_token",
    "eos_token",
    "unk_token",
    "sep_token",
    "pad_token",
    "cls_token",
    "mask_token",
)
"""The special tokens Hugging Face passes to every chat template by name."""


def _token_text(v: Any) -> str | None:
    if isinstance(v, str):
        return v
    if isinstance(v, Mapping) and isinstance(v.get("content"), str):
        return str(v["content"])
    return None


def special_tokens(config: Mapping[str, Any]) -> dict[str, Any]:
    """The template variables a `tokenizer_config.json` defines, as `transformers` passes
    them (`special_tokens_map`): each special token's text, and the additional ones."""
    out: dict[str, Any] = {}
    for name in SPECIAL_TOKEN_NAMES:
        text = _token_text(config.get(name))
        if text is not None:
            out[name] = text
    extra = config.get("additional_special_tokens") or config.get("extra_special_tokens")
    if isinstance(extra, list):
        out["additional_special_tokens"] = [t for t in map(_token_text, extra) if t is not None]
    return out


def hf_tojson(
    x: Any,
    ensure_ascii: bool = False,
    indent: int | None = None,
    separators: tuple[str, str] | None = None,
    sort_keys: bool = False,
) -> str:
    """`tojson` as `transformers` defines it for chat templates: plain `json.dumps`
    (non-ASCII kept, keys in order, no HTML escaping; Jinja's own filter escapes `<>&'`
    and sorts keys)."""
    return json.dumps(
        x, ensure_ascii=ensure_ascii, indent=indent, separators=separators, sort_keys=sort_keys
    )


def _strftime_now(fmt: str) -> str:
    return datetime.now().strftime(fmt)


ContentFormat = Literal["string", "openai"]


def detect_content_format(template_source: str) -> ContentFormat:
    """ "openai" when the template loops over a message's `content` (it takes content-part
    arrays), else "string" (vLLM then joins the text parts with newlines before
    rendering); vLLM's `_detect_content_format` decides from the template's AST too."""
    import jinja2
    from jinja2 import nodes

    try:
        ast = jinja2.Environment(extensions=["jinja2.ext.loopcontrols"]).parse(template_source)
    except jinja2.TemplateError:
        return "string"

    def is_content(n: nodes.Node | None) -> bool:
        if isinstance(n, nodes.Filter):
            return is_content(n.node)
        if isinstance(n, nodes.Getattr):
            return n.attr == "content"
        if isinstance(n, nodes.Getitem):
            return isinstance(n.arg, nodes.Const) and n.arg.value == "content"
        return False

    if any(is_content(loop.iter) for loop in ast.find_all(nodes.For)):
        return "openai"
    return "string"


def _texts(content: Any) -> list[str]:
    """The text parts of a message's content (a string, None, or a content-part array);
    a part the router cannot key (an image, audio) raises PromptError."""
    if content is None:
        return []
    if isinstance(content, str):
        return [content]
    if not isinstance(content, list):
        raise PromptError("message content must be a string or an array of parts")
    out: list[str] = []
    for part in content:
        if isinstance(part, str):
            out.append(part)
        elif (
            isinstance(part, Mapping)
            and part.get("type") == "text"
            and isinstance(part.get("text"), str)
        ):
            out.append(str(part["text"]))
        else:
            kind = part.get("type") if isinstance(part, Mapping) else type(part).__name__
            raise PromptError(f"content part of type {kind!r} cannot be token-keyed")
    return out


def _tool_call(call: Any) -> dict[str, Any]:
    if not isinstance(call, Mapping) or not isinstance(call.get("function"), Mapping):
        raise PromptError("assistant tool_calls entries must be objects with a function")
    fn = dict(call["function"])
    args = fn.get("arguments")
    if not args:
        fn["arguments"] = {}
    elif isinstance(args, str):
        try:
            parsed = json.loads(args)
        except json.JSONDecodeError:
            parsed = {}
        fn["arguments"] = parsed if isinstance(parsed, dict) else {}
    return {**call, "function": fn}


def conversation(messages: Sequence[Any], content_format: ContentFormat) -> list[dict[str, Any]]:
    """The messages as vLLM hands them to the template (`parse_chat_messages`): role and
    content (text parts joined with newlines for a "string" template, `[{type: text,
    text}]` parts for an "openai" one), `name`, an assistant's `tool_calls` (JSON string
    arguments parsed to objects, an empty list dropped), a tool's `tool_call_id`; other
    keys are not passed."""
    out: list[dict[str, Any]] = []
    for m in messages:
        if not isinstance(m, Mapping):
            raise PromptError("each message must be an object")
        role = m.get("role")
        texts = _texts(m.get("content"))
        msg: dict[str, Any] = {"role": role}
        if content_format == "openai":
            msg["content"] = [{"type": "text", "text": t} for t in texts]
        else:
            msg["content"] = "\n".join(texts)
        if role == "assistant" and isinstance(m.get("tool_calls"), list):
            calls = [_tool_call(c) for c in m["tool_calls"]]
            if calls:
                msg["tool_calls"] = calls
        if role == "tool" and "tool_call_id" in m:
            msg["tool_call_id"] = m["tool_call_id"]
        if isinstance(m.get("name"), str):
            msg["name"] = m["name"]
        out.append(msg)
    return out


class HFTokenizer:
    """A Hugging Face `tokenizer.json` and the model's chat template, from files, rendered
    and tokenized as vLLM does it.

    `chat_template` is a Jinja file (transformers 5 saves `chat_template.jinja`), or a
    `tokenizer_config.json` with a `chat_template` (older saves; without one, the
    `chat_template.jinja` beside it is used). The special tokens the template sees
    (`bos_token`, `eos_token`, ...) come from `tokenizer_config` or else the
    `tokenizer_config.json` next to the template or the tokenizer. Rendering is
    `transformers`' (`trim_blocks`, `lstrip_blocks`, `loopcontrols`; `tojson` without
    HTML escaping, `strftime_now`, `raise_exception`), with `add_generation_prompt=True`
    and the messages normalized as vLLM does (`conversation`). Chat text is tokenized
    without special tokens (the template writes them); completion prompts with them
    (vLLM's `add_special_tokens` default for `/v1/completions`).
    """

    def __init__(
        self,
        tokenizer_file: str | Path,
        chat_template: str | Path | None = None,
        tokenizer_config: str | Path | None = None,
    ) -> None:
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
        self.content_format: ContentFormat = "string"
        self.specials: dict[str, Any] = {}
        cfg_path = None if tokenizer_config is None else Path(tokenizer_config)
        if chat_template is not None:
            tpl = Path(chat_template)
            source, from_cfg = _template_source(tpl)
            if cfg_path is None:
                cfg_path = from_cfg or _beside(tpl) or _beside(Path(tokenizer_file))
            self._template = _compile(source, tpl)
            self.content_format = detect_content_format(source)
        if cfg_path is not None:
            self.specials = special_tokens(_read_json(cfg_path))

    def encode_text(self, text: str, add_special_tokens: bool = False) -> list[int]:
        return list(self._tok.encode(text, add_special_tokens=add_special_tokens).ids)

    def encode_completion(self, text: str, add_special_tokens: bool = True) -> list[int]:
        """A `/v1/completions` prompt as vLLM tokenizes it (special tokens by default)."""
        return self.encode_text(text, add_special_tokens)

    def render_chat(self, messages: Sequence[Any], tools: Sequence[Any] | None) -> str:
        if self._template is None:
            raise PromptError("this pool has no chat template; chat requests cannot be keyed")
        conv = conversation(messages, self.content_format)
        try:
            return str(
                self._template.render(
                    **self.specials,
                    messages=conv,
                    tools=list(tools) if tools else None,
                    add_generation_prompt=True,
                )
            )
        except Exception as exc:  # a template that raises on this input (raise_exception)
            raise PromptError(f"chat template failed on these messages: {exc}") from None

    def encode_chat(self, messages: Sequence[Any], tools: Sequence[Any] | None) -> list[int]:
        return self.encode_text(self.render_chat(messages, tools))


def _read_json(path: Path) -> dict[str, Any]:
    try:
        data = json.loads(path.read_text("utf-8"))
    except OSError as exc:
        raise TokenizerFileError(f"{path}: cannot read: {exc}") from None
    except json.JSONDecodeError as exc:
        raise TokenizerFileError(f"{path}: not JSON: {exc}") from None
    if not isinstance(data, dict):
        raise TokenizerFileError(f"{path}: not a JSON object")
    return data


def _beside(path: Path) -> Path | None:
    cfg = path.with_name("tokenizer_config.json")
    return cfg if cfg.is_file() and cfg != path else None


def _template_source(path: Path) -> tuple[str, Path | None]:
    """The template text, and the tokenizer config it came from (if it did)."""
    if path.suffix != ".json":
        try:
            return path.read_text("utf-8"), None
        except OSError as exc:
            raise TokenizerFileError(f"{path}: cannot read chat template: {exc}") from None
    cfg = _read_json(path)
    tpl = cfg.get("chat_template")
    if isinstance(tpl, list):  # named templates: the "default" one
        named = {t.get("name"): t.get("template") for t in tpl if isinstance(t, dict)}
        tpl = named.get("default")
    if tpl is None:
        jinja = path.with_name("chat_template.jinja")  # transformers 5 saves it apart
        if jinja.is_file():
            return _template_source(jinja)[0], path
    if not isinstance(tpl, str):
        raise TokenizerFileError(
            f"{path}: no string 'chat_template' in this file and no chat_template.jinja beside it"
        )
    return tpl, path


def _compile(text: str, path: Path) -> Any:
    try:
        import jinja2
        from jinja2.sandbox import ImmutableSandboxedEnvironment
    except ImportError:  # pragma: no cover
        raise TokenizerFileError(
            "chat templates need jinja2: pip install 'ramjet[tokens]'"
        ) from None

    def raise_exception(message: str) -> None:
        raise jinja2.TemplateError(message)

    env = ImmutableSandboxedEnvironment(
        trim_blocks=True, lstrip_blocks=True, extensions=["jinja2.ext.loopcontrols"]
    )
    env.filters["tojson"] = hf_tojson
    env.globals["raise_exception"] = raise_exception
    env.globals["strftime_now"] = _strftime_now
    try:
        return env.from_string(text)
    except jinja2.TemplateError as exc:
        raise TokenizerFileError(f"{path}: bad chat template: {exc}") from None
