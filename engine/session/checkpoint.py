"""Versioned, self-validating bytes for one sequence's state.

Layout::

    b"ENGCKPT1"  magic and format version
    u32          length of the JSON header
    header       {"fingerprint": {...}, "sections": [[name, length], ...], "meta": {...}}
    sections     the raw bytes of each section, in header order
    32 bytes     BLAKE2b digest of everything before it

The fingerprint says what the bytes are valid for (models, speculative config, context
size); :func:`unpack` checks magic, version, digest, header and section sizes and, given
the expected fingerprint, that it matches — all before anyone changes any state.
"""

from __future__ import annotations

import hashlib
import json
import struct
from dataclasses import dataclass, field
from typing import Any

from .errors import StateError

__all__ = ["MAGIC", "SequenceCheckpoint", "pack", "unpack"]

MAGIC = b"ENGCKPT1"
_DIGEST = 32
_MAX_HEADER = 1 << 20


@dataclass
class SequenceCheckpoint:
    """The decoded content of a checkpoint."""

    fingerprint: dict[str, Any]
    sections: dict[str, bytes]
    meta: dict[str, Any] = field(default_factory=dict)


def _bad(why: str) -> StateError:
    return StateError(f"invalid checkpoint: {why}", reason=why)


def pack(checkpoint: SequenceCheckpoint) -> bytes:
    header = json.dumps(
        {
            "fingerprint": checkpoint.fingerprint,
            "sections": [[name, len(data)] for name, data in checkpoint.sections.items()],
            "meta": checkpoint.meta,
        },
        sort_keys=True,
    ).encode()
    body = MAGIC + struct.pack("<I", len(header)) + header + b"".join(checkpoint.sections.values())
    return body + hashlib.blake2b(body, digest_size=_DIGEST).digest()


def unpack(
    data: bytes, expected_fingerprint: dict[str, Any] | None = None, *, with_draft: bool | None = None
) -> SequenceCheckpoint:
    """Parse and validate checkpoint bytes.

    ``with_draft``: the sections a sequence of this session has (``target``, ``spec``, and
    ``draft`` when True); None accepts any sections.

    :raises StateError: not a checkpoint, another format version, corrupted (digest), or
        made for other models / another configuration than ``expected_fingerprint``.
    """
    if not isinstance(data, (bytes, bytearray, memoryview)):
        raise _bad("checkpoint data must be bytes")
    data = bytes(data)
    if len(data) < len(MAGIC) + 4 + _DIGEST:
        raise _bad("too short")
    if data[:7] != MAGIC[:7]:
        raise _bad("bad magic (not an engine checkpoint)")
    if data[:8] != MAGIC:
        raise _bad(f"unsupported format version {data[7:8]!r}")
    body, digest = data[:-_DIGEST], data[-_DIGEST:]
    if hashlib.blake2b(body, digest_size=_DIGEST).digest() != digest:
        raise _bad("checksum mismatch (corrupted or truncated)")
    (n_header,) = struct.unpack_from("<I", body, len(MAGIC))
    start = len(MAGIC) + 4
    if n_header > _MAX_HEADER or start + n_header > len(body):
        raise _bad("header length out of range")
    try:
        header = json.loads(body[start : start + n_header])
        sections_table = [(str(n), int(size)) for n, size in header["sections"]]
        fingerprint = dict(header["fingerprint"])
        meta = dict(header.get("meta", {}))
    except (ValueError, KeyError, TypeError) as exc:
        raise _bad(f"malformed header ({exc})") from None
    offset = start + n_header
    sections: dict[str, bytes] = {}
    for name, size in sections_table:
        if size < 0 or offset + size > len(body):
            raise _bad(f"section {name!r} exceeds the data")
        sections[name] = body[offset : offset + size]
        offset += size
    if offset != len(body):
        raise _bad("trailing bytes after the sections")
    if expected_fingerprint is not None and fingerprint != expected_fingerprint:
        diff = sorted(
            k
            for k in set(fingerprint) | set(expected_fingerprint)
            if fingerprint.get(k) != expected_fingerprint.get(k)
        )
        raise _bad(f"made for another model or configuration (differs in: {', '.join(diff)})")
    if with_draft is not None and set(sections) != {"target", "spec"} | ({"draft"} if with_draft else set()):
        raise _bad("unexpected sections")
    return SequenceCheckpoint(fingerprint, sections, meta)
