"""Kernel-lab reports as Feedback parts: measurements and findings.

Measurements carry the locality the agent acts on: ``kernel`` (spec), ``variant``,
``input`` (shape and dtype) and ``knob`` (``precision=...``).  Findings name the worst
element, the failed criteria and the input condition of a mismatch, the bound and
headroom of each timed entry (for a memory-bound one, split against a plain copy of its
own bytes into the kernel's own share and the floor of its size), the entries whose host
launch cost exceeds their GPU time (``launch_bound``), and the work repeated across tiles.
"""

from __future__ import annotations

from collections import defaultdict
from typing import Any

from infra_agent.feedback import Finding, Location, Measurement
from infra_agent.lab.correctness import KERNEL, CheckReport, CheckResult
from infra_agent.lab.microbench import BenchEntry, BenchReport
from infra_agent.lab.roofline import RooflinePoint
from infra_agent.lab.timing import Timing
from infra_agent.lab.work import OpWork, describe_repeat
from infra_agent.vocabulary import FindingKind

LAUNCH_BOUND = FindingKind.LAUNCH_BOUND


def _tags(spec: str, variant: str, shape: str, dtype: str, precision: str) -> dict[str, str]:
    return {"kernel": spec, "variant": variant, "input": f"{shape};dtype={dtype}", "knob": f"precision={precision}"}


def check_feedback_parts(report: CheckReport) -> tuple[list[Measurement], list[Finding]]:
    groups: dict[tuple[str, str, str, str, str], list[CheckResult]] = defaultdict(list)
    for r in report.results:
        if r.stats is not None:
            groups[(r.variant, r.precision, r.shape, r.dtype, r.output)].append(r)
    ms: list[Measurement] = []
    for (variant, precision, shape, dtype, output), rs in groups.items():
        tags = _tags(report.spec, variant, shape, dtype, precision)
        if output != "out":
            tags["component"] = f"output={output}"
        vs = rs[0].against
        for name, attr in (("rel_fro_error", "rel_fro"), ("max_abs_error", "max_abs"), ("max_ulp", "max_ulp")):
            samples = [getattr(r.stats, attr) for r in rs if r.stats is not None]
            ms.append(error_measurement(f"{name}_vs_{vs}", "ratio" if attr == "rel_fro" else ("ulp" if attr == "max_ulp" else "abs"), samples, **tags))
    findings = [_mismatch_finding(report, r) for r in _worst_failures(report)]
    findings += [Finding(kind="skipped", message=s, severity="info", location=Location(file=report.origin or None, kernel=report.spec)) for s in report.skipped]
    return ms, findings


def error_measurement(name: str, unit: str, samples: list[float], **tags: str) -> Measurement:
    """An error metric (max abs, max ULP, rel. Frobenius) over seeds x shapes x dtypes.

    Lower is better.  The summary's interval is a bootstrap interval of the median, so
    it stays within the samples and needs no clamping to the metric's domain (>= 0).
    """
    return Measurement.from_samples(name, unit, samples, better="lower", **tags)


def _worst_failures(report: CheckReport) -> list[CheckResult]:
    """One failure per (variant, precision, output): the worst one, with its condition."""
    return [r for r in report.rows() if r.status == "failed"]


def _mismatch_finding(report: CheckReport, r: CheckResult) -> Finding:
    loc = Location(file=report.origin or None, kernel=report.spec, variant=r.variant, precision=r.precision)
    cond = r.condition.label() if r.condition else ""
    ev: dict[str, Any] = {
        "variant": r.variant, "against": r.against, "precision": r.precision, "shape": r.shape, "dtype": r.dtype,
        "seed": r.seed, "tolerance": r.tolerance, "condition": cond, "seeds": report.seeds,
    }
    passing = sorted({x.precision for x in report.results if x.variant == r.variant and x.status == "passed"} - {r.precision})
    if r.fault == "timeout":
        kind = FindingKind.KERNEL_TIMEOUT
        ev["timeout_s"] = report.timeout_s
        question = (
            f"Does {r.variant} hang or only run slowly at [{r.shape}] under {r.precision}? Rerun {cond} with a larger "
            "--timeout-s; if it still does not return, look for a wait that never completes (a spin on a flag, a "
            "barrier or collective some rank never reaches, a lock)."
        )
    elif r.fault == "crashed":
        kind = FindingKind.KERNEL_ERROR
        question = f"Reproduce with {cond} in a process of its own: what ends it (an out-of-bounds access, an abort or exit in an extension)?"
    elif r.stats is None:
        kind = FindingKind.KERNEL_ERROR if r.fault == "raised" else FindingKind.WRONG_OUTPUT
        question = f"Reproduce with {cond}: why does {r.variant} {r.message.split(':')[0]}?"
    else:
        s = r.stats
        kind = FindingKind.NONFINITE_OUTPUT if s.n_nonfinite else FindingKind.MISMATCH
        ev.update(
            max_abs=s.max_abs, max_rel=s.max_rel, max_ulp=s.max_ulp, max_ulp_all=s.max_ulp_all, ulp_floor=s.ulp_floor, rel_fro=s.rel_fro,
            worst_index=list(s.worst_index), worst_value=s.worst_value, worst_ref=s.worst_ref,
            n_violations=s.n_violations, n_elements=s.n_elements,
            # n_violations counts elements only; a rel_fro-only failure has 0 there.
            violated=list(s.violated),
        )
        if r.against == KERNEL and passing:
            question = (
                f"{r.variant} agrees with the unpartitioned kernel under {', '.join(passing)} but not {r.precision}: "
                f"does the partition round an intermediate (partial sums, a reduction) to {r.precision}? "
                f"Look at index {list(s.worst_index)} with {cond}."
            )
        elif r.against == KERNEL:
            question = f"Which partial of {r.variant} produces index {list(s.worst_index)}? Compare it shard by shard with the unpartitioned result ({cond})."
        else:
            question = f"Is the error at {list(s.worst_index)} rounding (grows with the reduction length) or a bug (fixed offset)? Rerun {cond} with a longer and a shorter reduction."
    msg = f"{r.variant} vs {r.against} under {r.precision} [{r.shape} {r.dtype}] output {r.output}: {r.message}"
    return Finding(kind=kind, message=msg, severity="error", location=loc, evidence=ev, next_question=question)


