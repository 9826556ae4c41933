"""The benchmarks' prompt sets: mixed, copy-heavy and shared-prefix prompts (and prompt
files), for ``python -m engine bench`` and the scripts in ``benchmarks/``."""

from __future__ import annotations

import json
import random
from collections.abc import Sequence
from pathlib import Path
from typing import TypeVar

__all__ = [
    "COPY_PROMPTS",
    "PROMPTS",
    "PROMPT_SETS",
    "SHARED_PROMPTS",
    "SHARED_SYSTEM",
    "TOPICS",
    "load_prompts",
    "prompt_of",
]

_T = TypeVar("_T")

#: a mixed set; the code-like prompts repeat themselves, which is where n-gram drafting helps
PROMPTS = [
    "Write a Python function that prints the numbers from 1 to 20, one per line.",
    "List the days of the week, then list them again in reverse order.",
    "Explain in three sentences why the sky is blue.",
    "def fibonacci(n):\n    if n < 2:\n        return n\n    return fibonacci(n - 1) + fibonacci(n - 2)\n\n"
    "# Now the same function with a loop:\n",
    "Translate to French: The cat sits on the mat. The dog sits on the mat. The bird sits on",
    "Once upon a time, in a small village by the sea,",
    "Count from one to thirty in words: one, two, three,",
    "Here is a JSON list of five fruits with their colors:\n[",
]

_CODE = [
    "def merge(a, b):\n    out = []\n    i = j = 0\n    while i < len(a) and j < len(b):\n"
    "        if a[i] <= b[j]:\n            out.append(a[i])\n            i += 1\n        else:\n"
    "            out.append(b[j])\n            j += 1\n    out.extend(a[i:])\n    out.extend(b[j:])\n"
    "    return out\n",
    "class Stack:\n    def __init__(self):\n        self.items = []\n\n    def push(self, item):\n"
    "        self.items.append(item)\n\n    def pop(self):\n        return self.items.pop()\n\n"
    "    def peek(self):\n        return self.items[-1]\n\n    def __len__(self):\n"
    "        return len(self.items)\n",
    "SELECT customers.name, orders.total\nFROM customers\nJOIN orders ON orders.customer_id = customers.id\n"
    "WHERE orders.total > 100\nORDER BY orders.total DESC\nLIMIT 10;\n",
    '<ul>\n  <li><a href="/home">Home</a></li>\n  <li><a href="/about">About</a></li>\n'
    '  <li><a href="/blog">Blog</a></li>\n  <li><a href="/contact">Contact</a></li>\n</ul>\n',
]

#: copy-heavy: the answer repeats text from the prompt, where n-gram drafting shines
COPY_PROMPTS = [
    f"Here is some code:\n\n{code}\nHere is the same code again, unchanged:\n\n{code.split(chr(10))[0]}\n"
    for code in _CODE
] + [
    "The quick brown fox jumps over the lazy dog. The quick brown fox jumps over the lazy dog. "
    "The quick brown fox",
    "Repeat after me: one apple, two pears, three plums, four figs. "
    "Again: one apple, two pears, three plums,",
]

TOPICS = [
    "returns", "shipping", "warranty", "billing", "privacy", "accounts", "gift cards", "repairs",
    "subscriptions", "discounts", "international orders", "damaged items", "store hours", "recycling",
    "accessibility", "loyalty points",
]  # fmt: skip
_CLAUSES = [
    "must be answered politely and in plain language",
    "applies to every order placed online or in a store",
    "is reviewed by a supervisor when the customer asks for it",
    "never requires the customer to share a password",
    "is explained with one concrete example when it is unclear",
]

#: a ~1,000-token system prompt (a support agent's rule book) that many requests share
SHARED_SYSTEM = "You are the support assistant of Northwind Stores. Follow these rules.\n" + "".join(
    f"Rule {i + 1}: every question about {TOPICS[i % len(TOPICS)]} {_CLAUSES[i % len(_CLAUSES)]}.\n"
    for i in range(48)
)

_SITUATIONS = [
    "today", "for a large order", "as a new customer", "after moving abroad", "for a gift", "on a holiday",
    "for my business", "with a coupon", "for a second time", "before a trip", "for my parents", "in a hurry",
]  # fmt: skip

#: shared prefix: the system prompt, then one of 192 short distinct questions
SHARED_PROMPTS = [
    f"{SHARED_SYSTEM}\nCustomer question {i + 1}: what should I know about {TOPICS[i % len(TOPICS)]} "
    f"{_SITUATIONS[i // len(TOPICS)]}?\nAnswer:"
    for i in range(len(TOPICS) * len(_SITUATIONS))
]

PROMPT_SETS = {"mixed": PROMPTS, "copy": COPY_PROMPTS, "shared": SHARED_PROMPTS}


def load_prompts(name_or_path: str) -> list[str]:
    """A built-in prompt set (``mixed``, ``copy``) or a file: one prompt per line, or JSON
    lines with a ``"prompt"`` field (``.jsonl``)."""
    if name_or_path in PROMPT_SETS:
        return PROMPT_SETS[name_or_path]
    path = Path(name_or_path)
    try:
        lines = [line for line in path.read_text().splitlines() if line.strip()]
        prompts = [str(json.loads(line)["prompt"]) for line in lines] if path.suffix == ".jsonl" else lines
    except (OSError, ValueError, KeyError, TypeError) as exc:
        raise ValueError(
            f"prompts: {name_or_path!r} is not a prompt set ({', '.join(PROMPT_SETS)}) "
            f"or a readable prompt file ({exc})"
        ) from None
    if not prompts:
        raise ValueError(f"prompts: {name_or_path} holds no prompts")
    return prompts


def prompt_of(prompts: Sequence[_T], i: int) -> _T:
    """The prompt of a load's request ``i``: every prompt once per round of
    ``len(prompts)`` requests, in an order shuffled afresh each round (seeded: every run
    and every server sees the same sequence).

    Not ``prompts[i % len(prompts)]``: closed-loop clients in steady state send request
    ``i + N`` into the slot that request ``i`` just freed, so with N a multiple of the set's
    size every request would find its whole prompt still cached there — until speculation
    reorders which request ends when, and a comparison of speculation on against off
    measures the prefix cache's luck instead."""
    size = len(prompts)
    order = list(range(size))
    random.Random(i // size).shuffle(order)
    return prompts[order[i % size]]
