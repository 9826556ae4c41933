"""Rendering of the side-by-side benchmark (``side_by_side.py``): BENCHMARKS.md, the
README's speculation table and the speculation plot, from the measured ``sections`` (one per
prompt set: rows of ``BenchResult`` per N and speculative type, paired speedups) and the
run's ``meta``."""

from __future__ import annotations

import math
from pathlib import Path
from typing import Any

from engine.bench import percentile

#: the footnote of a row where speculation was on and drafted nothing
DRAFTED_NOTHING = (
    "† speculation was on but our engine drafted nothing in this row (its policy found no draft "
    "that pays): the figures measure what speculation costs when it drafts nothing."
)


def drafted_nothing(row: dict[str, Any]) -> bool:
    """A row where speculation was on and our engine drafted nothing."""
    return bool(row["spec"] != "none" and row["ours"].drafted == 0)


def _ratio(a: float, b: float | None) -> str:
    return f"{a / b:.2f}" if b else "-"


def _ms(values: list[float], q: float) -> str:
    return f"{1000 * percentile(values, q):.0f}" if values else "-"


def _table(rows: list[dict[str, Any]]) -> list[str]:
    lines = [
        "| N | speculation | ours tok/s | llama-server tok/s | ours ÷ server | raw ceiling tok/s "
        "| ours ÷ raw | llama-cpp-python tok/s | ours ÷ l-c-p | TTFT p50 ms ours / server "
        "| ITL p50 ms ours / server | acceptance ours / server | same tokens as server |",
        "|---:|---|---:|---:|---:|---:|---:|---:|---:|---:|---:|---:|---:|",
    ]
    for r in rows:
        ours, srv, lcp, raw = r["ours"], r["server"], r.get("lcp"), r.get("raw")
        lcp_tps = lcp.tokens_per_s if lcp else None
        spec = r["spec"] + (" †" if drafted_nothing(r) else "")
        lines.append(
            f"| {r['n']} | {spec} | {ours.tokens_per_s:.1f} | {srv.tokens_per_s:.1f} | "
            f"{_ratio(ours.tokens_per_s, srv.tokens_per_s)} | {raw:.1f} | "
            f"{_ratio(ours.tokens_per_s, raw)} | "
            f"{f'{lcp_tps:.1f}' if lcp_tps else '-'} | {_ratio(ours.tokens_per_s, lcp_tps)} | "
            f"{_ms(ours.ttft, 0.5)} / {_ms(srv.ttft, 0.5)} | {_ms(ours.itl, 0.5)} / {_ms(srv.itl, 0.5)} | "
            f"{ours.acceptance_rate:.0%} / {srv.acceptance_rate:.0%} | {r['agreement']:.0%} |"
        )
    return lines


PROMPT_SET_TITLES = {
    "mixed": "Mixed prompts (`--prompts mixed`: questions, lists, code, stories)",
    "copy": "Copy-heavy prompts (`--prompts copy`: answers that repeat the prompt, where n-gram drafting pays)",
}


def _x(t: tuple[float, float, float]) -> str:
    return f"**{t[0]:.2f}** [{t[1]:.2f}, {t[2]:.2f}]"


def _by_row(speedups: list[Any]) -> dict[tuple[int, str], tuple[float, float, float]]:
    """Speedups ``(N, type, median, min, max)`` keyed by ``(N, type)``."""
    return {(n, sp): (m, lo, hi) for n, sp, m, lo, hi in speedups}


def speculation_table(sections: list[dict[str, Any]]) -> list[str]:
    """Speculation on ÷ off for us and llama-server, and us ÷ llama-server with it on: the
    median of the interleaved repeats' paired ratios [min, max]."""
    lines = [
        "| prompts | N | ours off | ours on | ours on ÷ off | drafted / accepted | server off "
        "| server on | server on ÷ off | ours ÷ server, on |",
        "|---|---:|---:|---:|---:|---:|---:|---:|---:|---:|",
    ]
    for sec in sections:
        rows = {(r["n"], r["spec"]): r for r in sec["rows"]}
        ours_up = _by_row(sec["speedups_ours"])
        srv_up = _by_row(sec["speedups_server"])
        for (n, spec), r in rows.items():
            if spec == "none" or (n, "none") not in rows:
                continue
            off = rows[(n, "none")]
            on = r["ours"]
            dagger = " †" if on.drafted == 0 else ""
            lines.append(
                f"| {sec['prompts']} | {n} | {off['ours'].tokens_per_s:.1f} | {on.tokens_per_s:.1f}{dagger} | "
                f"{_x(ours_up[(n, spec)])} | {on.drafted} / {on.accepted} | "
                f"{off['server'].tokens_per_s:.1f} | {r['server'].tokens_per_s:.1f} | "
                f"{_x(srv_up[(n, spec)])} | {_x(r['vs_server'])} |"
            )
    return lines


