"""The report envelope: the one implementation the engine signs with and the router
verifies with (spec and worked examples: `docs/protocol.md`).

Canonical bytes (what the signature covers). Every field is length-prefixed with a
4-byte big-endian length, integers are 8-byte big-endian unsigned, strings UTF-8 (ids
are ASCII by rule), the body is raw bytes; a fixed domain tag comes first so a signature
over a report can never be mistaken for one over anything else:

    canonical = DOMAIN || F(engine_id) || F(key_id) || F(u64 epoch) || F(u64 seq)
                || F(u64 issued_at_ms) || F(kind) || F(body)
    F(x)      = u32be(len(x)) || x
    DOMAIN    = b"ramjet-report\\x00v1\\x00"

Wire frame: `canonical || F(signature)`, the signature being Ed25519 over `canonical`
(64 bytes). A frame is bounded: callers check its length against the size cap before
`decode` parses anything; `decode` also takes the cap and refuses first thing.
"""

from __future__ import annotations

import hmac
import struct
from dataclasses import dataclass
from typing import Literal, get_args

from cryptography.exceptions import InvalidSignature
from cryptography.hazmat.primitives.asymmetric.ed25519 import Ed25519PrivateKey, Ed25519PublicKey

from ramjet.errors import ReportError
from ramjet.types import ID_PATTERN as ID_PATTERN
from ramjet.types import EngineId

DOMAIN = b"ramjet-report\x00v1\x00"
SIGNATURE_BYTES = 64
MAX_U64 = 2**64 - 1
ReportKind = Literal["delta", "snapshot", "load", "profile"]
KINDS: frozenset[str] = frozenset(get_args(ReportKind))

_U32 = struct.Struct(">I")
_U64 = struct.Struct(">Q")


class EnvelopeError(ReportError, ValueError):
    """A frame that is not a well-formed report. `reason` is the rejection reason:
    "oversize", "malformed" or "missing_signature"."""

    def __init__(self, reason: str, detail: str) -> None:
        super().__init__(f"{reason}: {detail}")
        self.reason = reason
        self.detail = detail


@dataclass(frozen=True, slots=True)
class Envelope:
    engine_id: EngineId
    key_id: str
    epoch: int
    seq: int
    issued_at_ms: int
    kind: ReportKind
    body: bytes

    def __post_init__(self) -> None:
        for name in ("engine_id", "key_id"):
            value = getattr(self, name)
            if not isinstance(value, str) or not ID_PATTERN.fullmatch(value):
                raise ValueError(f"{name} must match {ID_PATTERN.pattern}, got {value!r}")
        for name in ("epoch", "seq", "issued_at_ms"):
            value = getattr(self, name)
            if not isinstance(value, int) or isinstance(value, bool) or not 0 <= value <= MAX_U64:
                raise ValueError(f"{name} must be an integer in [0, 2**64), got {value!r}")
        if self.kind not in KINDS:
            raise ValueError(f"kind must be one of {sorted(KINDS)}, got {self.kind!r}")
        if not isinstance(self.body, bytes):
            raise ValueError("body must be bytes")

    def canonical_bytes(self) -> bytes:
        """The exact bytes the signature covers (see the module docstring)."""
        parts = [
            self.engine_id.encode("ascii"),
            self.key_id.encode("ascii"),
            _U64.pack(self.epoch),
            _U64.pack(self.seq),
            _U64.pack(self.issued_at_ms),
            self.kind.encode("ascii"),
            self.body,
        ]
        out = bytearray(DOMAIN)
        for p in parts:
            out += _U32.pack(len(p))
            out += p
        return bytes(out)


def sign(envelope: Envelope, private_key: Ed25519PrivateKey) -> bytes:
    """The wire frame: canonical bytes followed by the length-prefixed signature."""
    canonical = envelope.canonical_bytes()
    signature = private_key.sign(canonical)
    return canonical + _U32.pack(len(signature)) + signature


