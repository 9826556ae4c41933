"""The scheduler's pure logic, without the native core: planning, slots, text assembly."""

from __future__ import annotations

from engine.scheduler.params import SamplingParams
from engine.scheduler.planner import SlotTable, WaitQueue, plan_step
from engine.scheduler.request import Request, RequestState, TextAssembler


def make(
    rid: str,
    state: RequestState,
    *,
    prompt: int = 0,
    n_past: int = 10,
    max_tokens: int = 100,
    priority: int = 0,
    arrival: int = 0,
) -> Request:
    r = Request(rid, [1] * max(prompt, 1), SamplingParams(max_tokens=max_tokens), 0, priority, arrival)
    r.state = state
    r.history = [3] * n_past
    r.last = 5
    r.to_prefill = [7] * prompt
    return r


def test_decode_first_then_prefill_chunks_within_the_budget() -> None:
    running = [
        make("a", RequestState.DECODE),
        make("b", RequestState.DECODE),
        make("c", RequestState.PREFILL, prompt=500, n_past=0),
    ]
    work = plan_step(running, n_batch=64, n_draft_max=4, n_ctx=1024, prefill_reserve=16, speculative=True)
    assert [w.request.request_id for w in work] == ["a", "b", "c"]
    assert [w.n_draft for w in work[:2]] == [4, 4]
    assert sum(len(w.tokens) + w.n_draft for w in work) == 64  # one full target batch
    chunk = work[2]
    assert len(chunk.tokens) == 54 and not chunk.sample and not chunk.begin


def test_a_short_prompt_left_is_read_before_long_cold_ones() -> None:
    """A request whose prompt is mostly cached has a few tokens left: it is read first, not
    after every long prompt that arrived before it."""
    running = [
        make("cold-1", RequestState.PREFILL, prompt=900, n_past=0),
        make("cold-2", RequestState.PREFILL, prompt=900, n_past=0),
        make("cached", RequestState.PREFILL, prompt=12, n_past=1000),
    ]
    work = plan_step(running, n_batch=64, n_draft_max=4, n_ctx=4096, prefill_reserve=16, speculative=False)
    assert [(w.request.request_id, len(w.tokens)) for w in work] == [("cached", 12), ("cold-1", 52)]
    assert work[0].sample and work[0].begin


def test_the_final_prompt_chunk_samples_and_begins() -> None:
    work = plan_step(
        [make("c", RequestState.PREFILL, prompt=20, n_past=100)],
        n_batch=64,
        n_draft_max=4,
        n_ctx=1024,
        prefill_reserve=16,
        speculative=True,
    )
    assert len(work) == 1 and work[0].tokens == [7] * 20 and work[0].pos0 == 100
    assert work[0].sample and work[0].begin and work[0].n_draft == 0


def test_drafts_shrink_to_keep_room_for_prompts_context_and_max_tokens() -> None:
    many = [make(f"d{i}", RequestState.DECODE) for i in range(8)]
    waiting_prompt = make("p", RequestState.PREFILL, prompt=100, n_past=0)
    work = plan_step(
        [*many, waiting_prompt], n_batch=32, n_draft_max=4, n_ctx=1024, prefill_reserve=8, speculative=True
    )
    assert sum(len(w.tokens) + w.n_draft for w in work if w.request is not waiting_prompt) <= 32 - 8
    assert any(w.request is waiting_prompt for w in work)  # the prompt makes progress
    near_end = make("e", RequestState.DECODE, n_past=1020)
    last_token = make("m", RequestState.DECODE, max_tokens=1)
    work = plan_step(
        [near_end, last_token], n_batch=64, n_draft_max=4, n_ctx=1024, prefill_reserve=8, speculative=True
    )
    assert work[0].n_draft == 2  # drafts stop at the end of the sequence's context
    assert work[1].n_draft == 0  # a request with one token to go does not draft


def test_no_drafts_without_speculation() -> None:
    work = plan_step(
        [make("a", RequestState.DECODE)],
        n_batch=64,
        n_draft_max=4,
        n_ctx=1024,
        prefill_reserve=8,
        speculative=False,
    )
    assert work[0].n_draft == 0 and work[0].tokens == [5]


def test_slot_table_and_priority_queue() -> None:
    slots = SlotTable(2)
    a, b, c = (make(x, RequestState.WAITING) for x in "abc")
    assert slots.allocate(a) == (0, 0, False, True) and slots.allocate(b) == (1, 0, False, True)
    assert slots.allocate(c) is None
    assert slots.release(0, holds=[1, 2, 3])  # no prefix cache: empty, to be cleared
    assert slots.n_free == 1 and slots.allocate(c) == (0, 0, False, True)
    q = WaitQueue()
    for r in (
        make("x", RequestState.WAITING, arrival=0),
        make("y", RequestState.WAITING, arrival=1),
        make("z", RequestState.WAITING, arrival=2, priority=5),
    ):
        q.push(r)
    assert [q.pop().request_id for _ in range(3)] == ["z", "x", "y"]


def test_text_assembler_holds_back_split_characters_and_stop_strings() -> None:
    t = TextAssembler(("STOP",))
    e_acute = "é".encode()
    t.feed(b"caf" + e_acute[:1])
    assert t.take() == ""  # three characters could still be the start of "STOP"
    t.feed(e_acute[1:] + b" ok ST")
    assert t.take() == "café ok"  # " ST" is held back: it may grow into "STOP"
    t.feed(b"OP and more")
    assert t.stopped and t.text == "café ok "
    assert t.take() == " "
    assert t.take(final=True) == ""
    u = TextAssembler(())
    u.feed("日".encode()[:2])
    assert u.take() == ""  # half a character is never handed out
    u.feed("日".encode()[2:] + b"!")
    assert u.take() == "日!"
    u.feed(b"\xff")  # not UTF-8 at all: replaced, not stalled
    assert u.take(final=True) == "\ufffd"


def test_a_prefix_the_drafter_missed_is_reused_without_drafting() -> None:
    """A stream drafter fed nothing while its gate was closed: a request that reuses what it
    missed cannot draft (its prompt steps must not feed the drafter, nor keep its gate open);
    a slot cleared for a new prompt is whole again."""
    slots = SlotTable(2, prefix_cache=True)
    old = make("old", RequestState.DECODE)
    grant = slots.allocate(old)
    assert grant is not None
    slots.release(grant.slot, [5] * 40, drafter_in_sync=False)
    reuse = slots.allocate(make("new", RequestState.WAITING), [5] * 40 + [6])
    assert reuse is not None and reuse.keep == 40 and not reuse.drafter_in_sync
    slots.release(reuse.slot, [5] * 40, drafter_in_sync=False)
    slots.allocate(make("x", RequestState.WAITING), [9] * 50)  # (takes the empty slot)
    evicted = slots.allocate(make("y", RequestState.WAITING), [7] * 50)
    assert evicted is not None and evicted.cached and evicted.keep == 0 and evicted.drafter_in_sync