def whole_run_table(sections: list[dict[str, Any]]) -> list[str]:
    """The same ratios over whole runs (every token from the first request to the last, ramp
    and tail included), with the first tokens' wait: a side that starves prompts while it
    verifies long drafts looks faster in the steady window than over the run."""
    lines = [
        "| prompts | N | ours on ÷ off | server on ÷ off | ours ÷ server, on | TTFT p50 ms on, ours / server |",
        "|---|---:|---:|---:|---:|---:|",
    ]
    for sec in sections:
        ours_up = _by_row(sec["speedups_ours_whole"])
        srv_up = _by_row(sec["speedups_server_whole"])
        for r in sec["rows"]:
            key = (r["n"], r["spec"])
            if r["spec"] == "none" or key not in ours_up or key not in srv_up:
                continue
            lines.append(
                f"| {sec['prompts']} | {r['n']} | {_x(ours_up[key])} | {_x(srv_up[key])} | "
                f"{_x(r['vs_server_whole'])} | {_ms(r['ours'].ttft, 0.5)} / {_ms(r['server'].ttft, 0.5)} |"
            )
    return lines


def plot_speculation(sections: list[dict[str, Any]], path: Path) -> None:
    """tok/s against N, speculation on and off, ours and llama-server, one panel per prompt set."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, axes = plt.subplots(1, len(sections), figsize=(6.5 * len(sections), 4.5), constrained_layout=True)
    for ax, sec in zip(axes if len(sections) > 1 else [axes], sections, strict=True):
        for who, key, style in (("ours", "ours", "-"), ("llama-server", "server", "--")):
            for spec in dict.fromkeys(r["spec"] for r in sec["rows"]):
                pts = sorted((r["n"], r[key].tokens_per_s) for r in sec["rows"] if r["spec"] == spec)
                label = f"{who}, {'speculation off' if spec == 'none' else spec}"
                ax.plot([n for n, _ in pts], [t for _, t in pts], style, marker="o", label=label)
        ax.set_xscale("log", base=2)
        ticks = sorted({r["n"] for r in sec["rows"]})
        ax.set_xticks(ticks, [str(t) for t in ticks])
        ax.set_xlabel("concurrent streams N")
        ax.set_ylabel("output tokens/s (steady state, median)")
        ax.set_title(f"{sec['prompts']} prompts")
        ax.grid(True, alpha=0.3)
        ax.legend(fontsize=8)
    fig.savefig(path, dpi=110)
    plt.close(fig)


def update_readme(table: list[str], path: Path, marker: str = "speculation-table") -> None:
    """Replace the table between the README's ``marker`` comments (nothing where it has none)."""
    text = path.read_text()
    begin, end = f"<!-- {marker}:begin -->", f"<!-- {marker}:end -->"
    if begin not in text or end not in text:
        return
    head, rest = text.split(begin, 1)
    _, tail = rest.split(end, 1)
    path.write_text(head + begin + "\n" + "\n".join(table) + "\n" + end + tail)


def _cross_check(sec: dict[str, Any]) -> str:
    """The correctness cross-check's sentence for one prompt set, as far as it was made."""
    n1, lcp = sec["agreement_n1"], sec["agreement_lcp"]
    if math.isnan(n1):
        return "Correctness cross-check: not made in this run (it needs N = 1 with speculation off)."
    return (
        "Correctness cross-check: with speculation off and one stream, our greedy tokens and "
        f"llama-server's agree on {n1:.0%} of requests (must be 100%)"
        + (
            "; llama-cpp-python did not run."
            if math.isnan(lcp)
            else f", ours and llama-cpp-python's on {lcp:.0%}."
        )
    )


