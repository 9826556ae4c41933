"""Runs in the llama-cpp-python virtual environment (not ours): answers the benchmark's
requests one after another, greedy, as a Python user of llama-cpp-python would.

stdin: {"model", "prompts": [[token ids]], "max_tokens", "threads", "n_ctx"}
stdout: {"version", "seconds", "requests": [{"tokens", "ttft", "itl", "e2e"}]}
"""

import json
import sys
import time

import llama_cpp


def main() -> None:
    job = json.load(sys.stdin)
    llm = llama_cpp.Llama(
        model_path=job["model"],
        n_ctx=job["n_ctx"],
        n_batch=512,
        n_threads=job["threads"],
        n_threads_batch=job["threads"],
        flash_attn=True,  # its default is off; ours and llama-server resolve "auto" to on (CPU)
        verbose=False,
    )
    # warm-up, not measured
    for _, _ in zip(range(4), llm.generate(job["prompts"][0], temp=0.0, top_k=1, reset=True), strict=False):
        pass
    out = []
    start = time.perf_counter()
    for prompt in job["prompts"]:
        llm.reset()
        t0 = last = time.perf_counter()
        tokens: list[int] = []
        ttft = None
        itl = []
        # generate() is the raw loop: it does not stop at end-of-generation (ignore_eos)
        for tok in llm.generate(prompt, temp=0.0, top_k=1, reset=True):
            now = time.perf_counter()
            if ttft is None:
                ttft = now - t0
            else:
                itl.append(now - last)
            last = now
            tokens.append(int(tok))
            if len(tokens) == job["max_tokens"]:
                break
        out.append({"tokens": tokens, "ttft": ttft, "itl": itl, "e2e": time.perf_counter() - t0})
    json.dump(
        {"version": llama_cpp.__version__, "seconds": time.perf_counter() - start, "requests": out},
        sys.stdout,
    )


if __name__ == "__main__":
    main()