def work_findings(spec: str, origin: str, work: dict[str, dict[str, Any]]) -> tuple[list[Measurement], list[Finding]]:
    ms: list[Measurement] = []
    fs: list[Finding] = []
    for variant, counted in work.items():
        tags = {"kernel": spec, "variant": variant, "input": counted["shape"]}
        ms.append(Measurement.from_samples("repeated_flops", "FLOP", [counted["repeated_flops"]], better="lower", **tags))
        ms.append(Measurement.from_samples("counted_flops", "FLOP", [counted["total_flops"]], **tags))
        for op in counted["ops"]:
            w = OpWork(op["op"], op["calls"], op["unique_keys"], op["total_flops"], op["unique_flops"])
            if w.repeat_factor <= 1.0 or w.repeated_flops <= 0:
                continue
            fs.append(
                Finding(
                    kind="repeated_work",
                    message=f"{variant}: {describe_repeat(w, counted['total_flops'])}",
                    severity="warning",
                    location=Location(file=origin or None, kernel=spec, variant=variant, span=w.op),
                    evidence={**w.to_dict(), "shape": counted["shape"]},
                    next_question=f"Compute {w.op} once per key (a prologue, or one tile covering the key): does removing the {w.repeat_factor:.3g}x repeat raise achieved bandwidth?",
                )
            )
    return ms, fs


def bench_feedback_parts(report: BenchReport) -> tuple[list[Measurement], list[Finding]]:
    ms: list[Measurement] = []
    fs: list[Finding] = []
    c = report.ceilings
    if c is not None:
        ms.append(Measurement.from_samples("ceiling_copy_bandwidth", "GB/s", [c.bandwidth_Bps / 1e9], better="higher", kernel=report.spec, component=f"device={c.device}"))
        for p, rate in c.flops_per_s.items():
            ms.append(Measurement.from_samples("ceiling_matmul", "GFLOP/s", [rate / 1e9], better="higher", kernel=report.spec, knob=f"precision={p}", component=f"device={c.device}"))
    for e in report.entries:
        tags = _tags(report.spec, e.variant, e.shape, e.dtype, e.precision)
        loc = Location(file=report.origin or None, kernel=report.spec, variant=e.variant, precision=e.precision)
        if e.status in ("refused", "failed"):
            fs.append(Finding(kind=f"bench_{e.status}", message=f"{e.variant} {e.precision} [{e.shape}]: {e.message}", severity="error", location=loc))
            continue
        if e.timing is None:
            continue
        ms.append(Measurement.from_samples("time", "s", e.timing.samples_s, better="lower", **tags))
        if e.timing.host_samples_s:
            ms.append(Measurement.from_samples("host_time", "s", e.timing.host_samples_s, better="lower", **tags))
        launch = launch_bound_finding(report.spec, report.origin, e)
        if launch is not None:
            fs.append(launch)
        rl = e.roofline
        if rl is None:
            continue
        if rl.achieved_Bps is not None:
            ms.append(Measurement.from_samples("achieved_bandwidth", "GB/s", [rl.achieved_Bps / 1e9], better="higher", **tags))
        if rl.achieved_flops_per_s is not None:
            ms.append(Measurement.from_samples("achieved_compute", "GFLOP/s", [rl.achieved_flops_per_s / 1e9], better="higher", **tags))
        if rl.fraction is not None:
            ms.append(Measurement.from_samples("fraction_of_ceiling", "ratio", [rl.fraction], better="higher", **tags))
            if rl.vs_copy_same_bytes is not None:
                ms.append(Measurement.from_samples("fraction_of_copy_same_bytes", "ratio", [rl.vs_copy_same_bytes], better="higher", **tags))
            fs.append(roofline_finding(e, rl, loc))
    return ms, fs


# A kernel within 3% of a plain copy of its own bytes moves them as fast as this size allows:
# the rest of its headroom is the size's floor, which no change inside the kernel removes.
AT_COPY_SPEED = 0.97


