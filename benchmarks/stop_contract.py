"""The stop-state contract on a real model: after a stop, the saved state is exactly what the
caller saw.

For each prompt of a set, the greedy continuation is generated once; then requests stop at
a token of it (stop token id) or at its text (stop string), with ``checkpoint=True``, four
at a time. For every stopped request it checks that the checkpoint's sequence (history +
last token) equals prompt + the tokens handed out (+ the stop token id when one ended it),
counts the stops that fell inside accepted drafts (verified tokens rolled back), and how
often the next turn resumed from the checkpoint gives the same greedy tokens as reading the
same visible tokens from scratch (on a quantized model batch shapes may flip near-ties, so
that is reported, not required). Prints one JSON object.

    python benchmarks/stop_contract.py [--model GGUF] [--spec ngram-simple] [--prompts copy]
"""

from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path

import anyio

from engine import Engine, EngineConfig, SamplingParams, SpeculativeConfig
from engine.bench import load_prompts
from engine.scheduler.params import default_model_path
from engine.session.checkpoint import unpack


async def run(args: argparse.Namespace) -> dict[str, object]:
    model = str(args.model or default_model_path())
    spec = SpeculativeConfig(args.spec, n_draft_max=args.n_draft, ngram_size_n=3, ngram_size_m=args.n_draft)
    config = EngineConfig(model=model, speculative=spec, n_seq=4, n_ctx=1024, threads=args.threads)
    counts = {
        "stopped": 0,
        "contract_held": 0,
        "resumed_equal_cold": 0,
        "by_stop_token": 0,
        "by_stop_string": 0,
    }
    async with Engine(config) as engine:
        tm = engine.model
        cases: list[tuple[list[int], SamplingParams, int | None]] = []
        for text in load_prompts(args.prompts):
            prompt = tm.tokenize(text, add_special=True, parse_special=True)
            full = (await engine.generate(prompt, SamplingParams(max_tokens=48))).token_ids
            for j in range(3, min(len(full), 45), 6):
                cases.append((prompt, SamplingParams(max_tokens=48, stop_token_ids=(full[j],)), full[j]))
                piece = tm.token_to_piece(full[j]).decode("utf-8", "replace")
                if piece.strip() and "\ufffd" not in piece:
                    cases.append((prompt, SamplingParams(max_tokens=48, stop=(piece,)), None))
        cut_before = engine.metrics.cut_tokens

        async def check(prompt: list[int], params: SamplingParams, stop_id: int | None) -> None:
            out = await engine.generate(prompt, params, checkpoint=True)
            if out.finish_reason != "stop" or out.checkpoint is None:
                return
            counts["stopped"] += 1
            counts["by_stop_token" if stop_id is not None else "by_stop_string"] += 1
            meta = unpack(out.checkpoint).meta
            expected = [*prompt, *out.token_ids, *([stop_id] if stop_id is not None else [])]
            counts["contract_held"] += [*meta["history"], meta["last"]] == expected
            more = tm.tokenize(" Again:", add_special=False)
            resumed = await engine.generate(more, SamplingParams(max_tokens=8), resume_from=out.checkpoint)
            cold = await engine.generate([*expected, *more], SamplingParams(max_tokens=8))
            counts["resumed_equal_cold"] += resumed.token_ids == cold.token_ids

        async with anyio.create_task_group() as tg:
            limiter = anyio.CapacityLimiter(4)

            async def limited(case: tuple[list[int], SamplingParams, int | None]) -> None:
                async with limiter:
                    await check(*case)

            for case in cases:
                tg.start_soon(limited, case)
        m = engine.metrics
        return {
            "model": Path(model).name,
            "speculative": spec.type,
            "n_draft_max": spec.n_draft_max,
            "prompts": args.prompts,
            **counts,
            "tokens_rolled_back_after_stops": m.cut_tokens - cut_before,
            "drafted": m.drafted,
            "accepted": m.accepted,
        }


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--model", type=Path)
    ap.add_argument("--spec", default="ngram-simple")
    ap.add_argument("--n-draft", type=int, default=6)
    ap.add_argument("--prompts", default="copy")
    ap.add_argument("--threads", type=int)
    result = anyio.run(run, ap.parse_args())
    print(json.dumps(result))
    return 0 if result["contract_held"] == result["stopped"] else 1


if __name__ == "__main__":
    sys.exit(main())
