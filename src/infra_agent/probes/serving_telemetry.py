"""Findings from the engine's own telemetry and from the server's CPU, for the serving probe.

Each window runs with a :class:`WindowWatch`: the engine's gauges polled and its counters
diffed (``serving/telemetry.py``: vLLM's, SGLang's and refstack's names), and the
server's threads' CPU against their demand (``server_cpu.py``).  Both land in the
window's result (``engine_telemetry``, ``server_cpu``); :func:`add_telemetry` turns the
windows of a scenario into measurements and findings, in the same vocabulary on every
engine:

- ``server_cpu_starved`` (warning): a server process's threads waited for a CPU for
  ``>= STARVED_WAIT_SHARE`` of their runnable time.  It goes before ``bursty_stream``
  and ``client_server_ttft_gap``: tokens that arrive late or in bursts from a server that
  could not run are a CPU problem, not a network one.
- ``preemptions`` (warning): requests evicted and recomputed (vLLM's preemptions,
  SGLang's retractions) during the window.
- ``kv_cache_full`` (warning): KV cache usage reached ``KV_FULL`` while requests waited.
- ``queue_dominates_ttft`` (the serving probe's) gains the engine's running and waiting
  counts as evidence, and says which of batch slots and KV memory was the limit.
"""

from __future__ import annotations

from typing import Any

from infra_agent.feedback import Feedback, Finding, Location, Measurement, Summary
from infra_agent.probes.server_cpu import ServerCpuWatch
from infra_agent.serving.telemetry import TelemetrySampler, sample_during
from infra_agent.vocabulary import FindingKind

# The measurements this module adds (the serving probe's planner scope names them).
TELEMETRY_METRICS = ("server_requests_running", "server_requests_waiting", "server_kv_cache_usage_max", "server_preemptions",
                     "server_prefix_cache_hit_rate", "server_cpu_wait_share")
STARVED_WAIT_SHARE = 0.3  # of a process's runnable time spent waiting for a CPU
_MIN_DEMAND = 0.1  # cores: a process that hardly wants to run cannot be starved in any useful sense
KV_FULL = 0.95
# Findings that explain late tokens by the network or the HTTP path: the starvation finding goes first.
_NETWORK_KINDS = (FindingKind.BURSTY_STREAM, FindingKind.CLIENT_SERVER_TTFT_GAP)


class WindowWatch:
    """A context around one window: the samplers run inside it, and stop on the way out
    whatever happens (a window that raised leaves no polling thread behind); :meth:`into`
    then stores what they saw in the window's result."""

    def __init__(self, target: Any) -> None:
        self.target = target
        self.telemetry: TelemetrySampler | None = None
        self.cpu: ServerCpuWatch | None = None
        self.seen: dict[str, Any] = {}

    def __enter__(self) -> WindowWatch:
        self.telemetry = sample_during(getattr(self.target, "metrics_url", None),
                                       getattr(self.target, "request_headers", None), getattr(self.target, "url", None))
        cpu = ServerCpuWatch(self.target)
        self.cpu = cpu.start() if cpu.available else None
        return self

    def __exit__(self, *exc: object) -> None:
        if self.telemetry is not None:
            self.seen["engine_telemetry"] = self.telemetry.stop()
        if self.cpu is not None:
            self.seen["server_cpu"] = self.cpu.stop()

    def into(self, result: dict[str, Any]) -> dict[str, Any]:
        result.update(self.seen)
        return result


def _m(name: str, unit: str, vals: list[float], scenario: str, component: str = "engine") -> Measurement:
    return Measurement(name=name, unit=unit, samples=vals, summary=Summary.of(vals), better="lower",
                       tags={"component": component, "scenario": scenario})


def _before_network(fb: Feedback, finding: Finding) -> int:
    """Insert ``finding`` before the first network-side finding (or last); its index."""
    at = next((i for i, f in enumerate(fb.findings) if f.kind in _NETWORK_KINDS), len(fb.findings))
    fb.findings.insert(at, finding)
    return at


