"""Checkpoint packing: a request's sequence as checkpoint bytes, and back.

The bytes are a :mod:`engine.session.checkpoint` container: the engine's fingerprint, the
native sections (target KV, draft KV, speculative state) and, as meta, the sequence they
hold: its tokens in the KV cache, its last sampled token and how many tokens are prompt.
"""

from __future__ import annotations

from typing import Any

from ..session import StateError
from ..session.checkpoint import SequenceCheckpoint, pack, unpack
from .request import Request, Resume

__all__ = ["pack_request", "unpack_resume"]


def pack_request(fingerprint: dict[str, Any], sections: dict[str, bytes], request: Request) -> bytes:
    """The checkpoint of ``request``'s sequence, captured at a step boundary."""
    meta = {
        "history": list(request.history),
        "last": request.last,
        "n_prompt": request.n_prompt_history,
        "request_id": request.request_id,
        "drafter_in_sync": request.drafter_in_sync,
    }
    return pack(SequenceCheckpoint(fingerprint, sections, meta))


def unpack_resume(data: bytes, fingerprint: dict[str, Any], with_draft: bool) -> Resume:
    """The sequence a checkpoint of this engine holds.

    :raises StateError: not a checkpoint, corrupted, or made for another configuration.
    """
    ck = unpack(data, fingerprint, with_draft=with_draft)
    try:
        meta = ck.meta
        history = [int(t) for t in meta["history"]]
        last, n_prompt = int(meta["last"]), int(meta["n_prompt"])
        in_sync = meta.get("drafter_in_sync", True)
        if not isinstance(in_sync, bool):
            raise TypeError
    except (KeyError, TypeError, ValueError):
        raise StateError("invalid checkpoint: missing sequence metadata", reason="meta") from None
    s = ck.sections
    return Resume(s["target"], s.get("draft", b""), s["spec"], history, last, n_prompt, in_sync)
