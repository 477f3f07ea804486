"""Timing a candidate's kernel from outside its process.

A clock read inside the candidate's process is the candidate's to patch
(``time.perf_counter`` slowed down makes any kernel fast).  On the CPU the judge
therefore times the calls itself: it tells the candidate worker to run a batch of
calls, and its own clock measures from the command to the answer.  Each sample is one
batch of at least ``JUDGE_MIN_SAMPLE_NS`` where the pool of fresh inputs allows (so the
round trip, tens of microseconds, is a few percent at most, the same on both sides of a
comparison), and the batches are summarised exactly as
:func:`infra_agent.lab.timing.time_cpu` does in-process.  What a batch must contain
(its whole work, on inputs the kernel has not seen) is :mod:`infra_agent.lab.timed_calls`
and :mod:`infra_agent.lab.timed_inputs`.

On a GPU the kernel's time is the device's, read with CUDA events in the candidate's
process (:func:`infra_agent.lab.timing.time_call`); the judge validates what comes back
and then checks it against its own clock (``gpu_clock_disagreement``): it times, from
its process, a GPU spin alone and the same spin followed by ``k`` back-to-back calls on
fresh inputs, each ending with a device-wide synchronise.  The difference is ``k`` calls'
GPU time (the spin covers their launches), with warm caches, so it is at most what cold
events read; a reading more than ``GPU_CLOCK_BOUND`` times below it (give or take the
judge's jitter over its ``k`` calls) is refused (a
patched ``Event.elapsed_time``, or work on a stream the events do not wait for).
"""

from __future__ import annotations

import math
import random
import statistics
import time
from typing import Any, get_args

from infra_agent.lab.check_calls import _Case
from infra_agent.lab.check_isolated import (
    CandidateFault,
    Made,
    candidate_faults,
    raised,
    stage,
)
from infra_agent.lab.timed_inputs import (
    check_kept,
    input_bytes,
    make_pool,
    pool_size,
    read_kept,
)
from infra_agent.lab.timing import Method, Timing, _summarise, with_host
from infra_agent.lab.wire import END, RAN, Garbled, unpack_reply
from infra_agent.lab.worker import CheckWorker, LabWorkers

# A judged sample lasts at least this long: a round trip of ~50 us is then <= 1-2 %.
JUDGE_MIN_SAMPLE_NS = 5_000_000
JUDGE_NOTE = "timed by the judge's clock, outside the candidate's process (each sample one batch and one round trip)"
WORKER_NOTE = "GPU time read with CUDA events in the candidate's worker process; median and interval computed by the judge"
# The GPU cross-check: the judge's k calls last about this long, in this many rounds; the
# events may read at most this many times less than the judge's clock, plus the jitter of
# the judge's difference of two round trips, spread over its k calls.  Measured on an H100
# (docs/kernel-lab.md): honest kernels read 0.76-1.12x, a patched clock 7.6-9.8x, a side
# stream 2.7x (a 5 us GEMM) to 200x.
GPU_CHECK_SPAN_S = 2e-3
GPU_CHECK_ROUNDS = 3
GPU_CLOCK_BOUND = 1.5
GPU_ROUND_TRIP_JITTER_S = 50e-6


def gpu_clock_disagreement(events_s: float, judge_s: float, k: int = 1, bound: float = GPU_CLOCK_BOUND,
                           jitter_s: float = GPU_ROUND_TRIP_JITTER_S) -> str | None:
    """Why a GPU time per call read with CUDA events in the candidate's worker (``events_s``)
    cannot stand beside the judge's own measure over ``k`` calls (``judge_s`` per call), or None.

    The judge's figure is an upper bound on honest events (warm caches, launches hidden);
    events may read more (cold L2 each rep) but not ``bound`` times less, give or take the
    judge's own jitter over its ``k`` calls."""
    if judge_s <= bound * events_s + jitter_s / max(k, 1):
        return None
    return (f"refused: the GPU clock in the candidate's worker read {events_s * 1e6:.2f} µs per call, but the judge's own "
            f"clock measured {judge_s * 1e6:.2f} µs per call of GPU time over the same kind of calls "
            f"({judge_s / max(events_s, 1e-12):.1f}x, bound {bound:g}x): a patched clock, or work the events do not see "
            f"(another stream, another thread)")


