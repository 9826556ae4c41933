"""Speculation on ÷ off on every prompt set, the held-out one first: BENCHMARKS.md "Prompts
nobody tuned for".

    python benchmarks/prompt_sets.py                       # every set (about 1 h on 2 cores)
    python benchmarks/prompt_sets.py --sets heldout --repeats 5
    python benchmarks/prompt_sets.py --render              # the table from the runs kept

Each set and N is one ``python -m engine bench --interleave`` run (speculation off and on,
one engine each kept open across the interleaved repeats, so that each pair of runs is
close in time; its JSON is kept in ``benchmarks/results/prompt_sets/<set>/n<N>/``). From 16 streams
on a run sends 6N requests (``--long-requests``), not 4N: with 4N its steady window was a few
seconds and the paired ratios spread over 0.2. The ``heldout`` set
(``engine.workloads.HELDOUT_PROMPTS``) is kept out of all tuning of the draft policy: change
the policy looking at the other sets only, then run this one.
"""

from __future__ import annotations

import argparse
import json
import statistics
import subprocess
import sys

from side_by_side import ROOT, write_benchmarks

RESULTS = ROOT / "benchmarks" / "results"
RUNS = RESULTS / "prompt_sets"
SETS = ["heldout", "copy", "code", "edits", "summaries", "chat", "formats", "mixed"]
ABOUT = {
    "heldout": "held out of all tuning: answers that quote a passage, text rewritten with small changes",
    "copy": "answers that repeat the prompt",
    "code": "code completions and edits",
    "edits": "prose and data to correct or repeat with changes",
    "summaries": "summaries that reuse the prompt's phrases",
    "chat": "questions whose answers copy little",
    "formats": "records turned from one format into another (the 16-stream loss was diagnosed on it)",
    "mixed": "questions, lists, code, stories",
}


LONG_FROM = 16  #: streams from which a run sends --long-requests per stream


def measure(name: str, n: int, args: argparse.Namespace) -> None:
    out = (RUNS / name / f"n{n}").relative_to(ROOT)  # (relative: the command is kept in its JSON)
    cmd = [
        sys.executable, "-m", "engine", "bench", "--prompts", name, "--streams", str(n),
        "--spec", f"none,{args.spec}", "--repeats", str(args.repeats), "--max-tokens", str(args.max_tokens),
        "--out", str(out),
    ]  # fmt: skip
    if n >= LONG_FROM:
        cmd += ["--requests", str(args.long_requests * n)]
    if not args.fresh_engines:
        cmd += ["--interleave"]
    print("$", " ".join(cmd[1:]), flush=True)
    subprocess.run(cmd, check=True, cwd=ROOT)


