"""Reports of load runs: tables, medians of interleaved repeats with their spread, ratios
(speculation on ÷ off, prefix reuse on ÷ off, preemption on ÷ off) and plots."""

from __future__ import annotations

from collections.abc import Callable, Sequence
from operator import attrgetter
from pathlib import Path

from .load import BenchResult, percentile
from .scenarios import OverloadResult, TurnStats

__all__ = [
    "median_spread",
    "medians",
    "paired_ratio",
    "plot",
    "reuse_ratios",
    "speedups",
    "summarize",
    "summarize_overload",
    "summarize_turns",
]


def summarize_turns(stats: list[TurnStats]) -> str:
    """Per turn: prompt tokens sent, tokens actually prefilled, the cached share, TTFT."""
    routed = any(s.replicas for s in stats)
    head = f"{'turn':>4} {'cache':>5} {'prompt tok':>10} {'prefilled':>9} {'cached':>7} {'TTFT p50 s':>10}"
    head += f" {'TTFT p90 s':>10}" + (f" {'same replica':>12}" if routed else "")
    lines = [head, "-" * len(head)]
    for s in stats:
        d = s.as_dict()
        line = (
            f"{s.turn:>4} {'on' if s.prefix_cache else 'off':>5} {d['prompt_tokens_mean']:10.1f} "
            f"{s.prefilled:9.1f} {s.cached_share:7.1%} {d['ttft_p50']:10.3f} {d['ttft_p90']:10.3f}"
        )
        if routed:
            line += f" {s.on_first_replica:>5}/{len(s.prompt_tokens):<6}"
        lines.append(line)
    return "\n".join(lines)


def summarize_overload(results: list[OverloadResult]) -> str:
    """Each run, then preemption on against off (medians of interleaved pairs)."""
    head = (
        f"{'preemption':>10} {'tok/s':>7} {'preempted':>9} {'short TTFT p50/90/99 s':>23} "
        f"{'long TTFT p50/90/99 s':>22}"
    )
    lines = [head, "-" * len(head)]
    for r in results:
        lines.append(
            f"{'on' if r.preemption else 'off':>10} {r.tokens_per_s:7.1f} {r.preemptions:9d} "
            f"{_p3(r.short_ttft, 1, '.2f'):>23} {_p3(r.long_ttft, 1, '.2f'):>22}"
        )
    on = [r for r in results if r.preemption]
    off = [r for r in results if not r.preemption]
    if on and off:

        def med(xs: list[float]) -> str:
            m, lo, hi = median_spread(xs) or (float("nan"),) * 3
            return f"{m:.2f}x [{lo:.2f}, {hi:.2f}]"

        pairs = list(zip(on, off, strict=False))
        ttft = [percentile(b.short_ttft, 0.99) / percentile(a.short_ttft, 0.99) for a, b in pairs]
        tput = [a.tokens_per_s / b.tokens_per_s for a, b in pairs if b.tokens_per_s]
        lines += [
            "",
            f"preemption on vs off ({len(pairs)} interleaved pairs, median [min, max]): short requests' "
            f"TTFT p99 {med(ttft)} sooner; throughput {med(tput)}",
        ]
    return "\n".join(lines)


def _p3(values: list[float], scale: float, fmt: str) -> str:
    return "/".join(format(scale * percentile(values, q), fmt) for q in (0.5, 0.9, 0.99))


