"""The policy file's `key_pools:` section: pools of engines and how the router keys
requests for them (`ramjet.keys.pools` applies it)."""

from __future__ import annotations

from collections.abc import Iterable, Sequence
from typing import Literal, Protocol

from pydantic import BaseModel, ConfigDict, Field, model_validator


class KeyPoolConfig(BaseModel):
    model_config = ConfigDict(extra="forbid", frozen=True)

    name: str = Field(min_length=1, max_length=64)
    engines: tuple[str, ...] = Field(min_length=1)
    keys_mode: Literal["text", "tokens"] = "text"
    tokenizer: Literal["hf", "bytes"] = "hf"
    """`hf`: `tokenizer_file` (HF tokenizer.json); `bytes`: the reference engine's."""
    tokenizer_file: str | None = None
    chat_template_file: str | None = None
    """A Jinja template, or the model's tokenizer_config.json (its `chat_template`)."""
    block_tokens: int = Field(default=16, gt=0, le=65536)
    forward_token_ids: bool = False

    @model_validator(mode="after")
    def _check(self) -> KeyPoolConfig:
        if self.keys_mode == "tokens" and self.tokenizer == "hf" and not self.tokenizer_file:
            raise ValueError("keys_mode tokens with tokenizer hf needs tokenizer_file")
        return self


class EnginePool(Protocol):
    """A named pool of engines in the policy file (key pools, priority pools)."""

    @property
    def name(self) -> str: ...

    @property
    def engines(self) -> tuple[str, ...]: ...


def check_pools(
    pools: Sequence[EnginePool], engine_ids: Iterable[str], what: str = "key pool"
) -> None:
    """Every pool engine exists and belongs to one pool; pool names are unique. `what`
    names the kind of pool in the errors."""
    known = set(engine_ids)
    seen: dict[str, str] = {}
    names: set[str] = set()
    for p in pools:
        if p.name in names:
            raise ValueError(f"{what} name {p.name!r} is repeated")
        names.add(p.name)
        for e in p.engines:
            if e not in known:
                raise ValueError(f"{what} {p.name!r}: engine {e!r} is not in engines")
            if e in seen:
                raise ValueError(f"engine {e!r} is in {what}s {seen[e]!r} and {p.name!r}")
            seen[e] = p.name