def _starved(runs: list[dict[str, Any]]) -> dict[str, Any] | None:
    """The most starved server process over the windows (pooled run and wait), or None."""
    pooled: dict[int, dict[str, Any]] = {}
    for r in runs:
        cpu = r.get("server_cpu") or {}
        for p in cpu.get("processes", []):
            agg = pooled.setdefault(p["pid"], {**p, "run_s": 0.0, "wait_s": 0.0, "seconds": 0.0})
            agg["run_s"] += p["run_s"]
            agg["wait_s"] += p["wait_s"]
            agg["seconds"] += float(cpu.get("seconds") or 0.0)
    worst = None
    for p in pooled.values():
        if p["seconds"] <= 0 or p["run_s"] + p["wait_s"] <= 0:
            continue
        p["cores_used"], p["cores_demanded"] = p["run_s"] / p["seconds"], (p["run_s"] + p["wait_s"]) / p["seconds"]
        p["wait_share"] = p["wait_s"] / (p["run_s"] + p["wait_s"])
        if p["cores_demanded"] < _MIN_DEMAND or p["wait_share"] < STARVED_WAIT_SHARE:
            continue
        # The API server first: it is the one that streams the tokens.
        if worst is None or (p["api_server"], p["wait_share"]) > (worst["api_server"], worst["wait_share"]):
            worst = p
    return worst


def _cpu_finding(fb: Feedback, name: str, runs: list[dict[str, Any]]) -> None:
    shares = [max((p["wait_share"] for p in (r.get("server_cpu") or {}).get("processes", [])
                   if p["cores_demanded"] >= _MIN_DEMAND), default=0.0) for r in runs if r.get("server_cpu", {}).get("processes")]
    if shares:
        fb.measurements.append(_m("server_cpu_wait_share", "share", shares, name, component="server"))
    p = _starved(runs)
    if p is None:
        return
    who = "the API server" if p["api_server"] else "a server process"
    finding = Finding(
        kind=FindingKind.SERVER_CPU_STARVED, severity="warning",
        message=(f"{who} ({p['name']}, pid {p['pid']}) got {p['cores_used']:.2f} of the {p['cores_demanded']:.2f} cores its "
                 f"{p['threads']} threads asked for in {name}: {p['wait_share']:.0%} of their runnable time went waiting for a "
                 f"CPU ({p['cpus_allowed']} CPU(s) allowed); late or bunched tokens and time outside the engine can be this "
                 "wait, before any network cause"),
        location=Location(component="runtime"),
        evidence={k: p[k] for k in ("pid", "name", "api_server", "threads", "cpus_allowed", "cores_used", "cores_demanded",
                                    "wait_share", "run_s", "wait_s", "seconds")} | {"scenario": name},
        next_question=("Is the server pinned to too few CPUs, or does another process (a CPU hog, the load generator, a "
                       "second server) share its cores? Give it cores of its own before suspecting the network."),
    )
    at = _before_network(fb, finding)
    for f in fb.findings[at + 1:]:
        if f.kind in _NETWORK_KINDS and f.evidence.get("scenario", name) == name:
            # The network question stays, after the one the CPU numbers already answer.
            f.evidence["server_cpu_wait_share"] = p["wait_share"]
            f.next_question = (f"First: the server waited for a CPU {p['wait_share']:.0%} of its runnable time "
                               "(server_cpu_starved); with cores of its own, does this remain? " + (f.next_question or ""))


