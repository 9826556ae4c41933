"""Scale-out on Ray Serve, measured on this machine: ``python -m engine cluster`` driven over
HTTP by the clients ``python -m engine bench --url`` runs. Writes
``benchmarks/results/scale_out.md`` and ``.json`` and puts the section into BENCHMARKS.md.

1. the multi-turn chat load (``bench --chat``: 8 conversations, 6 turns, a ~1,000-token
   system prompt) through ``prefix`` and ``pow2`` routing, 2 replicas x 1 CPU, enough slots
   per replica that no conversation's prefix is evicted; as specified (each turn sent as the
   last one ends), and with users reading each reply for up to ``--think`` seconds;
2. throughput at N streams (``bench --url``): the cluster, 2 replicas x 1 CPU and 1 x 2,
   against one ``engine serve`` with 2 threads;
3. how long ``python -m engine cluster`` takes to answer, and a replica killed under load.

Every configuration runs in fresh processes; repeats are interleaved (A, B, A, B, ...).

    pip install -e ".[cluster,bench]"
    python benchmarks/scale_out.py                  # ~40 min on 2 cores
    python benchmarks/scale_out.py --parts load     # measure one part, keep the others' figures
    python benchmarks/scale_out.py --render         # rewrite the tables from the .json only
"""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import datetime
import json
import os
import shlex
import signal
import statistics
import subprocess
import sys
import time
from collections.abc import AsyncIterator
from pathlib import Path
from typing import Any

import httpx
from side_by_side import ROOT, _free_port, write_benchmarks

from engine.bench import PROMPTS, default_requests, machine_info, run_http_conversations, run_http_load

RESULTS = ROOT / "benchmarks" / "results"
LOGS = ROOT / "build" / "scale_out"


def cluster_command(port: int, router: str, replicas: int, cpus: float, n_seq: int) -> list[str]:
    return [
        sys.executable, "-m", "engine", "cluster", "--port", str(port), "--router", router,
        "--replicas", str(replicas), "--replica-cpus", str(cpus), "--n-seq", str(n_seq), "--spec", "none",
    ]  # fmt: skip


def serve_command(port: int, threads: int, n_seq: int) -> list[str]:
    return [
        sys.executable, "-m", "engine", "serve", "--port", str(port), "--threads", str(threads),
        "--n-seq", str(n_seq), "--spec", "none",
    ]  # fmt: skip


@contextlib.asynccontextmanager
async def running(
    cmd: list[str], port: int, name: str
) -> AsyncIterator[tuple[str, float, subprocess.Popen[bytes]]]:
    """A server (fresh process): its ``/v1`` URL, the seconds it took to answer, the process."""
    LOGS.mkdir(parents=True, exist_ok=True)
    log = open(LOGS / f"{name}.log", "w")  # noqa: SIM115
    t0 = time.perf_counter()
    proc = subprocess.Popen(cmd, stdout=log, stderr=subprocess.STDOUT, start_new_session=True)
    try:
        async with httpx.AsyncClient(base_url=f"http://127.0.0.1:{port}") as client:
            while True:
                with contextlib.suppress(httpx.TransportError):
                    if (await client.get("/health")).status_code == 200:
                        break
                if proc.poll() is not None:
                    raise RuntimeError(f"{cmd} exited ({proc.returncode}); see {log.name}")
                await asyncio.sleep(0.2)
        yield f"http://127.0.0.1:{port}/v1", time.perf_counter() - t0, proc
    finally:
        os.killpg(proc.pid, signal.SIGINT)
        try:
            proc.wait(60)
        except subprocess.TimeoutExpired:
            os.killpg(proc.pid, signal.SIGKILL)
            proc.wait()
        log.close()


def later(turns: list[dict[str, Any]], key: str) -> float:
    """Over the turns after the first: the mean of ``key`` weighted by requests."""
    return statistics.fmean(t[key] for t in turns[1:])


