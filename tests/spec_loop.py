"""The seed's speculative loop, greedy, for several sequences at once (test helper).

Per round: ONE ``draft_many`` call for every sequence, ONE target batch holding every
sequence's ``[last, d1..dk]``, greedy verification, ``accept``, and removal of the
rejected positions from the target (and draft) KV cache.
"""

from __future__ import annotations

from dataclasses import dataclass, field

import numpy as np

from engine.session import Batch, Context, ContextConfig, Model, SpeculativeSession


@dataclass
class SpecRun:
    outputs: list[list[int]]
    drafted: list[int] = field(default_factory=list)
    accepted: list[int] = field(default_factory=list)
    rounds: int = 0


def greedy_plain(model: Model, prompt: list[int], n_new: int, n_ctx: int = 512) -> list[int]:
    """Greedy decoding without speculation, one sequence, one token per decode."""
    return greedy_plain_margins(model, prompt, n_new, n_ctx)[0]


def greedy_plain_margins(
    model: Model, prompt: list[int], n_new: int, n_ctx: int = 512
) -> tuple[list[int], list[float]]:
    """Greedy tokens and, per token, the logit gap between the best and second-best token.

    Random tiny models have occasional near-ties; llama.cpp is not batch-invariant, so a
    different batch shape may flip a near-tie. Equality is exact only up to the first one.
    """
    ctx = Context.create(
        model,
        ContextConfig(n_ctx=n_ctx, n_seq=1, n_batch=128, n_ubatch=128),
        n_outputs_max=1,
        n_outputs_max_per_seq=1,
    )
    b = Batch()
    b.add_sequence(prompt, 0, 0, logits="last")
    ctx.decode(b)
    out: list[int] = []
    margins: list[float] = []
    pos = len(prompt)
    while True:
        row = ctx.logits[-1]
        tok = int(np.argmax(row))
        # (not np.partition: walk heads give many equal logits, its slow case)
        second = max(row[:tok].max(initial=-np.inf), row[tok + 1 :].max(initial=-np.inf))
        out.append(tok)
        margins.append(float(row[tok] - second))
        if len(out) == n_new:
            return out, margins
        b = Batch()
        b.add(tok, pos, 0, True)
        ctx.decode(b)
        pos += 1


def tie_safe_prefix(margins: list[float], threshold: float = 0.05) -> int:
    """How many leading tokens can be compared exactly (up to the first near-tie)."""
    for i, m in enumerate(margins):
        if m < threshold:
            return i
    return len(margins)


def prefill(session: SpeculativeSession, seq_id: int, prompt: list[int]) -> None:
    """Decode ``prompt[:-1]`` into the target (feeding the drafter) and begin."""
    body = prompt[:-1]
    n_batch = session.target_context.n_batch
    for start in range(0, len(body), n_batch):
        b = Batch()
        b.add_sequence(body[start : start + n_batch], start, seq_id, logits="none")
        session.decode_target_and_process(b)
    session.begin(seq_id, body)


class GreedyLoop:
    """Per-sequence state of the loop (last token, tokens in the KV cache, outputs)."""

    def __init__(self, session: SpeculativeSession) -> None:
        self.session = session
        self.last: dict[int, int] = {}
        self.n_past: dict[int, int] = {}
        self.outputs: dict[int, list[int]] = {}
        self.drafted: dict[int, int] = {}
        self.accepted: dict[int, int] = {}
        self.drafts: dict[int, list[list[int]]] = {}
        self.rounds = 0

    def start(self, seq_id: int, prompt: list[int]) -> None:
        prefill(self.session, seq_id, prompt)
        self.resume(seq_id, prompt[-1], len(prompt) - 1)

    def resume(self, seq_id: int, last: int, n_past: int) -> None:
        self.last[seq_id] = last
        self.n_past[seq_id] = n_past
        self.outputs[seq_id] = []
        self.drafted[seq_id] = 0
        self.accepted[seq_id] = 0
        self.drafts[seq_id] = []

    def step(self, seqs: list[int]) -> None:
        """One round: one draft call, one target decode, verify, accept, trim the KV."""
        session = self.session
        self.rounds += 1
        drafts = session.draft_many([(s, self.n_past[s], self.last[s]) for s in seqs])
        batch = Batch()
        spans: dict[int, tuple[int, list[int]]] = {}
        for s, d in zip(seqs, drafts, strict=False):
            start = batch.add(self.last[s], self.n_past[s], s, True)
            for i, t in enumerate(d):
                batch.add(t, self.n_past[s] + 1 + i, s, True)
            spans[s] = (start, d)
        session.decode_target_and_process(batch)
        logits = session.target_context.logits  # one row per batch entry (all want logits)
        for s in seqs:
            start, d = spans[s]
            emitted: list[int] = []
            for i in range(len(d) + 1):
                tok = int(np.argmax(logits[start + i]))
                emitted.append(tok)
                if i < len(d) and d[i] == tok:
                    continue
                break
            n_acc = len(emitted) - 1
            self.drafts[s].append(list(d))
            if d:
                session.accept(s, n_acc)
                self.drafted[s] += len(d)
                self.accepted[s] += n_acc
            self.n_past[s] += n_acc + 1
            session.clear_target_kv_cache_seq(s, self.n_past[s], None)
            if session.draft_context is not None:
                session.clear_draft_kv_cache_seq(s, self.n_past[s], None)
            self.last[s] = emitted[-1]
            self.outputs[s].extend(emitted)

    def run(self, seqs: list[int], n_new: int) -> None:
        """Step until every sequence in ``seqs`` has ``n_new`` outputs (extra ones are kept)."""
        while True:
            active = [s for s in seqs if len(self.outputs[s]) < n_new]
            if not active:
                return
            self.step(active)


def speculative_greedy(session: SpeculativeSession, prompts: list[list[int]], n_new: int) -> SpecRun:
    """Generate ``n_new`` greedy tokens for each prompt (sequence i = prompt i) together."""
    loop = GreedyLoop(session)
    seqs = list(range(len(prompts)))
    for s, p in enumerate(prompts):
        loop.start(s, p)
    loop.run(seqs, n_new)
    return SpecRun(
        outputs=[loop.outputs[s][:n_new] for s in seqs],
        drafted=[loop.drafted[s] for s in seqs],
        accepted=[loop.accepted[s] for s in seqs],
        rounds=loop.rounds,
    )
