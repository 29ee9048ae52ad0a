"""MiniV4: the reference model's public face (the state API the engine codes against).

    cfg = ModelConfig.tiny(window=128)
    model = MiniV4(cfg, seed=0, device="cpu")      # engram_prefetch=False: fetch inline
    st = model.new_state()
    logits = model.prefill(st, ids)                 # chunked inside; last-position logits [V]
    logits = model.decode_batch([st1, st2], [t1, t2])   # one step each -> [B, V]
    draft = model.draft(st, n)                      # tokens [n], confidences [n]
    accepted, stats = model.verify(st, draft.tokens)
    blob = model.export_global(st, start, end)      # block-aligned global state bytes
    st2 = model.state_from_global(blobs, n_tokens)  # no SWA state
    tail = model.export_tail(st); model.import_tail(st2, tail)
    model.replay(st2, ids_last_window)              # approximate SWA rebuild
    model.close()                                   # joins the Engram prefetch worker

Speculative decoding contract: the state has processed every emitted token, and the next
greedy token g0 = argmax(st.last_logits) is certain. `draft` guesses the n tokens after
g0; `verify` runs [g0, d1..dn] through the backbone, accepts the longest prefix of the
draft that greedy decoding agrees with, and emits g0 + the accepted tokens (k + 1 tokens,
all processed; the next greedy token is again argmax(st.last_logits)). The emitted
sequence is exactly plain greedy decoding.
"""

from __future__ import annotations

import time
from collections.abc import Sequence
from dataclasses import dataclass

import torch

from .config import ModelConfig
from .dspark import Draft, draft_block
from .forward import Backbone, EngramStats, Segment
from .serialize import export_global, export_tail, import_tail, state_from_global
from .state import SeqState
from .tokenizer import ByteTokenizer
from .weights import Weights


@dataclass
class VerifyStats:
    proposed: int
    accepted: int
    emitted: int
    seconds: float

    @property
    def acceptance(self) -> float:
        return self.accepted / self.proposed if self.proposed else 0.0


@dataclass
class ReplayStats:
    tokens: int
    seconds: float


def _ids_tensor(
    ids: Sequence[int] | torch.Tensor, vocab: int, device: torch.device
) -> torch.Tensor:
    t = (
        ids.to(torch.int64).flatten()
        if isinstance(ids, torch.Tensor)
        else torch.tensor(list(ids), dtype=torch.int64)
    )
    if t.numel() and (int(t.min()) < 0 or int(t.max()) >= vocab):
        raise ValueError(f"token ids must lie in [0, {vocab})")
    return t.to(device)


