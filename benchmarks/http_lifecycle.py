"""Disconnect and shutdown figures of ``python -m engine serve`` (Gemma 3 270M, 8 slots): how
soon the slots are free after 8 streaming clients leave mid-stream, and how SIGTERM ends 8
streams in flight (``--shutdown-timeout 3``).

    python benchmarks/http_lifecycle.py
"""

from __future__ import annotations

import asyncio
import json
import signal
import subprocess
import sys
import time

import httpx
from side_by_side import _free_port

from engine.scheduler.params import default_model_path

GRACE_S = 3.0
STREAMS = 8


def _sample(metrics: str, name: str) -> list[str]:
    return [line for line in metrics.splitlines() if line.startswith(name)]


async def main() -> int:
    model = default_model_path()
    port = _free_port()
    cmd = [
        sys.executable,
        "-m",
        "engine",
        "serve",
        "--model",
        str(model),
        "--port",
        str(port),
        "--spec",
        "none",
    ]
    cmd += ["--n-seq", str(STREAMS), "--n-ctx", "2048", "--shutdown-timeout", str(GRACE_S)]
    proc = subprocess.Popen(cmd, stderr=subprocess.PIPE)
    body = {
        "model": model.stem,
        "prompt": "Once upon a time",
        "max_tokens": 1500,
        "ignore_eos": True,
        "stream": True,
    }
    limits = httpx.Limits(max_keepalive_connections=0)
    async with httpx.AsyncClient(base_url=f"http://127.0.0.1:{port}", timeout=60, limits=limits) as http:
        while True:
            try:
                if (await http.get("/health")).status_code == 200:
                    break
            except httpx.TransportError:
                pass
            await asyncio.sleep(0.1)

        async def leave_after_10_chunks() -> None:
            async with http.stream("POST", "/v1/completions", json=body) as r:
                n = 0
                async for line in r.aiter_lines():
                    n += line.startswith("data: {")
                    if n == 10:
                        return

        await asyncio.gather(*(leave_after_10_chunks() for _ in range(STREAMS)))
        t0 = time.perf_counter()
        while True:
            metrics = (await http.get("/metrics")).text
            running = _sample(metrics, "engine:num_requests_running")
            if running and float(running[0].split()[-1]) == 0:
                break
            await asyncio.sleep(0.005)
        print(
            f"disconnect: {STREAMS} slots free {1000 * (time.perf_counter() - t0):.0f} ms after the last client left"
        )
        print("  " + " ".join(_sample(metrics, "engine:request_success_total")))

        ends: list[tuple[str | None, float]] = []
        started = 0
        all_started = asyncio.Event()

        async def stream() -> None:
            nonlocal started
            reason, first = None, True
            async with http.stream("POST", "/v1/completions", json=body) as r:
                async for line in r.aiter_lines():
                    if line.startswith("data: {"):
                        if first:
                            first, started = False, started + 1
                            if started == STREAMS:
                                all_started.set()
                        reason = json.loads(line[6:])["choices"][0]["finish_reason"] or reason
                    elif line == "data: [DONE]":
                        ends.append((reason, time.perf_counter()))

        tasks = [asyncio.create_task(stream()) for _ in range(STREAMS)]
        await all_started.wait()
        t_term = time.perf_counter()
        proc.send_signal(signal.SIGTERM)
        await asyncio.gather(*tasks, return_exceptions=True)
        status = proc.wait(30)
        exited = time.perf_counter() - t_term
    last = max((t for _, t in ends), default=t_term) - t_term
    print(
        f"SIGTERM with {STREAMS} streams in flight (shutdown timeout {GRACE_S:g} s): {len(ends)} ended with [DONE], "
        f"finish reasons {sorted({str(r) for r, _ in ends})}, the last {last:.2f} s after SIGTERM; "
        f"the process exited after {exited:.2f} s with status {status}"
    )
    assert proc.stderr is not None
    print("  stderr: " + proc.stderr.read().decode().strip().replace("\n", " | "))
    return 0


if __name__ == "__main__":
    sys.exit(asyncio.run(main()))
