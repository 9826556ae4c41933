"""What a step costs on this machine: the target decode by rows that need logits, the draft
call, and the drafter keeping up, measured at start and refined from every step.

The draft policy (:mod:`.policy`) weighs drafts with it.
"""

from __future__ import annotations

import bisect
import math
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from typing import overload

import numpy as np

__all__ = ["StepCost"]

#: how far one step moves what it observed, once a size has been seen enough
_LEARNING_RATE = 0.05


@dataclass
class _Line:
    """y = a + b * x by least squares, each new point weighing 1 / decay times the last;
    through the origin while every point has the same x (a drafter's catch-up measured at
    one length at start: a catch-up of more tokens costs more, not the same)."""

    decay: float = 0.98
    w: float = 0.0
    sx: float = 0.0
    sy: float = 0.0
    sxx: float = 0.0
    sxy: float = 0.0
    _fit: tuple[float, float, float] | None = None  #: (mean x, mean y, slope) since the last add

    def add(self, x: float, y: float) -> None:
        d = self.decay
        self.w, self.sx, self.sy = self.w * d + 1, self.sx * d + x, self.sy * d + y
        self.sxx, self.sxy = self.sxx * d + x * x, self.sxy * d + x * y
        self._fit = None

    @overload
    def __call__(self, x: float) -> float: ...
    @overload
    def __call__(self, x: np.ndarray) -> np.ndarray: ...
    def __call__(self, x: float | np.ndarray) -> float | np.ndarray:  # (elementwise on arrays)
        if self.w <= 0:
            return 0.0 * x
        if self._fit is None:  # (the policy evaluates the line for every candidate of a step)
            mx, my = self.sx / self.w, self.sy / self.w
            var = self.sxx / self.w - mx * mx
            slope = (
                (self.sxy / self.w - mx * my) / var
                if var > 1e-12 * max(mx * mx, 1.0)
                else my / mx
                if mx
                else 0.0
            )
            self._fit = (mx, my, slope)
        mx, my, b = self._fit
        return my + b * (x - mx)


@dataclass
class _Fit:
    """y = w · x by least squares over feature vectors x, each new point weighing 1 / decay
    times the last, with a small ridge so that features that have not varied yet (the
    sequences drafting, at one stream) share their weight instead of blowing up."""

    n: int
    decay: float = 0.95
    ridge: float = 1e-6
    _xx: list[list[float]] = field(init=False)
    _xy: list[float] = field(init=False)
    _w: list[float] | None = field(init=False, default=None)

    def __post_init__(self) -> None:
        self._xx = [[0.0] * self.n for _ in range(self.n)]
        self._xy = [0.0] * self.n

    def add(self, x: Sequence[float], y: float) -> None:
        d = self.decay
        for i in range(self.n):
            row = self._xx[i]
            for j in range(self.n):
                row[j] = row[j] * d + x[i] * x[j]
            self._xy[i] = self._xy[i] * d + x[i] * y
        self._w = None

    def __call__(self, x: Sequence[float]) -> float:
        return sum(w * v for w, v in zip(self.weights(), x, strict=True))

    def weights(self) -> list[float]:
        if self._w is None:
            self._w = self._solve()
        return self._w

    def _solve(self) -> list[float]:
        n = self.n
        scale = max((self._xx[i][i] for i in range(n)), default=0.0)
        if scale <= 0:
            return [0.0] * n
        a = [[*self._xx[i], self._xy[i]] for i in range(n)]
        for i in range(n):
            a[i][i] += self.ridge * scale
        for c in range(n):  # (Gauss-Jordan; the matrix is symmetric positive definite)
            pivot = a[c][c]
            for r in range(n):
                if r != c and a[r][c]:
                    f = a[r][c] / pivot
                    a[r] = [v - f * p for v, p in zip(a[r], a[c], strict=True)]
        return [a[i][n] / a[i][i] for i in range(n)]


