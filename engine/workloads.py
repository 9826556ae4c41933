"""The benchmarks' prompt sets (and prompt files), for ``python -m engine bench`` and the
scripts in ``benchmarks/``: mixed, copy-heavy, code, edits, summaries, chat, formats and a set held
out of all tuning, plus shared-prefix prompts."""

from __future__ import annotations

import json
import random
from collections.abc import Sequence
from pathlib import Path
from typing import TypeVar

__all__ = [
    "CHAT_PROMPTS",
    "CODE_PROMPTS",
    "COPY_PROMPTS",
    "EDIT_PROMPTS",
    "FORMAT_PROMPTS",
    "HELDOUT_PROMPTS",
    "PROMPTS",
    "PROMPT_SETS",
    "SHARED_PROMPTS",
    "SHARED_SYSTEM",
    "SUMMARY_PROMPTS",
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

_FUNCTION = (
    "def total_price(items, tax_rate):\n    subtotal = 0\n    for item in items:\n"
    "        subtotal += item.price * item.quantity\n    tax = subtotal * tax_rate\n"
    "    return subtotal + tax\n"
)
_LETTER = (
    "Dear residents, the commitee met on tuesday to discus the new budjet. Members agreed that "
    "the libary needs more funding, and that the park shoud be cleaned before the summer festival. "
    "The next meeting will be held in the town hall on the first monday of june."
)
_REPORT = (
    "The quarterly report shows that sales rose by twelve percent in the north region, driven by "
    "the new store in Leeds, while the south region stayed flat because two stores closed for "
    "repairs. Online orders grew faster than store orders for the third quarter in a row, and "
    "returns fell after the new sizing guide was published. The board expects the same trend "
    "next quarter and has approved two more stores in the north."
)

#: code to complete and to edit: the answer copies most of the prompt, with changes
CODE_PROMPTS = [
    f"{_FUNCTION}\n# The same function with type hints:\ndef total_price(items: list, tax_rate: float) -> float:\n",
    f"{_FUNCTION}\n# The same function, with the variable subtotal renamed to net:\n",
    f"{_FUNCTION}\n# The same function with a docstring:\n",
    f"{_CODE[0]}\n# The same function, with a and b renamed to left and right:\ndef merge(left, right):\n",
    f"{_CODE[1]}\n# The same class, with a method is_empty added at the end:\nclass Stack:\n",
    f"{_CODE[2]}\n-- The same query, returning 20 rows:\nSELECT customers.name, orders.total\n",
]

#: prose to correct or to repeat with small changes
EDIT_PROMPTS = [
    f"Text: {_LETTER}\nThe same text with the spelling fixed: Dear residents, the committee",
    f"Text: {_LETTER}\nThe same text in the past tense, otherwise unchanged:",
    f"Text: {_REPORT}\nThe same text with every number written in digits:",
    "List: bananas, apples, cherries, dates, elderberries, figs, grapes\n"
    "The same list in upper case: BANANAS,",
    'JSON: {"name": "Ada", "age": 36, "city": "London", "languages": ["English", "French"]}\n'
    'The same JSON with one key per line:\n{\n  "name": "Ada",\n',
    f"Original: {_LETTER}\nCopy:",
]

#: summaries: the answer reuses the prompt's phrases, not its sentences
SUMMARY_PROMPTS = [
    f"Report: {_REPORT}\nSummary in two sentences:",
    f"Letter: {_LETTER}\nThe letter's three points, as a list:\n-",
    f"Report: {_REPORT}\nHeadline for this report:",
    f"{_CODE[0]}\nWhat this function does, in one paragraph:",
    f"{_CODE[1]}\nA short description of each method of this class:\n-",
]

#: chat: questions whose answers copy little
CHAT_PROMPTS = [
    "User: What is a good name for a grey cat?\nAssistant:",
    "User: How do I boil an egg so that the yolk stays soft?\nAssistant:",
    "User: Give me three ideas for a rainy Sunday afternoon.\nAssistant:",
    "User: Why do leaves change colour in autumn?\nAssistant:",
    "User: Write a haiku about a train at night.\nAssistant:",
    "User: What should I pack for a weekend of hiking?\nAssistant:",
]

#: records turned from one format into another: the answer copies the values, not the layout
FORMAT_PROMPTS = [
    "CSV:\nname,team,points\nAlice,red,12\nBruno,blue,9\nChen,red,15\nDara,green,7\n"
    "The same rows as a Markdown table:\n| name | team | points |\n|---|---|---|\n",
    "Log:\n2024-05-01 10:02:11 ERROR disk full on /var\n2024-05-01 10:05:40 WARN retrying upload\n"
    "2024-05-01 10:07:02 INFO upload finished\nThe same log as JSON lines:\n",
    "Addresses:\nMaria Lopez, 14 Garden Road, Bristol\nTom Becker, 3 Mill Lane, York\n"
    "Ines Costa, 88 High Street, Bath\nThe same addresses, one field per line:\n",
    "Shopping list: 2 kg potatoes; 6 eggs; 1 litre milk; 500 g butter; 3 lemons\nThe same list as YAML:\n",
    "Schedule: Monday 9:00 standup, Monday 14:00 design review, Tuesday 11:00 planning, "
    "Thursday 16:00 retrospective\nThe same schedule as a numbered list:\n1.",
    "Python dict: {'red': 3, 'green': 5, 'blue': 7, 'yellow': 2}\n"
    "The same data as a JavaScript object:\nconst counts = {",
    "Sentence: The train to Glasgow leaves at seven, stops in Preston and Carlisle, and arrives "
    "at half past eleven.\nThe same sentence in the future tense: The train to Glasgow will",
]

_NOTICE = (
    "From 1 March the library opens at 9:00 on weekdays and at 10:00 on Saturdays. Books may be "
    "borrowed for three weeks and renewed twice online. Members who return books late pay 20 "
    "cents a day, up to 5 euros a book. The reading room on the second floor is reserved for "
    "quiet study, and the café on the ground floor closes one hour before the library."
)

#: held out of all tuning of the draft policy (the published table runs on it): answers that
#: quote a passage or a definition, and text rewritten with small changes
HELDOUT_PROMPTS = [
    f"Notice: {_NOTICE}\nQuestion: When does the library open on Saturdays, and how long may "
    "books be borrowed?\nAnswer, quoting the notice:",
    f"Notice: {_NOTICE}\nThe same notice, written for children in simpler words:",
    f"Notice: {_NOTICE}\nThe notice's rules as a bulleted list:\n-",
    "class Account:\n    def __init__(self, owner, balance=0):\n        self.owner = owner\n"
    "        self.balance = balance\n\n    def deposit(self, amount):\n        self.balance += amount\n\n"
    "    def withdraw(self, amount):\n        if amount > self.balance:\n"
    "            raise ValueError('insufficient funds')\n        self.balance -= amount\n\n"
    "# The same class as a Python dataclass:\nfrom dataclasses import dataclass\n\n@dataclass\nclass Account:\n",
    "Recipe: Mix 200 g flour, 2 eggs and 300 ml milk into a smooth batter. Rest it for 30 minutes. "
    "Heat a pan with a little butter and pour in a thin layer. Cook each side for one minute.\n"
    "The same recipe for twice as many people:",
    "Email: Hi Sam, could you send me the slides from Tuesday's meeting before Friday? I also need "
    "the budget table we discussed. Thanks, Priya\nThe same email, more formal: Dear Sam,",
    "Error: TypeError: unsupported operand type(s) for +: 'int' and 'str' in line 12 of report.py, "
    "where total = count + label\nExplanation of the error, quoting the line:",
]

PROMPT_SETS = {
    "mixed": PROMPTS,
    "copy": COPY_PROMPTS,
    "shared": SHARED_PROMPTS,
    "code": CODE_PROMPTS,
    "edits": EDIT_PROMPTS,
    "summaries": SUMMARY_PROMPTS,
    "chat": CHAT_PROMPTS,
    "formats": FORMAT_PROMPTS,
    "heldout": HELDOUT_PROMPTS,
}


def load_prompts(name_or_path: str) -> list[str]:
    """A built-in prompt set (:data:`PROMPT_SETS`) or a file: one prompt per line, or JSON
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