@dataclass(frozen=True, slots=True)
class SignedEnvelope:
    """A decoded, not yet verified, frame."""

    envelope: Envelope
    signed: bytes | memoryview
    """The canonical bytes as they arrived (the signature covers exactly these): a view
    of the frame when the frame is `bytes` (immutable, so what is verified cannot change
    under the view), not a copy of it (5.6 MB at the frame cap, on the event loop)."""
    signature: bytes


def _field(frame: memoryview, pos: int, what: str, limit: int) -> tuple[bytes, int]:
    if pos + 4 > len(frame):
        raise EnvelopeError("malformed", f"frame ends before the length of {what}")
    (n,) = _U32.unpack_from(frame, pos)
    pos += 4
    if n > limit or pos + n > len(frame):
        raise EnvelopeError("malformed", f"{what} length {n} runs past the frame")
    return bytes(frame[pos : pos + n]), pos + n


def _ident(raw: bytes, what: str) -> str:
    try:
        text = raw.decode("ascii")
    except UnicodeDecodeError:
        raise EnvelopeError("malformed", f"{what} is not ASCII") from None
    if not ID_PATTERN.fullmatch(text):
        raise EnvelopeError("malformed", f"{what} must match {ID_PATTERN.pattern}")
    return text


def _u64(raw: bytes, what: str) -> int:
    if len(raw) != 8:
        raise EnvelopeError("malformed", f"{what} must be 8 bytes")
    value: int = _U64.unpack(raw)[0]
    return value


def decode(frame: bytes, max_bytes: int) -> SignedEnvelope:
    """Parse a wire frame, refusing one longer than `max_bytes` before reading it.

    Raises `EnvelopeError` ("oversize", "malformed", "missing_signature"). Verifies
    nothing: see `verify_signature`.
    """
    if len(frame) > max_bytes:
        raise EnvelopeError("oversize", f"{len(frame)} bytes > cap {max_bytes}")
    view = memoryview(frame)
    if not hmac.compare_digest(bytes(view[: len(DOMAIN)]), DOMAIN):
        raise EnvelopeError("malformed", "domain tag missing or of another version")
    pos = len(DOMAIN)
    engine_raw, pos = _field(view, pos, "engine_id", 64)
    key_raw, pos = _field(view, pos, "key_id", 64)
    epoch_raw, pos = _field(view, pos, "epoch", 8)
    seq_raw, pos = _field(view, pos, "seq", 8)
    issued_raw, pos = _field(view, pos, "issued_at_ms", 8)
    kind_raw, pos = _field(view, pos, "kind", 16)
    body, pos = _field(view, pos, "body", len(frame))
    signed_end = pos
    if pos == len(frame):
        raise EnvelopeError("missing_signature", "frame ends after the body")
    signature, pos = _field(view, pos, "signature", SIGNATURE_BYTES)
    if pos != len(frame):
        raise EnvelopeError("malformed", f"{len(frame) - pos} trailing bytes after the signature")
    kind = kind_raw.decode("ascii", "replace")
    if kind not in KINDS:
        raise EnvelopeError("malformed", f"unknown kind {kind!r}")
    envelope = Envelope(
        engine_id=EngineId(_ident(engine_raw, "engine_id")),
        key_id=_ident(key_raw, "key_id"),
        epoch=_u64(epoch_raw, "epoch"),
        seq=_u64(seq_raw, "seq"),
        issued_at_ms=_u64(issued_raw, "issued_at_ms"),
        kind=kind,  # type: ignore[arg-type]  # checked against KINDS above
        body=body,
    )
    signed = view[:signed_end] if type(frame) is bytes else bytes(view[:signed_end])
    return SignedEnvelope(envelope, signed, signature)


def verify_signature(signed: SignedEnvelope, public_key: Ed25519PublicKey) -> bool:
    """Ed25519 over the canonical bytes as received (OpenSSL: constant time)."""
    if len(signed.signature) != SIGNATURE_BYTES:
        return False
    try:
        public_key.verify(signed.signature, signed.signed)
    except InvalidSignature:
        return False
    return True