def _engine(fb: Feedback, name: str, runs: list[dict[str, Any]]) -> None:
    tel = [r["engine_telemetry"] for r in runs if isinstance(r.get("engine_telemetry"), dict) and r["engine_telemetry"].get("stack")]
    if not tel:
        return
    gauge = {sig: [t["gauges"][sig] for t in tel if sig in t["gauges"]] for sig in ("running", "waiting", "kv_cache_usage")}
    for sig, unit in (("running", "requests"), ("waiting", "requests")):
        if gauge[sig]:
            fb.measurements.append(_m(f"server_requests_{sig}", unit, [g["mean"] for g in gauge[sig]], name))
    if gauge["kv_cache_usage"]:
        fb.measurements.append(_m("server_kv_cache_usage_max", "fraction", [g["max"] for g in gauge["kv_cache_usage"]], name))
    hits = [t["prefix_cache_hit_rate"] for t in tel if isinstance(t.get("prefix_cache_hit_rate"), (int, float))]
    if hits:
        fb.measurements.append(Measurement(name="server_prefix_cache_hit_rate", unit="fraction", samples=hits,
                                           summary=Summary.of(hits), better="higher", tags={"component": "engine.cache", "scenario": name}))
    pre = [t["counters"]["preemptions"] for t in tel if (t["counters"].get("preemptions") or {}).get("delta") is not None]
    if pre:
        fb.measurements.append(_m("server_preemptions", "requests", [float(c["delta"]) for c in pre], name))
    stack = tel[0]["stack"]
    n_pre = sum(c["delta"] for c in pre)
    if n_pre > 0:
        _before_network(fb, Finding(
            kind=FindingKind.PREEMPTIONS, severity="warning",
            message=f"{n_pre:g} request(s) preempted in {name} ({pre[0]['metric']}): evicted from the KV cache and recomputed",
            location=Location(component="engine.cache"),
            evidence={"preemptions": n_pre, "metric": pre[0]["metric"], "stack": stack, "scenario": name},
            next_question="Is the KV cache too small for the batch (memory for KV, max model length, KV dtype), or the running-request cap too high for it?",
        ))
    kv_max = max((g["max"] for g in gauge["kv_cache_usage"]), default=None)
    waiting_max = max((g["max"] for g in gauge["waiting"]), default=0.0)
    if kv_max is not None and kv_max >= KV_FULL and waiting_max > 0:
        _before_network(fb, Finding(
            kind=FindingKind.KV_CACHE_FULL, severity="warning",
            message=f"the KV cache reached {kv_max:.0%} ({gauge['kv_cache_usage'][0]['metric']}) while up to {waiting_max:g} requests waited in {name}",
            location=Location(component="engine.cache"),
            evidence={"kv_cache_usage_max": kv_max, "waiting_max": waiting_max, "stack": stack, "scenario": name},
            next_question="Would more KV memory (a larger cache share, a smaller KV dtype, a shorter max length) let waiting requests in?",
        ))
    _queue_evidence(fb, name, gauge, kv_max)


def _queue_evidence(fb: Feedback, name: str, gauge: dict[str, list[dict[str, Any]]], kv_max: float | None) -> None:
    """Tell the queue finding which limit held requests back: batch slots or KV memory."""
    q = next((f for f in fb.findings if f.kind == FindingKind.QUEUE_DOMINATES_TTFT and f.evidence.get("scenario") == name), None)
    if q is None or not gauge["running"]:
        return
    running_max = max(g["max"] for g in gauge["running"])
    q.evidence.update({"running_max": running_max, "running_mean": sum(g["mean"] for g in gauge["running"]) / len(gauge["running"]),
                       "waiting_mean": sum(g["mean"] for g in gauge["waiting"]) / len(gauge["waiting"]) if gauge["waiting"] else None,
                       "kv_cache_usage_max": kv_max})
    if kv_max is not None and kv_max >= KV_FULL:
        q.evidence["limit"] = "kv_cache"
        q.location = Location(component="engine.cache", span="queue")  # attribution then points at the cache's knobs
        q.next_question = "The KV cache was full while requests waited: would more KV memory, not more running slots, cut the queue?"
    else:
        q.evidence["limit"] = "running_slots"
        q.message += f"; at most {running_max:g} ran at once" + (f" with the KV cache at most {kv_max:.0%} full" if kv_max is not None else "")


def add_telemetry(fb: Feedback, name: str, runs: list[dict[str, Any]]) -> None:
    """Measurements and findings from the windows' ``engine_telemetry`` and ``server_cpu``."""
    ok = [r for r in runs if r.get("ok", True)]
    _engine(fb, name, ok)
    _cpu_finding(fb, name, ok)