@dataclass
class StepCost:
    """Step time on this machine, in seconds.

    ``target(rows, prompt)``: the target decode of ``rows`` rows that need logits (one per
    decoding sequence plus its drafts) and ``prompt`` prompt tokens without logits.
    ``draft(k, n)``: a draft call of up to ``k`` positions for ``n`` sequences.

    The rows curve is measured, not assumed: on a CPU the matmul kernels may take rows in
    tiles, and a partial tile can cost as much as a whole one or more (llama.cpp's Q8_0/Q5_0
    kernel read every weight again for the last ``n % 4`` rows until vendor/patches/0007:
    Gemma 3 270M, 2 cores, 16 rows 52 ms, 17 rows 67, 20 rows 62). So the curve is a table
    for the first rows, then whole tiles (interpolated between measured points) plus the
    measured price of a partial tile; ``align`` is the tile (1 where there is no such step,
    as on that machine since the patch).
    """

    small: list[float] = field(default_factory=list)  #: seconds for 1, 2, ... rows
    tiles: list[tuple[int, float]] = field(default_factory=list)  #: (rows, seconds), whole tiles
    partial: list[float] = field(default_factory=lambda: [0.0])  #: extra seconds for r rows past a tile
    align: int = 1
    align_from: int = 0  #: from this many rows on, padding to a whole tile never costs more
    prompt_token: float = 0.0  #: seconds per prompt token
    #: observed ÷ calibrated, by rows on a log2 grid (1, 2, 4, ... 1024 rows, interpolated),
    #: recent steps weighing more: what the calibration (short histories, an idle machine)
    #: does not see, such as attention over long histories, which weighs more on some batch
    #: sizes than on others (so one factor for every size would misprice some of them)
    grid: list[float] = field(default_factory=lambda: [1.0] * 11)
    #: how much each grid point has seen: the steps that moved it, weighed by their reach
    evidence: list[float] = field(default_factory=lambda: [0.0] * 11)
    grid_seen: bool = False
    prompt_scale: float = 1.0  #: observed ÷ calibrated for prompt tokens
    #: a draft call's seconds: a + k * (b + c * n) for k positions (draft passes are
    #: sequential) and n sequences drafting, by least squares over recent calls (an
    #: EAGLE-3 head costs mostly per call, a draft model per pass, an n-gram lookup nothing)
    draft_fit: _Fit = field(default_factory=lambda: _Fit(3))
    #: the drafter keeping up (a stream drafter's pass over a batch, a draft model's
    #: catch-up): seconds against the rows it decodes, a least-squares line
    sync_fit: _Line = field(default_factory=lambda: _Line(decay=0.98))
    #: the calibrated curve for 1, 2, ... rows, computed once (extended as needed): the
    #: policy reads it for every candidate of a step
    _table: np.ndarray = field(default_factory=lambda: np.zeros(0), repr=False, compare=False)
    _steps: dict[int, tuple[float, list[tuple[int, float]]]] = field(
        default_factory=dict, repr=False, compare=False
    )  #: _at
    _effective: list[float] | None = field(default=None, repr=False, compare=False)  #: _scale_grid

    @property
    def calibrated(self) -> bool:
        return bool(self.small)

    def calibrate(self, measure: Callable[[int, int], float], max_rows: int) -> None:
        """Measure target decodes of 1, 2, 4, 5, 8, 16, 32, 64 and 128 rows (up to ``max_rows``;
        3, 6, 7 interpolated, more extrapolated) and one prompt chunk; ``measure(rows,
        prompt)`` returns seconds; each is measured twice (the first run of a shape allocates).

        The large batches are measured, not extrapolated: drafting every match makes steps of
        100 rows and more, and the curve flattens past 32 rows, so an extrapolation prices
        them too dear by just enough to flip the choice from step to step."""

        def best_of_two(rows: int, prompt: int = 0) -> float:  # (the first of a shape allocates)
            return min(measure(rows, prompt), measure(rows, prompt))

        got = {r: best_of_two(r) for r in (1, 2, 4, 5, 8) if r <= max_rows}
        tile = 4
        if 8 in got:
            per_row = (got[8] - got[4]) / tile
            first = got[5] - got[4]  # a partial tile's first row
            self.align = tile if first > 1.5 * per_row else 1
            self.partial = [0.0, first, first + per_row, first + 2 * per_row] if self.align > 1 else [0.0]

        def between(r: int) -> float:  # a row count that was not measured
            if self.align > 1 and r > 4 and 4 in got:
                return got[4] + self.partial[r - 4]
            lo = max(x for x in got if x < r)
            hi = min((x for x in got if x > r), default=lo)
            return got[lo] if hi == lo else got[lo] + (got[hi] - got[lo]) * (r - lo) / (hi - lo)

        self.small = [got[r] if r in got else between(r) for r in range(1, min(max_rows, 8) + 1)]
        self.tiles = [(r, got[r]) for r in (4, 8) if r in got]
        self.tiles += [(r, best_of_two(r)) for r in (16, 32, 64, 128) if r <= max_rows]
        self._table, self._steps = np.zeros(0), {}
        chunk = 32
        self.prompt_token = max(0.0, (best_of_two(1, chunk) - self.small[0]) / chunk)
        misaligned = [n for n in range(1, 33) if n % self.align]
        ok = [
            all(self._curve(self._whole(m)) <= self._curve(m) for m in misaligned if m >= n)
            for n in range(1, 34)
        ]
        self.align_from = next((n for n in range(1, 34) if ok[n - 1]), 0) if self.align > 1 else 0

    def _whole(self, rows: int) -> int:
        return -(-rows // self.align) * self.align

    def _curve(self, rows: int) -> float:
        return float(self._curves(rows)[max(rows, 1) - 1])

    def _curves(self, upto: int) -> np.ndarray:
        """The calibrated curve for 1, 2, ... rows, at least up to ``upto``."""
        if len(self._table) < upto:
            size = max(upto, 2 * len(self._table), 64)
            self._table = np.array([self._compute_curve(r) for r in range(1, size + 1)])
        return self._table

    def _compute_curve(self, rows: int) -> float:
        if rows <= len(self.small):
            return self.small[max(rows, 1) - 1]
        whole = rows // self.align * self.align
        return self._tiles(whole) + self.partial[rows - whole]

    def _tiles(self, rows: float) -> float:
        t = self.tiles
        if len(t) < 2:
            return self.small[-1] * rows / len(self.small)
        i = min(max(bisect.bisect_left(t, rows, key=lambda p: p[0]), 1), len(t) - 1)
        (x0, y0), (x1, y1) = t[i - 1], t[i]
        return y0 + (y1 - y0) * (rows - x0) / (x1 - x0)

    def target(self, rows: float, prompt: int = 0) -> float:
        if not self.calibrated:
            return rows + 0.4 * prompt  # uncalibrated: a token is a token
        return self.scale(rows) * self._interpolate(rows) + self.prompt_scale * prompt * self.prompt_token

    def targets(self, lo: int, hi: int) -> np.ndarray:
        """``target(r)`` for every whole number of rows ``lo <= r <= hi`` (``lo >= 1``), no
        prompt: the curve the policy interpolates its candidates on, drafts adding rows to a
        step of ``lo``. Never scaled below ``lo``'s factor: under load a row also attends
        over the histories held, which weighs more on a step of more rows, so a step with
        drafts is not relatively cheaper than the one without."""
        rows = np.arange(lo, hi + 1)
        if not self.calibrated:
            return rows.astype(float)
        out: np.ndarray = np.maximum.accumulate(self.scales(rows)) * self._curves(hi)[lo - 1 : hi]
        return out

    def scale(self, rows: float) -> float:
        """Observed ÷ calibrated at ``rows`` (interpolated on the log2 grid)."""
        # (every step asks once: plain floats, numpy's per-call overhead is most of the work)
        top = len(self.grid) - 1
        u = min(math.log2(rows), top) if rows > 1.0 else 0.0
        i = min(int(u), top - 1)
        f = u - i
        grid = self._scale_grid()
        return grid[i] * (1.0 - f) + grid[i + 1] * f

    def scales(self, rows: np.ndarray) -> np.ndarray:
        """:meth:`scale` at each of ``rows``."""
        top = len(self.grid) - 1
        u = np.clip(np.log2(np.maximum(rows, 1.0)), 0.0, top)
        i = np.minimum(u.astype(np.intp), top - 1)
        f = u - i
        grid = np.asarray(self._scale_grid())
        out: np.ndarray = grid[i] * (1.0 - f) + grid[i + 1] * f
        return out

    def _scale_grid(self) -> list[float]:
        """The grid as priced: a size seen little takes the factor of the sizes below it,
        its own only as it is seen. The size seen most (a step without drafts) learns the
        load first; a size seen rarely (a step of many drafts) must not keep the
        calibration's price meanwhile, or drafts look cheaper than they are."""
        if self._effective is None:
            out, below = [], self.grid[0]
            for g, seen in zip(self.grid, self.evidence, strict=True):
                below = (seen * g + below) / (seen + 1.0)  # (the sizes below count as one step)
                out.append(below)
            self._effective = out
        return self._effective

    def _interpolate(self, rows: float) -> float:
        lo = int(rows)
        frac = rows - lo
        y = self._curve(max(lo, 1))
        return max(y + (self._curve(lo + 1) - y) * frac if frac else y, 1e-9)

    def observe(self, rows: int, prompt: int, seconds: float) -> None:
        """A target decode as it ran: move the scale at its rows towards it, or the prompt
        tokens' scale when they made most of the step."""
        if not (self.calibrated and rows > 0 and seconds > 0):
            return
        base, reach = self._at(rows)
        chunk = self.prompt_scale * prompt * self.prompt_token
        if not self.grid_seen:  # (the first step sets every size: nothing better is known)
            self.grid = [seconds / (base + chunk)] * len(self.grid)
            self.grid_seen, self._effective = True, None
            return
        lr = _LEARNING_RATE
        if not chunk or chunk <= 0.25 * self.scale(rows) * base:
            # (the mean of a point's steps, weighed by their reach, until recent steps
            # weigh more: a size seen rarely learns from the few there are)
            ratio = max(seconds - chunk, 0.0) / base
            grid, evidence = self.grid, self.evidence
            for j, w in reach:
                evidence[j] += w
                grid[j] += w * max(lr, 1.0 / evidence[j]) * (ratio - grid[j])
            self._effective = None
        else:
            ratio = (seconds - self.scale(rows) * base) / (prompt * self.prompt_token)
            self.prompt_scale += lr * (min(max(ratio, 0.2), 5.0) - self.prompt_scale)

    def _at(self, rows: int) -> tuple[float, list[tuple[int, float]]]:
        """A step of ``rows``: its calibrated seconds, and how far it moves each grid point
        it moves, as (point, weight): fully at its own size, a quarter one octave away, not
        at all from two octaves on (a size that far is priced from the sizes below it until
        it is seen: steps without drafts must not teach the sizes only drafts make). Every
        step asks: kept per row count."""
        at = self._steps.get(rows)
        if at is None:
            u = min(math.log2(rows), len(self.grid) - 1.0)
            reach = [(j, 4.0 ** -abs(u - j)) for j in range(len(self.grid)) if abs(u - j) < 2]
            at = self._steps[rows] = (self._interpolate(rows), reach)
        return at

    def draft(self, k: int, n: int) -> float:
        return float(self.drafts(np.asarray(k), np.asarray(n)))

    def drafts(self, k: np.ndarray, n: np.ndarray) -> np.ndarray:
        """:meth:`draft` elementwise."""
        w0, w1, w2 = self.draft_fit.weights()
        out: np.ndarray = np.where((k > 0) & (n > 0), np.maximum(w0 + k * (w1 + w2 * n), 0.0), 0.0)
        return out

    def observe_draft(self, k: int, n: int, seconds: float) -> None:
        if k > 0 and n > 0 and seconds >= 0:
            self.draft_fit.add((1.0, k, k * n), seconds)

    def sync(self, rows: float) -> float:
        return float(self.syncs(np.asarray(rows, dtype=float)))

    def syncs(self, rows: np.ndarray) -> np.ndarray:
        """:meth:`sync` elementwise."""
        out: np.ndarray = np.where(rows > 0, np.maximum(self.sync_fit(rows), 0.0), 0.0)
        return out

    def observe_sync(self, rows: int, seconds: float) -> None:
        if rows > 0 and seconds >= 0:
            self.sync_fit.add(rows, seconds)
