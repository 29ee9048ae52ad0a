"""Byte-level tokenizer: token id = byte value (0-255), specials from 256, vocab 512.

A prompt's tokens are exactly its UTF-8 bytes, so any text round-trips and a 256-token
block is a 256-byte block of the router's rendered prompt (its prefix keys).

Engram's compressed ids: tokens that normalize to the same text share an id. For a byte
vocabulary the decoded text of a token is the byte itself when it is ASCII; it is put
through NFKC, NFD, accent stripping, lowercasing and whitespace collapsing, and the
compressed id is the smallest token id with the same normalized text (so 'A' -> 'a', and
'\\t', '\\n', '\\r', '\\v', '\\f' -> ' '). A byte >= 0x80 is a fragment of a multi-byte
character with no text of its own, so it keeps its own id, as do the specials.
"""

from __future__ import annotations

import re
import unicodedata
from collections.abc import Sequence

BOS = 256
EOS = 257
PAD = 258
SPECIALS = {"<bos>": BOS, "<eos>": EOS, "<pad>": PAD}


def normalize_text(text: str) -> str:
    """NFKC, NFD, strip combining marks, lowercase, collapse whitespace runs to one space."""
    t = unicodedata.normalize("NFD", unicodedata.normalize("NFKC", text))
    t = "".join(c for c in t if not unicodedata.combining(c)).lower()
    return re.sub(r"\s+", " ", t)


class ByteTokenizer:
    """Bytes <-> ids. `vocab` >= 259 (256 bytes + bos, eos, pad; the rest is reserved)."""

    def __init__(self, vocab: int = 512) -> None:
        if vocab < 259:
            raise ValueError("vocab must hold 256 bytes and 3 specials")
        self.vocab = vocab
        self.bos, self.eos, self.pad = BOS, EOS, PAD
        self._compressed = self._build_compressed()

    def encode(self, text: str | bytes) -> list[int]:
        data = text.encode("utf-8") if isinstance(text, str) else bytes(text)
        return list(data)

    def decode_bytes(self, ids: Sequence[int]) -> bytes:
        """The bytes of the byte tokens (specials dropped): stream-safe."""
        return bytes(i for i in ids if 0 <= i < 256)

    def decode(self, ids: Sequence[int]) -> str:
        return self.decode_bytes(ids).decode("utf-8", errors="replace")

    def compressed_ids(self) -> list[int]:
        """Engram's lookup: token id -> compressed id (len == vocab)."""
        return list(self._compressed)

    def _build_compressed(self) -> list[int]:
        first: dict[str, int] = {}
        out = list(range(self.vocab))
        for b in range(128):
            text = chr(b)
            norm = normalize_text(text)
            if norm in first:
                out[b] = first[norm]
            else:
                first[norm] = b
        return out
