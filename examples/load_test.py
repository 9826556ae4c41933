"""A load test: ``python examples/load_test.py`` (the same as ``python -m engine bench``).

N concurrent streams for each N in ``--streams``, speculation on and off, against llama.cpp's
raw batched decode; writes bench-results/bench.json and bench-results/bench.png. Try
``--prompts copy`` (copy-heavy prompts, where n-gram drafting shines) or ``--duration 30``.
The measuring loop is ``engine.bench.run_load``.
"""

import sys

from engine.cli import main

if __name__ == "__main__":
    sys.exit(main(["bench", *sys.argv[1:]]))
