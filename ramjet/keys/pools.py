"""Key modes per engine pool: text keys (the default) or token-block keys.

The policy's `key_pools:` section names pools of engines and how the router keys
requests for them:

```yaml
key_pools:
  - name: vllm
    engines: [v0, v1]
    keys_mode: tokens            # text | tokens
    tokenizer_file: /models/v4.1-flash/tokenizer.json
    chat_template_file: /models/v4.1-flash/tokenizer_config.json
    block_tokens: 16             # the engine's --block-size (SGLang: --page-size)
    forward_token_ids: false     # /v1/completions: send the ids we keyed instead of text
```

Engines in no pool use text keys (`ramjet.keys.prefix`). A request is keyed by the pool of
the engines that serve its model; when they belong to different key modes (a mixed
fleet), it keeps its text keys and the token pool's engines see no residency for it
(a miss, never a wrong hit). Tokenizers are loaded from files when the router starts:
a missing file fails the start, nothing is downloaded.

`forward_token_ids` rewrites a `/v1/completions` string prompt into the token ids the
router keyed (`prompt: [ids]`), so router and engine cannot tokenize differently. Chat
requests are forwarded as they came: the OpenAI chat API has no portable token-id input.
"""

from __future__ import annotations

import dataclasses
import json
import logging
from collections import Counter
from collections.abc import Sequence
from pathlib import Path
from typing import Any

from prometheus_client import CollectorRegistry

from ramjet.keys.config import KeyPoolConfig as KeyPoolConfig
from ramjet.keys.prefix import PromptError, cache_salt
from ramjet.keys.tokens import (
    ByteTokenizer,
    HFTokenizer,
    PromptTokenizer,
    compute_token_keys,
    token_key_seed,
)
from ramjet.metric_catalogue import counter
from ramjet.request.parse import ParsedRequest, RequestError
from ramjet.types import EngineId

log = logging.getLogger(__name__)


@dataclasses.dataclass(frozen=True, slots=True)
class _Pool:
    config: KeyPoolConfig
    tokenizer: PromptTokenizer | None


def _resolve(path: str, base_dir: Path | None) -> Path:
    p = Path(path)
    return p if p.is_absolute() or base_dir is None else base_dir / p


class KeyPools:
    """The router's key modes; `rekey` gives a parsed request the keys of its pool."""

    def __init__(
        self,
        pools: Sequence[KeyPoolConfig],
        base_dir: Path | None = None,
        registry: CollectorRegistry | None = None,
    ) -> None:
        self._by_engine: dict[str, _Pool] = {}
        self.fallbacks: Counter[str] = Counter()
        """Requests per pool keyed by text because the pool's template refused them (also
        `ramjet_token_keys_fallback_total{pool}` on `registry`)."""
        self._fallback_metric = (
            None if registry is None else counter(registry, "ramjet_token_keys_fallback_total")
        )
        for cfg in pools:
            tok: PromptTokenizer | None = None
            if cfg.keys_mode == "tokens":
                if cfg.tokenizer == "bytes":
                    tok = ByteTokenizer()
                else:
                    assert cfg.tokenizer_file is not None
                    tpl = cfg.chat_template_file
                    tok = HFTokenizer(
                        _resolve(cfg.tokenizer_file, base_dir),
                        None if tpl is None else _resolve(tpl, base_dir),
                    )
            pool = _Pool(cfg, tok)
            for e in cfg.engines:
                self._by_engine[e] = pool
        self._tokenizing = any(p.tokenizer is not None for p in self._by_engine.values())
        """Some pool keys by tokens (fixed once built: the router asks on every request)."""

    def __bool__(self) -> bool:
        return self._tokenizing

    def pool_of(self, engine: EngineId) -> KeyPoolConfig | None:
        p = self._by_engine.get(engine)
        return None if p is None else p.config

    def rekey(self, parsed: ParsedRequest, engines: Sequence[EngineId]) -> ParsedRequest:
        """`parsed` with token-block keys when every engine in `engines` is in one tokens
        pool; unchanged otherwise, and unchanged (counted in `fallbacks`) when the pool's
        template cannot render the request: the engine decides whether it is valid.
        Raises `RequestError` (400) only for token ids beyond 32 bits."""
        if not engines:
            return parsed
        pool = self._by_engine.get(engines[0])
        if pool is None or pool.tokenizer is None:
            return parsed
        if any(self._by_engine.get(e) is not pool for e in engines[1:]):
            return parsed  # a mixed fleet: text keys for all
        try:
            ids, body = self._tokens(parsed, pool)
        except PromptError as exc:
            # the engine may well render what the router cannot: keep the request's text
            # keys (its token pool then sees a miss, never a wrong hit) and count it
            self.fallbacks[pool.config.name] += 1
            if self._fallback_metric is not None:
                self._fallback_metric.labels(pool.config.name).inc()
            log.info("pool %s: text keys for this request: %s", pool.config.name, exc)
            return parsed
        try:
            seed = token_key_seed(parsed.model, salt=cache_salt(parsed.json))
            keys = compute_token_keys(ids, seed, pool.config.block_tokens)
        except ValueError as exc:  # token ids beyond 32 bits
            raise RequestError(
                400, "invalid_request_error", "invalid_value", f"prompt: {exc}", "prompt"
            ) from None
        return dataclasses.replace(
            parsed, keys=keys, prompt_tokens=len(ids), bytes_per_token=1.0, body=body
        )

    def _tokens(self, parsed: ParsedRequest, pool: _Pool) -> tuple[list[int], bytes]:
        tok = pool.tokenizer
        assert tok is not None
        obj = parsed.json
        if parsed.kind == "chat":
            return tok.encode_chat(obj["messages"], obj.get("tools")), parsed.body
        prompt: Any = obj["prompt"]
        if isinstance(prompt, list) and len(prompt) == 1 and isinstance(prompt[0], str | list):
            prompt = prompt[0]
        if isinstance(prompt, list):  # token ids already (validated by parse_request)
            return [int(t) for t in prompt], parsed.body
        # vLLM's /v1/completions adds special tokens (BOS) unless told not to
        special = obj.get("add_special_tokens", True)
        ids = tok.encode_completion(prompt, special is not False)
        body = parsed.body
        if pool.config.forward_token_ids:
            rewritten = dict(obj)
            rewritten["prompt"] = ids
            body = json.dumps(rewritten, ensure_ascii=False, separators=(",", ":")).encode()
        return ids, body
