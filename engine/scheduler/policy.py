"""How many tokens each sequence drafts: as many as pay for themselves.

Every drafted token is verified by the target, and on a compute-bound machine (a CPU, or a
big batch on a GPU) each verified position costs almost a full token of target compute — on
Gemma 3 270M its 262k-token output projection dominates. Drafting k tokens with per-token
acceptance alpha yields E(k) = 1 + alpha + ... + alpha^k tokens per verification, at a cost
of (base + 1 + k) token-equivalents, where ``base`` is the step's fixed cost (weights,
graph, sampling) shared by the B sequences of the batch. The policy picks, per sequence,
the k that maximises E(k) / (base/B + 1 + k): long drafts for sequences whose drafts are
accepted, none for those whose drafts are not, fewer as the batch grows.

``base`` is learned online from the steps' decode times (t = a + c * tokens, base = a / c);
``alpha`` per request from its own accepted/drafted counts, starting from a neutral prior.
A sequence that stopped drafting probes with one token every ``probe_every`` steps.

With per-sequence KV streams (``unified_kv=False``) llama.cpp runs a step whose sequences
have different row counts as several passes, each costing the full fixed cost: there the
adaptive policy drafts only while a single sequence is decoding.
"""

from __future__ import annotations

from dataclasses import dataclass

__all__ = ["DraftPolicy"]


@dataclass
class DraftPolicy:
    adaptive: bool = True
    unified_kv: bool = True
    prior_alpha: float = 0.6
    prior_weight: float = 4.0
    default_base: float = 4.0
    probe_every: int = 16
    decay: float = 0.97
    # exponentially weighted sums for the step-cost regression
    _w: float = 0.0
    _sn: float = 0.0
    _st: float = 0.0
    _snn: float = 0.0
    _snt: float = 0.0

    def observe_step(self, n_tokens: int, t_decode_us: float) -> None:
        if n_tokens <= 0 or t_decode_us <= 0:
            return
        d = self.decay
        self._w = self._w * d + 1.0
        self._sn = self._sn * d + n_tokens
        self._st = self._st * d + t_decode_us
        self._snn = self._snn * d + n_tokens * n_tokens
        self._snt = self._snt * d + n_tokens * t_decode_us

    @property
    def base(self) -> float:
        """The step's fixed cost in token-equivalents (a / c of t = a + c * tokens)."""
        w = self._w
        if w < 4:
            return self.default_base
        mean_n, mean_t = self._sn / w, self._st / w
        var = self._snn / w - mean_n * mean_n
        if var < 1.0:
            return self.default_base
        c = (self._snt / w - mean_n * mean_t) / var
        if c <= 0:
            return self.default_base
        a = mean_t - c * mean_n
        return min(max(a / c, 0.5), 256.0)

    def alpha(self, accepted: int, drafted: int) -> float:
        return (accepted + self.prior_alpha * self.prior_weight) / (drafted + self.prior_weight)

    def n_draft(self, *, max_k: int, accepted: int, drafted: int, n_decoding: int, step: int) -> int:
        """Draft length for one sequence this step."""
        if max_k <= 0:
            return 0
        if not self.adaptive:
            return max_k
        if not self.unified_kv and n_decoding > 1:
            return 0
        alpha = self.alpha(accepted, drafted)
        share = self.base / max(n_decoding, 1)
        best_k, best = 0, 1.0 / (share + 1.0)
        expected, p = 1.0, 1.0
        for k in range(1, max_k + 1):
            p *= alpha
            expected += p
            value = expected / (share + 1.0 + k)
            if value > best:
                best, best_k = value, k
        if best_k == 0 and step % self.probe_every == 0:
            return 1  # keep measuring: acceptance may have changed
        return best_k