def rows(name: str, reports: list[dict]) -> list[str]:
    """One table row per N, from the newest run of that N: the paired repeats (off, on, off,
    on, ... as the bench ran them)."""
    by_n: dict[int, dict[str, list[dict]]] = {}
    for report in sorted(reports, key=lambda r: r["date"], reverse=True):
        ns = {r["n_streams"] for r in report["results"]} - set(by_n)
        for r in report["results"]:
            if r["n_streams"] in ns:
                by_n.setdefault(r["n_streams"], {}).setdefault(r["speculative"], []).append(r)
    out = []
    for n, runs in sorted(by_n.items()):
        off_runs = runs["none"]
        on_runs = next(v for k, v in runs.items() if k != "none")
        ratios = sorted(b["tokens_per_s"] / a["tokens_per_s"] for a, b in zip(off_runs, on_runs, strict=True))
        median_run = sorted(on_runs, key=lambda r: r["tokens_per_s"])[len(on_runs) // 2]
        off = statistics.median(r["tokens_per_s"] for r in off_runs)
        acc = median_run["accepted"] / median_run["drafted"] if median_run["drafted"] else 0.0
        mark = " †" if median_run["drafted"] == 0 else ""
        out.append(
            f"| {name} | {n} | {off:.1f} | {statistics.median(r['tokens_per_s'] for r in on_runs):.1f}{mark} "
            f"| **{statistics.median(ratios):.2f}** [{ratios[0]:.2f}, {ratios[-1]:.2f}] | {len(ratios)} "
            f"| {median_run['drafted']} / {median_run['accepted']} ({acc:.0%}) |"
        )
    return out


def render() -> str:
    reports: dict[str, list[dict]] = {}  # by set: a run of every N (before), or of one N
    for path in [*RUNS.glob("*/bench.json"), *RUNS.glob("*/n*/bench.json")]:
        name = (path.parent if path.parent.parent == RUNS else path.parent.parent).name
        reports.setdefault(name, []).append(json.loads(path.read_text()))
    order = [s for s in SETS if s in reports] + sorted(set(reports) - set(SETS))
    if not order:
        raise SystemExit(f"no runs under {RUNS.relative_to(ROOT)}: measure first")
    first = reports[order[0]][0]
    machines = sorted({_machine(r) for runs in reports.values() for r in runs})
    lines = [
        "## Prompts nobody tuned for",
        "",
        f"`python benchmarks/prompt_sets.py` ({first['model']}, {' or '.join(machines)} (each run "
        "below names its machine; a row's repeats all ran on one), "
        f"{first['settings']['max_tokens']} greedy tokens a request, 4N requests (at least 8) per N, "
        f"from {LONG_FROM} streams on the number given in the row's command, "
        "end-of-generation ignored): speculation on (`--spec` below, the engine's defaults: "
        "16-token drafts, 4-token n-gram keys) ÷ off, each run's steady-state tok/s; the ratio is "
        "the median [min, max] of the paired interleaved repeats, `drafted / accepted` the median "
        "on-run's. The first set was kept out of all tuning of the draft policy. Rows of different "
        'dates ran different versions of the policy (BENCHMARKS.md, "Speculation: notes on the runs"). Runs from '
        "2026-12-04 on alternate which side goes first (off, on, on, off, ...); earlier ones ran "
        "off first in every repeat, which favours off while the machine slows down over a run "
        "(the held-out 16-stream row was 0.92x [0.88, 0.99] that way on 2026-12-03, 0.99x "
        "[0.98, 1.02] alternating). Runs with `--interleave` in their command (from 2026-12-07) "
        "keep one engine per side, each in a process of its own, across the repeats: a pair of "
        "runs is close in time, and no run pays for an engine's start; an engine's first "
        "repeat is its first load, where the draft policy still learns.",
        "",
        "| prompts | N | off tok/s | on tok/s | on ÷ off | repeats | drafted / accepted |",
        "|---|---:|---:|---:|---:|---:|---:|",
    ]
    for name in order:
        lines += rows(name, reports[name])
    lines += ["", "† drafted nothing in the median run: the row measures what speculation on costs.", ""]
    for name in order:
        lines.append(f"- `{name}`: {ABOUT.get(name, 'a prompt file')}:")
        lines += [
            f"  - ran {r['date']} on {_machine(r)}: `{r['command']}`"
            for r in sorted(reports[name], key=lambda r: r["date"])
        ]
    return "\n".join(lines) + "\n"


def _machine(report: dict) -> str:
    machine = report["machine"]
    if isinstance(machine, dict):
        return f"{machine.get('cpu', '?')}, {machine.get('cores', '?')} cores"
    return str(machine)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--sets", default=",".join(SETS))
    ap.add_argument("--streams", default="1,4,16")
    ap.add_argument("--spec", default="ngram-simple")
    ap.add_argument("--repeats", type=int, default=5)
    ap.add_argument("--max-tokens", type=int, default=64)
    ap.add_argument(
        "--long-requests", type=int, default=6, help=f"requests per stream from {LONG_FROM} streams"
    )
    ap.add_argument(
        "--fresh-engines",
        action="store_true",
        help="a fresh engine for every run (before 2026-12-07), not one per side kept across the repeats",
    )
    ap.add_argument("--render", action="store_true", help="only write the table from the runs kept")
    args = ap.parse_args()
    if not args.render:
        for name in args.sets.split(","):
            for n in [int(x) for x in args.streams.split(",")]:
                measure(name, n, args)
    (RESULTS / "prompt_sets.md").write_text(render())
    write_benchmarks()


if __name__ == "__main__":
    main()
