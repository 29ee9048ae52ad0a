"""One generation request inside the engine: its prompt (tokens and router keys), its
sampling parameters, what restoring its prompt cost (`ramjet.decisions.prompt_work.PromptWork`, the
`usage.prompt_work` schema the router reads), and the channel its tokens flow back through.

Threads. The server creates a `Request` on the event loop and hands it to the scheduler;
the scheduler's worker thread fills `work`, appends tokens and finally marks it done,
delivering each change to the loop with `loop.call_soon_threadsafe`. The loop side sets
`cancelled` when the client goes away; the worker checks it between steps.
"""

from __future__ import annotations

import asyncio
import codecs
import itertools
import time
from dataclasses import dataclass, field
from typing import Any

import torch

from ramjet.decisions.prompt_work import PromptWork
from ramjet.keys.prefix import PrefixKeys

_ids = itertools.count(1)


@dataclass(slots=True)
class SamplingParams:
    max_new_tokens: int
    temperature: float = 0.0
    seed: int | None = None
    stop: tuple[str, ...] = ()
    ignore_eos: bool = False
    """vLLM's extension: generate past the end-of-sequence token, up to the budget."""

    def generator(self) -> torch.Generator | None:
        if self.temperature <= 0:
            return None
        g = torch.Generator()
        g.manual_seed(self.seed if self.seed is not None else int(time.time_ns() % (1 << 62)))
        return g


def sample(logits: torch.Tensor, params: SamplingParams, gen: torch.Generator | None) -> int:
    """One token from `logits` [V]: greedy at temperature 0, else softmax sampling."""
    if params.temperature <= 0 or gen is None:
        return int(torch.argmax(logits).item())
    probs = torch.softmax(logits.float() / params.temperature, dim=-1)
    return int(torch.multinomial(probs, 1, generator=gen).item())


@dataclass(eq=False)
class Request:
    prompt_ids: list[int]
    keys: PrefixKeys
    params: SamplingParams
    loop: asyncio.AbstractEventLoop
    id: int = field(default_factory=lambda: next(_ids))
    arrived: float = field(default_factory=time.perf_counter)
    arrived_unix: float = field(default_factory=time.time)
    priority: int = 0
    """The body's `priority` (lowest first under `--scheduling-policy priority`)."""
    work: PromptWork = field(default_factory=PromptWork)
    out: asyncio.Queue[tuple[str, Any]] = field(default_factory=asyncio.Queue)
    """Items: ("token", (token_id, text_piece)), ("first", None) when prefill ends,
    ("done", finish_reason), ("error", message)."""
    cancelled: bool = False
    tokens: list[int] = field(default_factory=list)
    text: str = ""
    finish_reason: str | None = None
    first_token_at: float | None = None
    _decoder: codecs.IncrementalDecoder = field(
        default_factory=lambda: codecs.getincrementaldecoder("utf-8")(errors="replace")
    )

    # -- worker side ---------------------------------------------------------------

    def push(self, kind: str, value: Any = None) -> None:
        self.loop.call_soon_threadsafe(self.out.put_nowait, (kind, value))

    def emit_token(self, token: int, piece_bytes: bytes) -> bool:
        """Record one generated token; returns False once the request is finished."""
        if self.first_token_at is None:
            self.first_token_at = time.perf_counter()
        self.tokens.append(token)
        piece = self._decoder.decode(piece_bytes)
        new_text = self.text + piece
        for s in self.params.stop:
            cut = new_text.find(s, max(0, len(self.text) - len(s)))
            if cut >= 0:
                piece = new_text[len(self.text) : cut]
                self.text = new_text[:cut]
                if piece:
                    self.push("token", (token, piece))
                self.finish("stop")
                return False
        self.text = new_text
        if piece:
            self.push("token", (token, piece))
        if len(self.tokens) >= self.params.max_new_tokens:
            self.finish("length")
            return False
        return True

    def finish(self, reason: str) -> None:
        if self.finish_reason is None:
            self.finish_reason = reason
            self.push("done", reason)

    def fail(self, message: str) -> None:
        if self.finish_reason is None:
            self.finish_reason = "error"
            self.push("error", message)
