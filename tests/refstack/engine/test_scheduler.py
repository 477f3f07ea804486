"""Scheduler: token budget, chunked prefill, max_running, slot reuse (no model needed)."""

from __future__ import annotations

from refstack.engine.config import EngineConfig
from refstack.engine.request import Request, RequestState
from refstack.engine.sampling import SamplingParams, make_generator
from refstack.engine.scheduler import Scheduler, SchedulerOutput
from refstack.model import ByteTokenizer


def req(rid: str, prompt_len: int) -> Request:
    return Request(rid, list(range(1, prompt_len + 1)), SamplingParams(max_tokens=4), make_generator(0),
                   lambda out: None, ByteTokenizer().stream_decoder())


def advance(out: SchedulerOutput) -> None:
    """What the engine does after a forward: count the tokens in, sample one where due."""
    for c in out.decode + out.prefill:
        c.request.num_computed += len(c.token_ids)
        if c.completes_prefill:
            c.request.output_ids.append(7)


def test_budget_is_split_into_prefill_chunks() -> None:
    sched = Scheduler(EngineConfig(max_batch_tokens=10, prefill_chunk=4, max_running=8), num_slots=8)
    a, b, c = req("a", 9), req("b", 9), req("c", 9)
    for r in (a, b, c):
        sched.add(r)
    out = sched.schedule()
    assert [(ch.request.request_id, len(ch.token_ids), ch.start_pos) for ch in out.prefill] == [
        ("a", 4, 0), ("b", 4, 0), ("c", 2, 0)]
    assert out.num_tokens == 10 and not out.decode
    assert [r.slot for r in (a, b, c)] == [0, 1, 2]
    advance(out)
    out = sched.schedule()
    assert [(ch.request.request_id, len(ch.token_ids), ch.start_pos) for ch in out.prefill] == [
        ("a", 4, 4), ("b", 4, 4), ("c", 2, 2)]
    advance(out)
    out = sched.schedule()
    # a and b finish their prompts (1 token each left), c gets the rest of the budget.
    assert [(ch.request.request_id, len(ch.token_ids)) for ch in out.prefill] == [("a", 1), ("b", 1), ("c", 4)]
    assert [ch.completes_prefill for ch in out.prefill] == [True, True, False]
    advance(out)
    out = sched.schedule()
    # Decodes go first, one token each, at the position after the prompt.
    assert [(ch.request.request_id, ch.start_pos) for ch in out.decode] == [("a", 9), ("b", 9)]
    assert [(ch.request.request_id, len(ch.token_ids)) for ch in out.prefill] == [("c", 1)]


def test_max_running_caps_admission_and_finished_slots_are_reused() -> None:
    sched = Scheduler(EngineConfig(max_batch_tokens=64, prefill_chunk=64, max_running=2), num_slots=4)
    reqs = [req(f"r{i}", 3) for i in range(3)]
    for r in reqs:
        sched.add(r)
    out = sched.schedule()
    assert [r.request_id for r in out.admitted] == ["r0", "r1"]
    assert reqs[2].state is RequestState.WAITING and len(sched.waiting) == 1
    advance(out)
    sched.finish(reqs[0])
    assert sched.num_slots_used == 1
    out = sched.schedule()
    assert [r.request_id for r in out.admitted] == ["r2"]
    assert reqs[2].slot == 0  # the lowest free slot: the one r0 gave back


def test_slots_bound_admission_even_when_max_running_is_larger() -> None:
    sched = Scheduler(EngineConfig(max_running=8), num_slots=2)
    for i in range(4):
        sched.add(req(f"r{i}", 2))
    out = sched.schedule()
    assert len(out.admitted) == 2 and sched.num_slots_used == 2


def test_abort_removes_waiting_and_running_requests() -> None:
    sched = Scheduler(EngineConfig(max_running=1), num_slots=1)
    a, b = req("a", 3), req("b", 3)
    sched.add(a)
    sched.add(b)
    sched.schedule()
    assert sched.abort("b") is b and not sched.waiting
    assert sched.abort("a") is a and sched.num_slots_used == 0 and not sched.running
    assert sched.abort("a") is None
