"""Timing a candidate's kernel from outside its process.

A clock read inside the candidate's process is the candidate's to patch
(``time.perf_counter`` slowed down makes any kernel fast).  On the CPU the judge
therefore times the calls itself: it tells the candidate worker to run a batch of
calls, and its own clock measures from the command to the answer.  Each sample is one
batch of at least ``JUDGE_MIN_SAMPLE_NS`` (so the round trip, tens of microseconds, is
a few percent at most, the same on both sides of a comparison), and the batches are
summarised exactly as :func:`infra_agent.lab.timing.time_cpu` does in-process.

On a GPU the kernel's time is the device's, read with CUDA events in the candidate's
process (:func:`infra_agent.lab.timing.time_call`); the judge validates what comes back
and computes the median and its interval itself, and the entry's notes say where the
clock ran.  A patched ``Event.elapsed_time`` is not caught there yet.
"""

from __future__ import annotations

import math
import time
from typing import Any, get_args

from infra_agent.lab.check_isolated import Made, candidate_faults, raised, stage
from infra_agent.lab.timing import Method, Timing, _summarise, with_host
from infra_agent.lab.wire import END, RAN, Garbled, unpack_reply
from infra_agent.lab.worker import CheckWorker

# A judged sample lasts at least this long: a round trip of ~50 us is then <= 1-2 %.
JUDGE_MIN_SAMPLE_NS = 5_000_000
JUDGE_NOTE = "timed by the judge's clock, outside the candidate's process (each sample one batch and one round trip)"
WORKER_NOTE = "GPU time read with CUDA events in the candidate's worker process; median and interval computed by the judge"


def _answer(data: bytes) -> None:
    """A batch's answer: ``RAN``, else the candidate's exception (or garbage)."""
    if data == RAN:
        return
    kind, *body = unpack_reply(data, trusted=False)
    fault = raised(kind, body)
    if fault is not None:
        raise fault
    raise Garbled(f"unexpected message {kind!r}")


def _by_judge(worker: CheckWorker, timeout_s: float, budget_s: float, warmup: int = 3, min_samples: int = 10,
              max_samples: int = 200) -> Timing:
    def batch_ns(calls: int, limit_s: float) -> int:
        start = time.perf_counter_ns()
        worker.send_raw(b"run:%d" % calls)
        _answer(worker.recv_raw(limit_s))
        return max(time.perf_counter_ns() - start, 1)

    batch_ns(warmup, timeout_s * warmup)
    # Size the batch from a calibration batch long enough that its round trip is small
    # (a single call's would include it whole: tens of microseconds on a 5 us kernel).
    calls, spent = 1, batch_ns(1, timeout_s)
    while spent < JUDGE_MIN_SAMPLE_NS // 5 and calls < 1 << 20:
        calls *= 4
        spent = batch_ns(calls, timeout_s)
    batch = max(1, math.ceil(calls * JUDGE_MIN_SAMPLE_NS / spent))
    # A batch is sized to ~5 ms: allow it many times that before calling it hung.
    limit_s = timeout_s + 10 * JUDGE_MIN_SAMPLE_NS / 1e9
    samples: list[float] = []
    deadline = time.perf_counter_ns() + int(budget_s * 1e9)
    while len(samples) < max_samples and (len(samples) < min_samples or time.perf_counter_ns() < deadline):
        samples.append(batch_ns(batch, limit_s) / batch / 1e9)
    worker.send_raw(END)
    return _summarise(samples, "perf_counter_ns", warmup, batch, [JUDGE_NOTE])


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


def time_candidate(worker: CheckWorker, job: dict[str, Any], key: Any, made: Made, device: str, variant: str,
                   precision: str, *, budget_s: float, method: Method | None, timeout_s: float) -> Timing:
    """One bench entry of the candidate's ``variant`` on staged inputs, or ``CandidateFault``."""
    gpu = device.startswith("cuda")
    with candidate_faults(worker, kill_on_raised=True):
        stage(worker, job, key, made, device, timeout_s)
        worker.send({**job, "op": "time", "key": key, "variant": variant, "precision": precision, "device": device,
                     "budget_s": budget_s, "method": method, "clock": "worker" if gpu else "judge"})
        # A GPU entry runs its whole timing loop before answering.
        kind, *body = worker.recv(timeout_s * 4 + 60 if gpu else timeout_s)
        fault = raised(kind, body)
        if fault is not None:
            raise fault
        if gpu and kind == "timing":
            worker.done()
            return _from_worker(body)
        if gpu or kind != "ready":
            raise Garbled(f"unexpected message {kind!r}")
        timing = _by_judge(worker, timeout_s, budget_s)
        worker.done()
        return timing