async def chat(router: str, think: float, conversations: int, turns: int) -> dict[str, Any]:
    port = _free_port()
    async with running(cluster_command(port, router, 2, 1.0, 8), port, f"chat-{router}-{think}") as (
        url,
        up,
        _,
    ):
        stats = await run_http_conversations(url, conversations, turns, 32, think=think)
    rows = [s.as_dict() for s in stats]
    later_ttft = sorted(x for s in stats[1:] for x in s.ttft)
    return {
        "router": router,
        "think": think,
        "startup_s": round(up, 1),
        "turns": rows,
        "same_replica": sum(s.on_first_replica for s in stats[1:])
        / sum(len(s.prompt_tokens) for s in stats[1:]),
        "cached_share": sum(sum(s.cached_tokens) for s in stats[1:])
        / sum(sum(s.prompt_tokens) for s in stats[1:]),
        "ttft_p50": later_ttft[len(later_ttft) // 2],
        "ttft_p90": later_ttft[int(0.9 * len(later_ttft))],
    }


async def throughput(kind: str, n: int) -> dict[str, Any]:
    port = _free_port()
    cmd = {
        "cluster 2x1": cluster_command(port, "pow2", 2, 1.0, n),
        "cluster 1x2": cluster_command(port, "pow2", 1, 2.0, n),
        "serve x2": serve_command(port, 2, n),
    }[kind]
    async with running(cmd, port, f"load-{kind.replace(' ', '')}-{n}") as (url, up, _):
        await run_http_load(url, n, n, 4, list(PROMPTS))  # every replica and route warm
        before, t0 = cpu_seconds(), time.perf_counter()
        r = await run_http_load(url, n, default_requests(n), 48, list(PROMPTS))
        after, wall = cpu_seconds(), time.perf_counter() - t0
    cpu: dict[str, float] = {}
    for pid, (who, seconds) in after.items():
        cpu[who] = cpu.get(who, 0.0) + seconds - before.get(pid, (who, 0.0))[1]
    return {
        "kind": kind,
        "n": n,
        "startup_s": round(up, 1),
        "tokens_per_s": r.tokens_per_s,
        "ttft_p50": r.as_dict()["ttft_p50"],
        "tokens": r.tokens,
        "wall_s": wall,
        "cpu_s": {who: round(seconds, 2) for who, seconds in sorted(cpu.items()) if seconds >= 0.005},
    }


#: which part of a server a process is, by its command line (Ray names its workers' titles)
ROLES = (
    ("ServeReplica:engine:EngineReplica", "replicas"),
    ("OpenAIIngress", "ingress"),
    ("ProxyActor", "HTTP proxy"),
    ("ServeController", "Serve controller"),
    ("engine serve", "engine serve"),
    ("engine cluster", "cluster driver"),
    ("ray", "Ray (GCS, raylet, monitors)"),
)


def cpu_seconds() -> dict[int, tuple[str, float]]:
    """Every process's CPU time so far (user + system), with its role: ``{pid: (role, s)}``;
    this process is ``client``."""
    tick = os.sysconf("SC_CLK_TCK")
    out: dict[int, tuple[str, float]] = {}
    for entry in Path("/proc").iterdir():
        if not entry.name.isdigit():
            continue
        with contextlib.suppress(OSError, ValueError, IndexError):
            cmdline = (entry / "cmdline").read_bytes().replace(b"\0", b" ").decode(errors="replace")
            fields = (entry / "stat").read_text().rsplit(")", 1)[1].split()
            seconds = (int(fields[11]) + int(fields[12])) / tick
            pid = int(entry.name)
            role = (
                "client" if pid == os.getpid() else next((r for key, r in ROLES if key in cmdline), "other")
            )
            out[pid] = (role, seconds)
    return out


async def kill_under_load(n: int) -> dict[str, Any]:
    """N streams over 2 replicas; one replica's process killed: how the streams end."""
    port = _free_port()
    async with running(cluster_command(port, "pow2", 2, 1.0, n), port, "kill") as (url, _, _proc):
        base = url.removesuffix("/v1")
        ends: dict[int, dict[str, Any]] = {}
        body = {"model": "SmolLM2-135M-Instruct.Q4_1", "max_tokens": 600, "ignore_eos": True, "stream": True}
        started = asyncio.Event()

        async def stream(i: int, http: httpx.AsyncClient) -> None:
            async with http.stream("POST", "/v1/completions", json={**body, "prompt": f"Story {i}:"}) as r:
                end = {"replica": r.headers["x-engine-replica"], "end": "cut", "at": None}
                ends[i] = end
                async for line in r.aiter_lines():
                    if line.startswith("data: {"):
                        event = json.loads(line[6:])
                        if len(ends) == n:
                            started.set()
                        if "error" in event:
                            end["end"] = "error"
                        elif event["choices"] and event["choices"][0]["finish_reason"]:
                            end["end"] = event["choices"][0]["finish_reason"]
                end["at"] = time.perf_counter()

        async with httpx.AsyncClient(base_url=base, timeout=300) as http:
            tasks = [asyncio.create_task(stream(i, http)) for i in range(n)]
            await asyncio.wait_for(started.wait(), 120)
            victim = sorted({e["replica"] for e in ends.values()})[0]
            pid = _replica_pid(victim)
            killed = time.perf_counter()
            os.kill(pid, signal.SIGKILL)
            await asyncio.gather(*tasks)
            replaced = None
            for _ in range(600):  # until a new replica serves
                r = await http.post(
                    "/v1/completions", json={**body, "stream": False, "max_tokens": 1, "prompt": "x"}
                )
                if r.status_code == 200 and r.headers["x-engine-replica"] not in {
                    e["replica"] for e in ends.values()
                }:
                    replaced = time.perf_counter() - killed
                    break
                await asyncio.sleep(0.2)
    victims = [e for e in ends.values() if e["replica"] == victim]
    others = [e for e in ends.values() if e["replica"] != victim]
    return {
        "streams": n,
        "killed_replica_streams": len(victims),
        "their_ends": sorted({e["end"] for e in victims}),
        "answered_within_s": round(max(e["at"] - killed for e in victims), 2) if victims else None,
        "other_streams": len(others),
        "other_failures": sum(e["end"] != "length" for e in others),
        "replaced_within_s": round(replaced, 1) if replaced is not None else None,
    }


def _replica_pid(replica: str) -> int:
    """The process of a replica, from Ray's process list (``ps``: its title names it)."""
    out = subprocess.run(["ps", "-eo", "pid,args"], capture_output=True, text=True, check=True).stdout
    for line in out.splitlines():
        if "ServeReplica:engine:EngineReplica" in line and "ray::" in line:
            pid = int(line.split()[0])
            # the replica id is in its environment's log file names; ask the process
            with contextlib.suppress(OSError):
                if replica in Path(f"/proc/{pid}/cmdline").read_text() or _holds(pid, replica):
                    return pid
    raise RuntimeError(f"no process for replica {replica}")


def _holds(pid: int, replica: str) -> bool:
    with contextlib.suppress(OSError):
        for fd in os.listdir(f"/proc/{pid}/fd"):
            with contextlib.suppress(OSError):
                if replica in os.readlink(f"/proc/{pid}/fd/{fd}"):
                    return True
    return False


def _fmt(x: float, spec: str = ".2f") -> str:
    return format(x, spec)


async def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--repeats", type=int, default=2)
    ap.add_argument("--think", type=float, default=3.0, help="seconds a user may read a reply (default 3)")
    ap.add_argument("--streams", type=int, default=16)
    ap.add_argument("--out", default=str(RESULTS / "scale_out.md"))
    ap.add_argument(
        "--parts", default="chat,load,kill", help="what to measure; the others keep the last run's figures"
    )
    ap.add_argument("--render", action="store_true", help="only rewrite the tables from the last run's .json")
    args = ap.parse_args()
    parts = [] if args.render else args.parts.split(",")
    chats: list[dict[str, Any]] = []
    loads: list[dict[str, Any]] = []
    kill: dict[str, Any] | None = None
    for rep in range(args.repeats if parts else 0):
        if "chat" in parts:
            for think in (0.0, args.think):
                for router in ("prefix", "pow2"):
                    print(f"chat {router} think {think} repeat {rep + 1}", flush=True)
                    chats.append(await chat(router, think, 8, 6))
                    c = chats[-1]
                    print(
                        f"   same replica {c['same_replica']:.0%} cached {c['cached_share']:.1%} "
                        f"TTFT p50 {c['ttft_p50']:.3f} p90 {c['ttft_p90']:.3f} (up in {c['startup_s']} s)",
                        flush=True,
                    )
        if "load" in parts:
            for kind in ("cluster 2x1", "serve x2", "cluster 1x2"):
                print(f"load {kind} N={args.streams} repeat {rep + 1}", flush=True)
                loads.append(await throughput(kind, args.streams))
                print(f"   {loads[-1]['tokens_per_s']:.1f} tok/s", flush=True)
    if "kill" in parts:
        print("kill under load", flush=True)
        kill = await kill_under_load(8)
        print(f"   {kill}", flush=True)
    # each part keeps when and how it was measured; parts not measured now keep the last run's
    previous = Path(args.out).with_suffix(".json")
    report: dict[str, Any] = json.loads(previous.read_text()) if previous.exists() else {}
    stamp = {
        "machine": machine_info(),
        "date": datetime.datetime.now(datetime.UTC).strftime("%Y-%m-%d %H:%M UTC"),
        "repeats": args.repeats,
        "command": "python benchmarks/scale_out.py " + shlex.join(sys.argv[1:]),
    }
    for part, runs in (("chat", chats), ("load", loads), ("kill", kill)):
        if part in parts:
            report[part] = {**stamp, "streams": args.streams, "runs": runs}
    previous.write_text(json.dumps(report, indent=2))
    write(Path(args.out), report)
    return 0


def _measured(part: dict[str, Any], repeats: bool = True) -> str:
    times = f", {part['repeats']} interleaved repeats" if repeats else ""
    machine = part["machine"]
    return (
        f"measured on {machine['cpu']} ({machine['cores']} cores) {part['date']}{times}: `{part['command']}`"
    )


def write(out: Path, report: dict[str, Any]) -> None:
    md = [
        "## Scale-out",
        "",
        "SmolLM2-135M-Instruct (the default chat model), no speculation, `python -m engine cluster` on a "
        "local Ray cluster (Ray Serve 2.60.0), every configuration in fresh processes.",
        "",
    ]
    if report.get("chat"):
        md += _chat_part(report["chat"])
    if report.get("load"):
        md += _load_part(report["load"])
    if report.get("kill"):
        kill = report["kill"]["runs"]
        md += [
            f"**A replica killed under load** ({kill['streams']} streams of 600 tokens over 2 replicas, one replica's "
            f"process sent SIGKILL; {_measured(report['kill'], repeats=False)}): its "
            f"{kill['killed_replica_streams']} streams ended with {', '.join(kill['their_ends'])} within "
            f"{kill['answered_within_s']} s; the other replica's {kill['other_streams']} streams finished with "
            f"{kill['other_failures']} failures; a new replica served {kill['replaced_within_s']} s after the kill.",
            "",
        ]
    out.write_text("\n".join(md))
    print("\n".join(md))
    if out.resolve() == (RESULTS / "scale_out.md").resolve():
        write_benchmarks()


def _chat_part(part: dict[str, Any]) -> list[str]:
    chats = part["runs"]
    md = [
        "**Chat load** (`python -m engine bench --chat --url ...`: 8 conversations of 6 turns, each turn the "
        "whole conversation after a ~1,000-token system prompt, 32 tokens a reply; 2 replicas x 1 CPU, 8 "
        "slots each; " + _measured(part) + "). Later turns: the share served by their conversation's first "
        "replica, the share of their prompt tokens found cached, client TTFT; medians over the repeats:",
        "",
        "| users read replies for | router | later turns on their replica | cached prompt tokens | TTFT p50 s | TTFT p90 s |",
        "|---|---|---:|---:|---:|---:|",
    ]
    med: dict[tuple[float, str], dict[str, float]] = {}
    for think in sorted({c["think"] for c in chats}):
        for router in ("prefix", "pow2"):
            rs = [c for c in chats if c["router"] == router and c["think"] == think]
            if not rs:
                continue
            m = med[think, router] = {
                k: statistics.median(c[k] for c in rs)
                for k in ("same_replica", "cached_share", "ttft_p50", "ttft_p90")
            }
            when = "0 s (each turn as the last ends)" if think == 0 else f"0-{think:g} s"
            md.append(
                f"| {when} | {router} | {m['same_replica']:.0%} | {m['cached_share']:.1%} | "
                f"{m['ttft_p50']:.3f} | {m['ttft_p90']:.3f} |"
            )
    ups = [c["startup_s"] for c in chats]
    md += [
        "",
        f"`python -m engine cluster` (2 replicas) answered `/health` (both engine replicas running) "
        f"{min(ups):.1f}-{max(ups):.1f} s after it started.",
        "",
    ]
    thinks = sorted({think for think, _ in med})
    if len(thinks) == 2 and all((t, r) in med for t in thinks for r in ("prefix", "pow2")):
        lock, read = thinks
        a, b = med[read, "prefix"], med[read, "pow2"]
        md += [
            f"Prefix routing wins at the tail, not at the median: with reading times, TTFT p90 "
            f"{b['ttft_p90'] / a['ttft_p90']:.1f}x better than pow2, p50 {b['ttft_p50'] / a['ttft_p50']:.2f}x. "
            "Pow2 sends a request to the less busy of two replicas (with 2 replicas: of both). In the lock-step "
            "run a conversation's replica is the less busy one the moment its turn ends (its own request just "
            f"left), so pow2 kept {med[lock, 'pow2']['same_replica']:.0%} of later turns home there too, an "
            "accident of that load. With reading times the loads differ when a turn arrives and pow2 moved "
            f"{1 - b['same_replica']:.0%} of later turns; a moved turn still finds the shared ~1,000-token "
            f"system prompt cached on the other replica (pow2's cached share {b['cached_share']:.0%}) and "
            "recomputes the conversation after it while that replica's other turns wait: that is the p90. "
            "The median later turn is a cache hit under both routers, so a 3x gain at p50 needs most of "
            "pow2's turns to move: many replicas (pow2 keeps about 1 in R home by chance once loads are "
            "even) or conversations with no shared prefix.",
            "",
        ]
    return md


#: the processes a cluster adds beside its replicas
RAY_ROLES = ("ingress", "HTTP proxy", "Serve controller", "cluster driver", "Ray (GCS, raylet, monitors)")


def _load_part(part: dict[str, Any]) -> list[str]:
    loads = part["runs"]
    md = [
        f"**Throughput** at {part['streams']} streams (`python -m engine bench --url ... --streams "
        f"{part['streams']}`, 48-token streamed completions, mixed prompts; {_measured(part)}), medians [min, max]:",
        "",
        "| server | tok/s | ÷ engine serve x2 | TTFT p50 s |",
        "|---|---:|---:|---:|",
    ]
    kinds = [k for k in ("serve x2", "cluster 2x1", "cluster 1x2") if any(x["kind"] == k for x in loads)]
    base = [x["tokens_per_s"] for x in loads if x["kind"] == "serve x2"]
    tps = {k: statistics.median(x["tokens_per_s"] for x in loads if x["kind"] == k) for k in kinds}
    for kind in kinds:
        xs = [x for x in loads if x["kind"] == kind]
        ratios = sorted(x["tokens_per_s"] / b for x, b in zip(xs, base, strict=False))
        md.append(
            f"| {kind} | {tps[kind]:.1f} | **{statistics.median(ratios):.2f}** [{ratios[0]:.2f}, {ratios[-1]:.2f}] | "
            f"{statistics.median(x['ttft_p50'] for x in xs):.3f} |"
        )
    md += [
        "",
        "serve x2: one `engine serve --threads 2`; cluster 2x1: 2 replicas of 1 CPU (1 engine thread) each; "
        "cluster 1x2: 1 replica of 2 CPUs; every server 16 slots in all.",
        "",
    ]
    cpu = [x for x in loads if x.get("cpu_s")]
    if not cpu:
        return md

    def per_1000(kind: str, roles: tuple[str, ...] | str) -> float:
        roles = (roles,) if isinstance(roles, str) else roles
        xs = [x for x in cpu if x["kind"] == kind]
        return statistics.median(1000 * sum(x["cpu_s"].get(r, 0.0) for r in roles) / x["tokens"] for x in xs)

    roles = sorted({r for x in cpu for r in x["cpu_s"]}, key=lambda r: -max(per_1000(k, r) for k in kinds))
    md += [
        "Where the CPU went during those runs: CPU seconds per 1,000 generated tokens, every process on the "
        "machine by role (`client`: the load generator), medians:",
        "",
        "| process | " + " | ".join(kinds) + " |",
        "|---|" + "---:|" * len(kinds),
    ]
    for role in roles:
        md.append(f"| {role} | " + " | ".join(f"{per_1000(k, role):.2f}" for k in kinds) + " |")
    md.append("")
    if "cluster 2x1" in kinds and "serve x2" in kinds:
        extra = per_1000("cluster 2x1", RAY_ROLES)
        ingress = per_1000("cluster 2x1", "ingress")
        proxy = per_1000("cluster 2x1", "HTTP proxy")
        engine_s = per_1000("serve x2", "engine serve")
        replicas = per_1000("cluster 2x1", "replicas")
        per_replica = tps["cluster 2x1"] / 2
        ceiling = 1000 / max(ingress, proxy)
        md += [
            f"The rest goes to Ray's processes: beside its replicas the cluster spends {extra:.2f} CPU s per 1,000 "
            f"tokens (ingress {ingress:.2f}, HTTP proxy {proxy:.2f}) on the 2 cores the engines need. Its two "
            f"1-thread replicas spend {replicas:.2f} where one 2-thread `engine serve` spends {engine_s:.2f}: they "
            "leave the HTTP work to the ingress and proxy, and a 1-thread engine never waits at the barrier "
            "that joins a 2-thread engine's threads after every op (ggml's threads spin there). That saving "
            f"pays for most of Ray's share, so 2x1 keeps pace with `engine serve`. 1x2 runs the same Ray "
            "processes beside one 2-thread engine and loses a quarter; the likely cause (not isolated by a "
            "profile): whenever the ingress or proxy takes a core, one engine thread stops and the other spins "
            "at the next barrier, so every op waits for Ray's work.",
            "",
            "What R machines would give (from these figures, not measured): each machine runs one replica with "
            "all its cores, so the cluster decodes about R times one machine's `engine serve` rate "
            f"(here {tps['serve x2']:.0f} tok/s on 2 cores; {per_replica:.0f} tok/s per 1-CPU replica) less Ray's "
            "share of each machine. Every token also passes one ingress replica and the HTTP proxy of the node "
            f"the client reached, each one Python process: at {ingress:.2f} and {proxy:.2f} CPU s per 1,000 "
            f"tokens, one ingress saturates near {1000 / ingress:.0f} tok/s and one proxy near {1000 / proxy:.0f} "
            f"tok/s, so a single ingress stops scaling at about {ceiling / tps['serve x2']:.0f} machines like this "
            "one. Past that the ingress needs replicas of its own (`num_replicas` on `OpenAIIngress`, clients "
            "spread over every node's proxy), and then the router state splits: each ingress replica's prefix "
            "index sees only the requests it routed, so a conversation whose turns reach different ingress "
            "replicas loses its affinity; `--router session` (a consistent hash of `x-session-id`, the same on "
            "every ingress) keeps it without shared state.",
            "",
        ]
    return md


if __name__ == "__main__":
    sys.exit(asyncio.run(main()))