def medians(results: list[BenchResult]) -> list[BenchResult]:
    """One run per (N, variant): the run with the median throughput of its repeats."""
    groups: dict[tuple[int, str], list[BenchResult]] = {}
    for r in results:
        groups.setdefault((r.n_streams, r.variant), []).append(r)
    return [sorted(g, key=lambda r: r.tokens_per_s)[(len(g) - 1) // 2] for g in groups.values()]


def speedups(
    results: list[BenchResult], reference: str = "none", whole: bool = False
) -> list[tuple[int, str, float, float, float]]:
    """(N, variant, median, min, max) of each speculative type's throughput ÷ ``reference``'s
    with the same prefix cache setting, paired repeat by repeat (interleaved
    repeats: A, B, B, A, ...); ``whole``: the whole runs' throughput, not the steady window's."""
    out = []
    for n in sorted({r.n_streams for r in results}):
        for variant in dict.fromkeys(r.variant for r in results if r.speculative != reference):
            runs = [r for r in results if r.n_streams == n and r.variant == variant]
            ref = [
                r
                for r in results
                if r.n_streams == n
                and r.speculative == reference
                and runs
                and r.prefix_cache == runs[0].prefix_cache
            ]
            ratio = paired_ratio(runs, ref, whole)
            if ratio is not None:
                out.append((n, variant, *ratio))
    return out


def reuse_ratios(
    results: list[BenchResult],
) -> list[tuple[int, str, tuple[float, float, float], tuple[float, float, float]]]:
    """(N, speculative type, throughput ratio, TTFT p50 ratio) of prefix cache on against
    off, each a (median, min, max) over runs paired in the order they ran; the TTFT ratio
    is off ÷ on (how many times sooner the first token comes)."""
    out = []
    for n in sorted({r.n_streams for r in results}):
        for spec in dict.fromkeys(r.speculative for r in results):
            on = [r for r in results if (r.n_streams, r.speculative, r.prefix_cache) == (n, spec, True)]
            off = [r for r in results if (r.n_streams, r.speculative, r.prefix_cache) == (n, spec, False)]
            tput = paired_ratio(on, off)
            ttft = _paired(off, on, lambda r: percentile(r.ttft, 0.5))
            if tput is not None and ttft is not None:
                out.append((n, spec, tput, ttft))
    return out


def _paired(
    a: Sequence[BenchResult], b: Sequence[BenchResult], value: Callable[[BenchResult], float]
) -> tuple[float, float, float] | None:
    return median_spread([value(x) / value(y) for x, y in zip(a, b, strict=False) if value(y) > 0])


def median_spread(values: Sequence[float]) -> tuple[float, float, float] | None:
    """(median, min, max) of repeated measurements (the lower median of an even count)."""
    v = sorted(values)
    return (v[(len(v) - 1) // 2], v[0], v[-1]) if v else None


def paired_ratio(
    a: Sequence[BenchResult], b: Sequence[BenchResult], whole: bool = False
) -> tuple[float, float, float] | None:
    """Median, min and max of ``a[i]`` ÷ ``b[i]`` throughput (the steady window's, or with
    ``whole`` the whole run's: ramp, tail and every request's first token included), runs
    paired in the order they ran (None when no pair has a throughput to divide by)."""
    return _paired(a, b, attrgetter("whole_run_tokens_per_s" if whole else "tokens_per_s"))


def summarize(results: list[BenchResult]) -> str:
    """A table (medians of repeats): steady-state tok/s, the raw decode ceiling and the ratio
    to it, acceptance, occupancy, latencies; then speculation on ÷ off per N."""
    head = (
        f"{'N':>4} {'spec':>23} {'tok/s':>8} {'raw tok/s':>10} {'ratio':>6} {'req/s':>6} {'cached':>6} {'drafted':>8} "
        f"{'accept':>7} {'acc.len':>7} {'occup':>6} {'TTFT p50/90/99 s':>18} {'ITL p50/90/99 ms':>18} "
        f"{'e2e p50/90/99 s':>18}"
    )
    lines = [head, "-" * len(head)]
    for r in medians(results):
        raw = r.raw_tokens_per_s
        ratio = f"{r.tokens_per_s / raw:6.2f}" if raw else "     -"
        lines.append(
            f"{r.n_streams:>4} {r.variant:>23} {r.tokens_per_s:8.1f} "
            f"{(raw or float('nan')):10.1f} {ratio} {r.requests_per_s:6.2f} "
            f"{r.cached_tokens / r.prompt_tokens if r.prompt_tokens else 0:6.0%} {r.drafted:8d} "
            f"{r.acceptance_rate:7.1%} {r.mean_acceptance_length:7.2f} {r.occupancy:6.2f} "
            f"{_p3(r.ttft, 1, '.2f'):>18} {_p3(r.itl, 1000, '.0f'):>18} {_p3(r.e2e, 1, '.2f'):>18}"
        )
    ups = speedups(results)
    if ups:
        repeats = max(sum(1 for r in results if (r.n_streams, r.variant) == (n, s)) for n, s, *_ in ups)
        lines += [
            "",
            f"speculation on ÷ off, steady state (median of {repeats} interleaved repeats [min, max]):",
        ]
        for n, spec, med, lo, hi in ups:
            drafted = sum(r.drafted for r in results if (r.n_streams, r.variant) == (n, spec))
            note = "" if drafted else "  (drafted nothing)"
            lines.append(f"  N={n:<3} {spec:>23}: {med:5.2f}x  [{lo:.2f}, {hi:.2f}]{note}")
    reuse = reuse_ratios(results)
    if reuse:
        lines += ["", "prefix cache on ÷ off (median of interleaved repeats [min, max]):"]
        for n, spec, (tm, tlo, thi), (fm, flo, fhi) in reuse:
            lines.append(
                f"  N={n:<3} {spec:>14}: throughput {tm:5.2f}x [{tlo:.2f}, {thi:.2f}], "
                f"TTFT p50 {fm:5.2f}x sooner [{flo:.2f}, {fhi:.2f}]"
            )
    return "\n".join(lines)


def plot(results: list[BenchResult], path: str | Path, title: str = "") -> None:
    """Throughput and p90 latencies against N, one line per speculative type (and the raw
    decode ceiling), as a PNG. Needs matplotlib (the ``demo`` extra)."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    results = medians(results)
    specs = list(dict.fromkeys(r.variant for r in results))
    fig, axes = plt.subplots(1, 3, figsize=(15, 4.5), constrained_layout=True)
    panels: list[tuple[str, Callable[[BenchResult], float]]] = [
        ("output tokens/s", lambda r: r.tokens_per_s),
        ("time to first token p90 (s)", lambda r: percentile(r.ttft, 0.9)),
        ("inter-token latency p90 (ms)", lambda r: 1000 * percentile(r.itl, 0.9)),
    ]
    for ax, (label, value) in zip(axes, panels, strict=True):
        for spec in specs:
            rows = sorted((r for r in results if r.variant == spec), key=lambda r: r.n_streams)
            name = "no speculation" if spec == "none" else spec
            ax.plot([r.n_streams for r in rows], [value(r) for r in rows], marker="o", label=name)
        ax.set_xscale("log", base=2)
        ax.set_xlabel("concurrent streams N")
        ax.set_ylabel(label)
        ax.grid(True, alpha=0.3)
    raw = sorted({(r.n_streams, r.raw_tokens_per_s) for r in results if r.raw_tokens_per_s})
    if raw:
        axes[0].plot(
            [n for n, _ in raw],
            [t for _, t in raw],
            "k--",
            marker="x",
            label="raw batched decode (llama.cpp)",
        )
    axes[0].legend(fontsize=8)
    for ax in axes:
        ticks = sorted({r.n_streams for r in results})
        ax.set_xticks(ticks, [str(t) for t in ticks])
    if title:
        fig.suptitle(title)
    fig.savefig(path, dpi=110)
    plt.close(fig)