class MiniV4:
    def __init__(
        self,
        cfg: ModelConfig,
        seed: int = 0,
        device: str | torch.device = "cpu",
        engram_prefetch: bool = True,
    ) -> None:
        if cfg.dim * cfg.n_layers > 1 << 16:
            raise ValueError("this config is for the memory model only (too large to build)")
        self.cfg = cfg
        self.seed = seed
        self.device = torch.device(device)
        self.tokenizer = ByteTokenizer(cfg.vocab)
        with torch.no_grad():
            self.weights = Weights(cfg, seed, self.device)
        self.backbone = Backbone(cfg, self.weights, self.device, engram_prefetch)

    @property
    def engram_stats(self) -> EngramStats:
        """Cumulative Engram prefetch (a snapshot): rows gathered, bytes read from the host
        tables, fetch seconds, seconds forwards waited for rows (exposed), forwards."""
        return self.backbone.engram_stats

    def close(self) -> None:
        """Join the Engram prefetch worker (idempotent); the model stays usable, fetching
        Engram rows inline."""
        self.backbone.engram.close()

    def new_state(self) -> SeqState:
        return SeqState.empty(self.cfg, self.device)

    # -- forward ------------------------------------------------------------------

    def _advance(self, segs: list[Segment], all_logits: bool = False) -> torch.Tensor:
        with torch.no_grad():
            out = self.backbone.run(segs, all_logits=all_logits)
        last = 0
        for i, sg in enumerate(segs):
            n = int(sg.ids.shape[0])
            st = sg.st
            if not sg.frozen_global:
                st.n_tokens += n
                st.tokens.extend(sg.ids.tolist())
            last += n
            row = last - 1 if all_logits else i
            st.last_logits = out.logits[row].clone()
            st.last_hidden = out.hidden[i].clone()
        return out.logits

    def prefill(
        self, st: SeqState, ids: Sequence[int] | torch.Tensor, all_logits: bool = False
    ) -> torch.Tensor:
        """Append tokens (in chunks of cfg.prefill_chunk); returns the logits after the last
        one [V], or after every one [T, V] with all_logits."""
        t = _ids_tensor(ids, self.cfg.vocab, self.device)
        if t.numel() == 0:
            raise ValueError("prefill needs at least one token")
        self._need_swa(st)
        ch = self.cfg.prefill_chunk
        outs = []
        for s in range(0, t.numel(), ch):
            outs.append(self._advance([Segment(st, t[s : s + ch], st.n_tokens)], all_logits))
        return torch.cat(outs) if all_logits else outs[-1][-1]

    def decode_batch(self, states: Sequence[SeqState], tokens: Sequence[int]) -> torch.Tensor:
        """One token for each of several distinct sequences -> logits [B, V]."""
        if len(states) != len(tokens) or not states:
            raise ValueError("decode_batch needs one token per state, at least one")
        if len({id(s) for s in states}) != len(states):
            raise ValueError("a state appears twice in one batch")
        t = _ids_tensor(tokens, self.cfg.vocab, self.device)
        for st in states:
            self._need_swa(st)
        segs = [Segment(st, t[i : i + 1], st.n_tokens) for i, st in enumerate(states)]
        return self._advance(segs)

    def _need_swa(self, st: SeqState) -> None:
        if st.cfg != self.cfg:
            raise ValueError("state belongs to another configuration")
        if not st.has_swa:
            raise ValueError("state has no SWA state: import_tail or replay first")

    # -- speculative decoding -----------------------------------------------------

    def draft(self, st: SeqState, n: int | None = None) -> Draft:
        if st.last_logits is None or st.last_hidden is None:
            raise ValueError("draft needs a state that has processed at least one token")
        n = self.cfg.draft_positions if n is None else n
        g0 = int(st.last_logits.argmax())
        with torch.no_grad():
            return draft_block(self.cfg, self.weights, st.last_hidden, g0, n)

    def verify(
        self, st: SeqState, draft_tokens: Sequence[int] | torch.Tensor
    ) -> tuple[list[int], VerifyStats]:
        """Greedy verification (see the module docstring). Returns the emitted tokens."""
        if st.last_logits is None:
            raise ValueError("verify needs a state that has processed at least one token")
        self._need_swa(st)
        t0 = time.perf_counter()
        d = _ids_tensor(draft_tokens, self.cfg.vocab, self.device)
        g0 = int(st.last_logits.argmax())
        seq = torch.cat((torch.tensor([g0], device=self.device), d))
        snap = st.snapshot()
        logits = self._advance([Segment(st, seq, st.n_tokens)], all_logits=True)
        greedy = logits.argmax(-1).tolist()  # greedy[i]: the token after seq[i]
        dl = d.tolist()
        k = 0
        while k < len(dl) and dl[k] == greedy[k]:
            k += 1
        emitted = [g0, *dl[:k]]
        if k < len(dl):
            # Roll back and process only what was emitted.
            st.restore(snap)
            self._advance([Segment(st, seq[: k + 1], st.n_tokens)])
        stats = VerifyStats(len(dl), k, k + 1, time.perf_counter() - t0)
        return emitted, stats

    # -- state transfer -------------------------------------------------------------

    def export_global(self, st: SeqState, start: int, end: int) -> bytes:
        return export_global(self.cfg, st, start, end)

    def state_from_global(
        self, blobs: Sequence[bytes], n_tokens: int, tokens: Sequence[int] | None = None
    ) -> SeqState:
        return state_from_global(
            self.cfg, self.device, list(blobs), n_tokens, None if tokens is None else list(tokens)
        )

    def export_tail(self, st: SeqState) -> bytes:
        return export_tail(self.cfg, st)

    def import_tail(self, st: SeqState, tail: bytes) -> None:
        import_tail(self.cfg, st, tail)

    def replay(self, st: SeqState, ids_last_window: Sequence[int] | torch.Tensor) -> ReplayStats:
        """Approximate SWA rebuild: re-run the last min(window, n) tokens with empty windows
        over the (exact) global state, which is read, never rewritten. The first replayed
        rows see a truncated window; that is the approximation."""
        t = _ids_tensor(ids_last_window, self.cfg.vocab, self.device)
        n = st.n_tokens
        want = min(self.cfg.window, n)
        if t.numel() != want:
            raise ValueError(f"replay needs the last {want} tokens, got {t.numel()}")
        t0 = time.perf_counter()
        hd, eb = self.cfg.head_dim, self.cfg.head_dim // self.cfg.fp8_block
        st.win = [torch.zeros(0, hd, device=self.device) for _ in range(self.cfg.n_layers)]
        st.win_exp = [
            torch.zeros(0, eb, dtype=torch.int8, device=self.device)
            for _ in range(self.cfg.n_layers)
        ]
        known = t.tolist()
        if len(st.tokens) < want:
            st.tokens = known
        elif st.tokens[-want:] != known:
            raise ValueError("replayed tokens differ from the state's known tokens")
        if want:
            self._advance([Segment(st, t, n - want, frozen_global=True)])
        return ReplayStats(want, time.perf_counter() - t0)