def roofline_finding(e: BenchEntry, rl: RooflinePoint, loc: Location) -> Finding:
    """Where a timed entry sits on the roofline, and for a memory-bound one with a same-bytes copy
    beside it, how much of its headroom is its own (what a change to the kernel can win back)."""
    assert e.timing is not None and rl.fraction is not None
    ceiling = "copy bandwidth" if rl.bound == "memory" else f"{e.precision} matmul rate"
    msg = f"{e.variant} {e.precision} [{e.shape}] is {rl.bound}-bound: {rl.fraction:.1%} of the {ceiling} measured in this run; headroom {rl.headroom:.1%}"
    evidence: dict[str, Any] = {**rl.to_dict(), "median_s": e.timing.median_s, "ci_low_s": e.timing.ci_low_s, "ci_high_s": e.timing.ci_high_s}
    if rl.bound == "memory":
        question = "What keeps it off the bandwidth ceiling: launch overhead, too few programs to fill the device, or repeated loads?"
    else:
        question = "Is the inner loop on the tensor cores (or the vector units), and is the tile large enough to reuse operands?"
    ratio, copy_frac = rl.vs_copy_same_bytes, rl.copy_fraction
    if ratio is not None and copy_frac is not None and rl.copy_same_bytes_s is not None:
        headroom = max(0.0, rl.headroom or 0.0)
        # The share of the kernel's time a copy of its bytes does not need, and the rest of the
        # headroom.  A copy measured above the ceiling (a disturbed ceiling) would make the first
        # exceed the headroom: it is capped there, so the two always add up to it.
        own = min(max(0.0, 1.0 - ratio), headroom)
        floor = headroom - own
        evidence.update(own_share=own, floor_share=floor)
        msg += (f"; a plain copy of the same bytes takes {rl.copy_same_bytes_s * 1e6:.4g} µs in this timing ({copy_frac:.1%} of the "
                f"ceiling): {own:.1%} of the kernel's time is its own, {floor:.1%} the floor every launch of this size pays")
        if ratio >= AT_COPY_SPEED:
            pace = f"within {1 - ratio:.1%} of a plain copy of them" if ratio < 1 else f"{ratio - 1:.1%} faster than a plain copy of them"
            question = (f"It moves its bytes {pace}: what is left is the size's floor. "
                        "Does the step get faster with fewer, larger launches: fused with its neighbours, more sequences per "
                        "launch, or the whole step replayed as a CUDA graph?")
        else:
            question = (f"A copy of the same bytes runs at {copy_frac:.1%} of the ceiling and the kernel at {rl.fraction:.1%}: "
                        "what holds the kernel back: loads that wait on other loads (an index before the data), too few "
                        "bytes in flight per SM (registers per thread cap the resident programs), or partial-width accesses?")
    if e.message:
        msg += f" ({e.message})"
    return Finding(kind="roofline", message=msg, severity="info", location=loc, evidence=evidence, next_question=question)


def launch_bound(t: Timing) -> bool:
    """The host's time per call exceeds the GPU's, beyond both 95% intervals.

    Non-overlapping intervals, not just medians, so run-to-run noise on a kernel whose
    launch and run take about as long does not flip the finding.
    """
    if t.host_median_s is None or t.host_ci_low_s is None:
        return False
    return t.host_median_s > t.median_s and t.host_ci_low_s > t.ci_high_s


def launch_bound_finding(spec: str, origin: str, e: BenchEntry) -> Finding | None:
    """A ``launch_bound`` finding for a timed GPU entry whose host time per call exceeds its GPU time."""
    t = e.timing
    if t is None or not launch_bound(t):
        return None
    host, gpu = t.host_median_s or 0.0, t.median_s
    return Finding(
        kind=LAUNCH_BOUND,
        message=(
            f"{e.variant} {e.precision} [{e.shape}] is launch-bound: the host spends {host * 1e6:.3g} µs per call "
            f"(Python and launch) against {gpu * 1e6:.3g} µs on the GPU, {host / gpu:.3g}x; called back to back it runs "
            f"at the host's pace and the GPU idles {1 - gpu / host:.0%} of the time"
        ),
        severity="warning",
        location=Location(file=origin or None, kernel=spec, variant=e.variant, precision=e.precision),
        evidence={
            "host_median_s": host, "host_ci_low_s": t.host_ci_low_s, "host_ci_high_s": t.host_ci_high_s,
            "gpu_median_s": gpu, "gpu_ci_low_s": t.ci_low_s, "gpu_ci_high_s": t.ci_high_s,
            "ratio": host / gpu, "host_overhead_s": host - gpu, "method": t.method, "shape": e.shape, "dtype": e.dtype,
        },
        next_question=(
            f"Does the call get faster by {(host - gpu) * 1e6:.3g} µs when the launch cost goes: capture it in a CUDA graph "
            "and replay it (time it with method cuda_graph), pass fewer launch arguments (precomputed strides and "
            "pointers, scalars packed into one tensor), or fuse the call's launches into one kernel?"
        ),
    )