def _answer(data: bytes) -> None:
    """A batch's answer: ``RAN``, else the candidate's exception (or garbage)."""
    if data == RAN:
        return
    kind, *body = unpack_reply(data, trusted=False)
    fault = raised(kind, body)
    if fault is not None:
        raise fault
    raise Garbled(f"unexpected message {kind!r}")


def _timed_ns(worker: CheckWorker, command: bytes, limit_s: float) -> int:
    start = time.perf_counter_ns()
    worker.send_raw(command)
    _answer(worker.recv_raw(limit_s))
    return max(time.perf_counter_ns() - start, 1)


def _by_judge(worker: CheckWorker, timeout_s: float, budget_s: float, pool: int, warmup: int = 3, min_samples: int = 10,
              max_samples: int = 200) -> Timing:
    _timed_ns(worker, b"warm:%d" % warmup, timeout_s * warmup)
    # Size the batch from a calibration batch long enough that its round trip is small
    # (a single call's would include it whole: tens of microseconds on a 5 us kernel).
    calls, spent = 1, _timed_ns(worker, b"warm:1", timeout_s)
    while spent < JUDGE_MIN_SAMPLE_NS // 5 and calls < 1 << 20:
        calls *= 4
        spent = _timed_ns(worker, b"warm:%d" % calls, timeout_s)
    batch = max(1, math.ceil(calls * JUDGE_MIN_SAMPLE_NS / spent))
    notes = [JUDGE_NOTE]
    if batch * min_samples > pool:
        # Fresh inputs first: shorter batches, so that no timed call repeats an input.
        short = max(1, pool // min_samples)
        notes.append(f"batches of {short} calls, not {batch}, so that each timed call has an input of its own")
        batch = short
    # A batch is sized to ~5 ms: allow it many times that before calling it hung.
    limit_s = timeout_s + 10 * JUDGE_MIN_SAMPLE_NS / 1e9
    # The outputs of the first batch, one drawn at random and the last are checked; the
    # candidate learns which only after each has run.
    drawn = random.SystemRandom().randrange(1, min_samples)
    samples: list[float] = []
    deadline = time.perf_counter_ns() + int(budget_s * 1e9)
    while len(samples) < max_samples and (len(samples) < min_samples or time.perf_counter_ns() < deadline):
        if len(samples) >= min_samples and (len(samples) + 1) * batch > pool:
            break  # the fresh inputs are spent
        keep = len(samples) - 1 in (0, drawn)
        samples.append(_timed_ns(worker, b"run:%d:%d" % (batch, keep), limit_s) / batch / 1e9)
    used = len(samples) * batch
    notes.append(f"each timed call on an input of its own ({min(used, pool)} made on the pristine side, none of them "
                 "the check's); the outputs of 3 batches checked against the reference")
    if used > pool:
        notes.append(f"the {pool} inputs (as many as the pool's bound allows) were used "
                     f"{used / pool:.1f} times over: a cache across calls could hit")
    return _summarise(samples, "perf_counter_ns", warmup, batch, notes)


def _gpu_check(worker: CheckWorker, t: Timing, timeout_s: float, pool: int) -> tuple[float, int]:
    """The judge's GPU time per call (spin + k calls, less the spin alone) and k."""
    k = max(1, min(math.ceil(GPU_CHECK_SPAN_S / max(t.median_s, 1e-9)), pool // GPU_CHECK_ROUNDS))
    limit_s = timeout_s + 60
    diffs = []
    for _ in range(GPU_CHECK_ROUNDS):
        # The spin alone keeps the previous round's outputs for the check (the last: at the end).
        alone = _timed_ns(worker, b"gpu:%d:0:1" % k, limit_s)
        diffs.append(_timed_ns(worker, b"gpu:%d:%d:0" % (k, k), limit_s) - alone)
    return max(statistics.median(diffs), 0) / k / 1e9, k


def _floats(value: Any, what: str) -> list[float]:
    if not (isinstance(value, list) and value and all(isinstance(v, float) and math.isfinite(v) and v >= 0 for v in value)):
        raise Garbled(f"{what}: expected a non-empty list of finite seconds")
    return value


def _from_worker(body: list[Any]) -> Timing:
    """A GPU timing as the candidate's worker reported it, checked field by field."""
    raw = body[0] if len(body) == 1 and isinstance(body[0], dict) else None
    if raw is None:
        raise Garbled("a timing must be one dict")
    method, warmup, batch, notes = raw.get("method"), raw.get("warmup"), raw.get("batch"), raw.get("notes")
    if method not in get_args(Method) or not isinstance(warmup, int) or not isinstance(batch, int) or batch < 1:
        raise Garbled("a timing's method, warmup or batch is not one the lab knows")
    if not (isinstance(notes, list) and all(isinstance(n, str) for n in notes)):
        raise Garbled("a timing's notes must be strings")
    t = _summarise(_floats(raw.get("samples_s"), "samples_s"), method, warmup, batch, [*notes[:20], WORKER_NOTE])
    host = raw.get("host_samples_s")
    return t if host is None else with_host(t, _floats(host, "host_samples_s"))


def time_candidate(workers: LabWorkers, job: dict[str, Any], key: Any, case: _Case, made: Made, variant: str,
                   precision: str, *, budget_s: float, method: Method | None, timeout_s: float) -> Timing:
    """One bench entry of the candidate's ``variant`` on fresh inputs, or ``CandidateFault``."""
    worker, device = workers.candidate, case.device
    gpu = device.startswith("cuda")
    pool = pool_size(input_bytes(made.inputs))
    with candidate_faults(worker, kill_on_raised=True):
        stage(worker, job, key, made, device, timeout_s)
        made_pool = make_pool(workers, job, case, pool, timeout_s)
        worker.send({**job, "op": "time", "key": key, "variant": variant, "precision": precision, "device": device,
                     "budget_s": budget_s, "method": method, "clock": "worker" if gpu else "judge"})
        # A GPU entry runs its whole timing loop before answering.
        kind, *body = worker.recv(timeout_s * 4 + 60 if gpu else timeout_s)
        fault = raised(kind, body)
        if fault is not None:
            raise fault
        if gpu:
            if kind != "timing":
                raise Garbled(f"unexpected message {kind!r}")
            timing = _from_worker(body)
            kind, *body = worker.recv(timeout_s)
        if kind != "ready":
            raise Garbled(f"unexpected message {kind!r}")
        if gpu:
            judge_s, k = _gpu_check(worker, timing, timeout_s, pool)
            timing.notes.append(f"the judge's clock: {judge_s * 1e6:.2f} µs per call of GPU time over {k} back-to-back "
                                "calls on fresh inputs (spin + calls, less the spin alone)")
        else:
            timing = _by_judge(worker, timeout_s, budget_s, pool)
        worker.send_raw(END + b":1")
        kind, *body = unpack_reply(worker.recv_raw(timeout_s + 60), trusted=False)
        fault = raised(kind, body)
        if fault is not None:
            raise fault
        if kind != "outs":
            raise Garbled(f"unexpected message {kind!r}")
        kept = read_kept(body, pool)
        worker.done()
    wrong = check_kept(workers, job, case, made_pool, kept, variant, precision, timeout_s)
    if wrong is None and gpu:
        wrong = gpu_clock_disagreement(timing.median_s, judge_s, k)
    if wrong is not None:
        raise CandidateFault(wrong, "raised")
    return timing
