"""Drafting as one subsystem: how many tokens each sequence drafts in a step.

The scheduler calls :class:`DraftPolicy` three times a step: :meth:`~DraftPolicy.choose`
(this step's draft lengths, within the batch room the planner leaves),
:meth:`~DraftPolicy.feed_drafter` (whether a hidden-state drafter reads the batch) and
:meth:`~DraftPolicy.observe` (the step's verifications and what it cost). Inside:

- :mod:`.policy`: the choice (expected tokens per second of the step), probes;
- :mod:`.gate`: :class:`DrafterGate`, when a drafter that must read every batch is fed;
- :mod:`.cost`: :class:`StepCost`, what a step costs on this machine;
- :mod:`.calibration`: measuring it at start (on the native session; imported by the engine
  loop, so that the rest imports without the extension);
- :mod:`.stats`: :class:`DraftStats`, what a drafter got right per position;
- :mod:`.shadow`: :class:`ShadowDrafts`, drafts no row verifies, checked against the tokens
  their sequences emit (evidence of every sequence, for ngram-simple).
"""

from .cost import StepCost
from .gate import DrafterGate
from .policy import Drafting, DraftPolicy, Drafts, Tuning
from .stats import DrafterSync, DraftStats

__all__ = [
    "DraftPolicy",
    "DraftStats",
    "DrafterGate",
    "DrafterSync",
    "Drafting",
    "Drafts",
    "StepCost",
    "Tuning",
]
