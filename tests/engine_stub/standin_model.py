"""A stand-in for `engine_stub.model.MiniV4` at the scheduler's and caches' seam.

Deterministic and instant: the state is the token list; logits put all mass on a token
derived from the last tokens, so greedy output is reproducible; global blocks are the
block's token bytes; the tail is the tokens past the last full block plus a window marker.
It records which calls happened so tests can assert replay vs resume.
"""

from __future__ import annotations

from dataclasses import dataclass, field

import torch

V = 512
EOS = 257


@dataclass
class Cfg:
    window: int = 16
    block_tokens: int = 256
    draft_block: int = 5


@dataclass
class St:
    ids: list[int] = field(default_factory=list)
    swa: bool = True
    replayed: int = 0


class StandinModel:
    def __init__(self, window: int = 16, step_s: float = 0.0, eos_after: int | None = None) -> None:
        self.cfg = Cfg(window=window)
        self.step_s = step_s
        self.eos_after = eos_after
        self.calls: list[str] = []

    def _next(self, ids: list[int]) -> int:
        if self.eos_after is not None and len(ids) >= self.eos_after:
            return EOS
        return 97 + (sum(ids[-3:]) % 26)

    def _logits(self, ids: list[int]) -> torch.Tensor:
        out = torch.zeros(V)
        out[self._next(ids)] = 10.0
        return out

    def new_state(self) -> St:
        return St()

    def prefill(self, st: St, ids: list[int]) -> torch.Tensor:
        import time

        if self.step_s:
            time.sleep(self.step_s)
        st.ids.extend(ids)
        self.calls.append(f"prefill:{len(ids)}")
        return self._logits(st.ids)

    def decode_batch(self, states: list[St], tokens: list[int]) -> torch.Tensor:
        import time

        if self.step_s:
            time.sleep(self.step_s)
        rows = []
        for st, t in zip(states, tokens, strict=True):
            st.ids.append(t)
            rows.append(self._logits(st.ids))
        return torch.stack(rows)

    def export_global(self, st: St, start: int, end: int) -> bytes:
        return bytes(t % 256 for t in st.ids[start:end])

    def state_from_global(self, blobs: list[bytes], n_tokens: int) -> St:
        ids = [b for blob in blobs for b in blob]
        assert len(ids) == n_tokens
        self.calls.append(f"from_global:{n_tokens}")
        return St(ids=ids, swa=False)

    def export_tail(self, st: St) -> bytes:
        return b"T" + bytes(t % 256 for t in st.ids[(len(st.ids) // 256) * 256 :])

    def import_tail(self, st: St, tail: bytes) -> None:
        st.ids.extend(tail[1:])
        st.swa = True
        self.calls.append("import_tail")

    def replay(self, st: St, ids: list[int]) -> None:
        st.swa = True
        st.replayed += len(ids)
        self.calls.append(f"replay:{len(ids)}")
