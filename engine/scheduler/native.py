"""The scheduler's one door to the extension: a :class:`~.planner.Plan` and a request's
:class:`~.params.SamplingParams` as the native step takes them. The planner, the draft
policy and the parameters are plain Python; in the scheduler only this module imports
``_nb_spec``."""

from __future__ import annotations

import json
from typing import TYPE_CHECKING

from .. import _nb_spec

if TYPE_CHECKING:
    from ..session import SpeculativeSession
    from .params import SamplingParams
    from .planner import Plan
    from .request import Request

__all__ = ["check_sampling", "sampler_params", "step_plan", "step_runner"]


def step_runner(session: SpeculativeSession) -> _nb_spec.StepRunner:
    """The native step over ``session``: one call runs a :func:`step_plan`."""
    return _nb_spec.StepRunner.create(session.native)


def sampler_params(params: SamplingParams, seed: int) -> _nb_spec.SamplerParams:
    p = _nb_spec.SamplerParams()
    p.temperature = float(params.temperature)
    p.top_k = params.top_k
    p.top_p = float(params.top_p)
    p.min_p = float(params.min_p)
    p.seed = seed
    p.penalty_last_n = params.penalty_last_n
    p.repetition_penalty = float(params.repetition_penalty)
    p.presence_penalty = float(params.presence_penalty)
    p.frequency_penalty = float(params.frequency_penalty)
    p.ignore_eos = params.ignore_eos
    p.grammar = params.grammar or ""
    schema = params.json_schema
    p.json_schema = "" if schema is None else schema if isinstance(schema, str) else json.dumps(schema)
    p.logit_bias = [(t, float(v)) for t, v in (params.logit_bias or {}).items()]
    p.n_logprobs = -1 if params.logprobs is None else params.logprobs
    p.min_tokens = params.min_tokens
    p.min_tokens_suppress = list(params.stop_token_ids)
    p.special = not params.skip_special_tokens
    return p


def check_sampling(params: SamplingParams) -> None:
    """The sampler's value rules, which live once, natively.

    :raises InvalidConfigError: naming the value."""
    _nb_spec.validate_sampler_params(sampler_params(params, 0))


def _request_sampler(r: Request) -> _nb_spec.SamplerParams:
    """A request's sampler, with its chat template's grammar (tools)."""
    p = sampler_params(r.params, r.seed)
    if r.chat is not None:
        p.chat = r.chat.grammar
    return p


def step_plan(plan: Plan) -> _nb_spec.StepPlan:
    p = _nb_spec.StepPlan()
    p.output_align, p.align_from = plan.tiles
    p.sync_drafter = plan.sync_drafter
    for slot, n_accepted in plan.settles:
        p.settle(slot, n_accepted)
    for r in plan.captures:
        assert r.slot is not None
        p.capture(r.slot)
    for slot, r in plan.preempted:
        assert r.parked is not None
        p.capture(slot)
        p.park(slot, r.parked)
    for key in plan.drops:
        p.drop_parked(key)
    for slot in plan.clears:
        p.clear(slot)
    for slot, prefix in plan.reuses:
        p.reuse(slot, prefix)
    for r in plan.admitted:
        assert r.slot is not None
        if r.resume is None:  # (a reused prefix is prompt: nothing to replay)
            p.configure(r.slot, _request_sampler(r))
            continue
        p.restore(r.slot, r.resume.target, r.resume.draft, r.resume.spec)
        if r.parked is not None:  # preempted: its own sampler, as it was
            p.unpark(r.slot, r.parked)
            continue
        p.configure(
            r.slot,
            _request_sampler(r),
            r.history[: r.n_prompt_history],
            r.history[r.n_prompt_history :],
        )
    for w in plan.work:
        assert w.request.slot is not None
        p.work(w.request.slot, w.tokens, w.pos0, w.sample, w.n_draft, w.begin, w.max_draft, w.shadow)
    return p