def report(
    sections: list[dict[str, Any]], meta: dict[str, Any], speculation: list[str], plot: bool = True
) -> str:
    """BENCHMARKS.md; ``speculation`` is :func:`speculation_table`'s; ``plot``: the run draws
    ``benchmarks/results/speculation.png``."""
    lines = [
        "# Benchmarks: side by side",
        "",
        f"Measured {meta['date']} on {meta['machine']['cpu']} ({meta['machine']['cores']} cores, "
        f"{meta['machine']['system']}), model `{Path(meta['model']).name}`, {meta['threads']} threads, "
        f"{meta['requests']} requests per N, {meta['max_tokens']} generated tokens each "
        "(end-of-generation ignored), greedy, the same prompts sent as the same token ids to "
        "everyone, driven the same way: N closed-loop clients (`engine.bench.closed_loop`), each "
        "sending its next request when its last one ends, with a ramp so that requests end "
        "spread out rather than in lock-step waves. One process at a time on the machine; "
        f"{meta['repeats']} interleaved repeats of every row (server, ours, for each speculative "
        "type in turn), figures are medians.",
        "",
        "Throughput is generated tokens per second in the steady window (every stream busy: "
        "after the ramp, before the first client runs out of requests), all N streams together; "
        "ratios are ours ÷ the reference (> 1: we are faster). The raw ceiling is "
        "`llama-batched-bench`'s text-generation speed at batch N (the best of 3 runs): one token "
        "per sequence per decode, no sampling, no scheduling, no HTTP. llama-cpp-python answers the same requests "
        "one after another (it serves one stream, without speculation here), so its figure is the "
        "same at every N. Both llama.cpp builds are the pinned tree with our patches "
        "(`vendor/patches/`, including 0003's faster CPU attention for batches of many sequences).",
        "",
        "## Speculation",
        "",
        "Speculation on ÷ off, each the median of the paired interleaved repeats [min, max]; "
        "`drafted / accepted` are our engine's draft tokens in the median run. The same "
        "speculative settings on both sides (n-gram key and draft lengths in the commands "
        "below). llama-server drafts up to `--spec-draft-n-max` whenever its n-gram matches. "
        "Our draft policy does the same while the drafts, accepted per batch row they fill, "
        "pay at the batch size, and otherwise picks the lengths its cost model says pay, or "
        "none; with per-sequence KV streams (N > 16) it gives every sequence the same length.",
        "",
        *speculation,
        *(["", DRAFTED_NOTHING] if any(drafted_nothing(r) for sec in sections for r in sec["rows"]) else []),
        "",
        "Over whole runs (all tokens ÷ the time from the first request to the last: the ramp, "
        "the tail and every wait for a first token included), paired the same way:",
        "",
        *whole_run_table(sections),
    ]
    if plot:
        lines += [
            "",
            "![tokens/s against concurrent streams, speculation on and off, ours and llama-server]"
            "(benchmarks/results/speculation.png)",
        ]
    for sec in sections:
        title = PROMPT_SET_TITLES.get(sec["prompts"], f"Prompts from `{sec['prompts']}`")
        lines += [
            "",
            f"## {title}",
            "",
            *_table(sec["rows"]),
            *(["", DRAFTED_NOTHING] if any(drafted_nothing(r) for r in sec["rows"]) else []),
            "",
            _cross_check(sec),
        ]
    lines += [
        "",
        "At higher N the last column is the share of requests with identical tokens; llama.cpp is "
        "not batch-invariant on quantized models, so different batch shapes may flip near-ties. "
        "llama-server runs with `--swa-full` and llama-cpp-python with `flash_attn=True`: the "
        "attention layout our contexts get from `llama_context_default_params()` (with the "
        "server's smaller sliding-window cache the attention is padded differently and near-ties "
        "flip: 1 of the first 4 requests differed).",
        "",
        "## Commands",
        "",
        "Whole run:",
        "",
        f"    {meta['command']}",
        "",
        "References as run (one llama-server per N and speculative type):",
        "",
        *[f"    {c}" for c in meta["commands"]],
        "",
        "Ours: `engine.bench.run_load` (what `python -m engine bench` runs) with "
        "`EngineConfig(n_seq=N, n_ctx=...)` and the same speculative settings "
        "(`SpeculativeConfig(type, n_draft_max, ngram_size_n, ngram_size_m)`).",
        "",
    ]
    return "\n".join(lines)
