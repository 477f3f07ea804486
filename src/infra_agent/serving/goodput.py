"""Goodput search: the highest request rate at which a server still meets the SLO.

vLLM's auto_tune asks this of each configuration: at which request rate does the p99
latency stay under the limit?  It steps the rate down one request per second from the
throughput, on one run per rate.  Here the rate is bisected (geometrically: rates span
orders of magnitude) between a rate that meets the SLO and one that misses it, and each
rate is decided the way the loop decides an absolute criterion: every limited percentile
(``p99_ttft_ms`` ...) gets the judge's t-interval of its geometric mean over the rate's
windows (``stats.intervals.t_interval_of_values``, decided by ``stats.decision.decide``):

- **meets**: every limit's interval lies at or under it;
- **misses**: some limit's interval lies wholly above it, or requests failed, or the
  window failed (a server that falls over at a rate does not serve it);
- **unclear**: an interval straddles a limit: one more window, up to ``max_windows``;
  a rate still unclear then is not shown to meet, and the bisection treats it as a miss
  (the row says ``unclear``).

Beside the decision, each rate records vLLM's goodput (``request_goodput``: requests
meeting every limit per second of the window) and the share of requests meeting every
limit.  The search needs only ``measure(rate, window_index) -> result`` (one window's
vLLM-style result dict), so it runs against any server; ``goodput_run.py`` drives it
over a workspace's configurations.
"""

from __future__ import annotations

import math
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any, Literal

from infra_agent.serving.metrics import percentile_key
from infra_agent.stats.bootstrap import RatioCI
from infra_agent.stats.decision import Gate, decide
from infra_agent.stats.intervals import t_interval_of_values
from infra_agent.workspace.goodput import GoodputSearch

Decision = Literal["meets", "misses", "unclear"]
Measure = Callable[[float, int], dict[str, Any]]
Say = Callable[[str], None]


@dataclass
class RateTrial:
    """One request rate: its windows' numbers, each limit's interval and the decision."""

    rate: float
    decision: Decision = "unclear"
    why: str = ""
    checks: list[dict[str, Any]] = field(default_factory=list)
    windows: list[dict[str, Any]] = field(default_factory=list)  # a summary per window

    def as_dict(self) -> dict[str, Any]:
        goodputs = [w["request_goodput"] for w in self.windows if isinstance(w.get("request_goodput"), (int, float))]
        shares = [w["slo_share"] for w in self.windows if isinstance(w.get("slo_share"), (int, float))]
        return {"rate": self.rate, "decision": self.decision, "why": self.why, "checks": self.checks,
                "n_windows": len(self.windows), "request_goodput": _interval(goodputs),
                "slo_share": sum(shares) / len(shares) if shares else None, "windows": self.windows}


def _interval(values: list[float], confidence: float = 0.95) -> dict[str, Any] | None:
    """Mean and the judge's t-interval (of the geometric mean) of positive per-window values."""
    if not values:
        return None
    if min(values) <= 0 or len(values) < 2:
        mean = sum(values) / len(values)
        return {"mean": mean, "low": None, "high": None, "n": len(values)}
    centre, low, high = t_interval_of_values(values, confidence=confidence)
    return {"mean": sum(values) / len(values), "geomean": centre, "low": low, "high": high, "n": len(values)}


def window_summary(result: dict[str, Any], limits: dict[str, float], pct: float) -> dict[str, Any]:
    """What a rate's decision reads from one window's result, kept small for the sweep's JSON."""
    completed, failed = int(result.get("completed", 0) or 0), int(result.get("failed", 0) or 0)
    duration = result.get("duration")
    goodput = result.get("request_goodput")
    share = None
    if isinstance(goodput, (int, float)) and isinstance(duration, (int, float)) and completed + failed:
        share = goodput * duration / (completed + failed)  # vLLM counts requests meeting every SLO
    out = {"ok": bool(result.get("ok", True)), "completed": completed, "failed": failed, "duration": duration,
           "request_throughput": result.get("request_throughput"), "request_goodput": goodput, "slo_share": share,
           "prompt_seed": (result.get("prompts") or {}).get("seed") if isinstance(result.get("prompts"), dict) else None}
    for metric in limits:
        key = f"{percentile_key(pct)}_{metric}_ms"
        out[key] = result.get(key)
    tel = result.get("engine_telemetry")
    if isinstance(tel, dict) and tel.get("stack"):
        # What held requests back at this rate, in the engine's own words (telemetry.py).
        g, c = tel.get("gauges", {}), tel.get("counters", {})
        out["engine"] = {"running_max": (g.get("running") or {}).get("max"), "waiting_mean": (g.get("waiting") or {}).get("mean"),
                         "waiting_max": (g.get("waiting") or {}).get("max"),
                         "kv_cache_usage_max": (g.get("kv_cache_usage") or {}).get("max"),
                         "preemptions": (c.get("preemptions") or {}).get("delta")}
    if not out["ok"]:
        out["error"] = str(result.get("error", "run failed"))[:500]
    return out


def judge_rate(windows: list[dict[str, Any]], search: GoodputSearch) -> tuple[Decision, str, list[dict[str, Any]]]:
    """Decide one rate from its windows' summaries: (decision, why, one check per limit)."""
    bad = next((w for w in windows if not w["ok"]), None)
    if bad is not None:
        return "misses", f"a window failed: {bad.get('error', '')}", []
    failed = sum(w["failed"] for w in windows)
    if failed:
        return "misses", f"{failed} request(s) failed", []
    checks: list[dict[str, Any]] = []
    for metric, limit in search.slo.limits().items():
        key = f"{percentile_key(search.percentile)}_{metric}_ms"
        vals = [w.get(key) for w in windows]
        if any(not isinstance(v, (int, float)) or v <= 0 for v in vals):
            checks.append({"metric": key, "limit_ms": limit, "outcome": "fail", "values": vals,
                           "message": f"{key} missing from a window (no request completed)"})
            continue
        centre, low, high = t_interval_of_values([float(v) for v in vals], confidence=search.confidence)
        ci = RatioCI(ratio=centre, low=low, high=high, confidence=search.confidence, stat="geomean",
                     n_candidate=len(vals), n_baseline=len(vals), paired=False, n_boot=0)
        d = decide(Gate(key, "<=", limit), ci)
        checks.append({"metric": key, "limit_ms": limit, "outcome": d.outcome, "geomean": centre, "low": low,
                       "high": high, "values": vals, "more_samples": d.more_samples, "message": d.message})
    if any(c["outcome"] == "fail" for c in checks):
        worst = next(c for c in checks if c["outcome"] == "fail")
        return "misses", f"{worst['metric']} above {worst['limit_ms']:g} ms ({worst['message']})", checks
    if all(c["outcome"] == "pass" for c in checks):
        return "meets", "every limit's interval lies under it", checks
    open_ = [c["metric"] for c in checks if c["outcome"] != "pass"]
    return "unclear", f"the interval of {', '.join(open_)} straddles its limit", checks


def _check_text(checks: list[dict[str, Any]]) -> str:
    parts = []
    for c in checks:
        if c.get("low") is not None:
            parts.append(f"{c['metric']} {c['geomean']:.1f} [{c['low']:.1f}, {c['high']:.1f}] vs {c['limit_ms']:g}")
    return "; ".join(parts)


def try_rate(measure: Measure, rate: float, search: GoodputSearch, say: Say, label: str = "") -> RateTrial:
    """Measure ``rate`` window by window until the judge decides it (or ``max_windows``)."""
    trial = RateTrial(rate=rate)
    limits = search.slo.limits()
    while True:
        result = measure(rate, len(trial.windows))
        trial.windows.append(window_summary(result, limits, search.percentile))
        n = len(trial.windows)
        failed_now = not trial.windows[-1]["ok"] or trial.windows[-1]["failed"] > 0
        if n < search.min_windows and not failed_now:
            continue
        trial.decision, trial.why, trial.checks = judge_rate(trial.windows, search)
        if trial.decision != "unclear" or n >= search.max_windows:
            break
        say(f"goodput: {label}rate {rate:.3g} req/s unclear after {n} windows ({_check_text(trial.checks)}): one more")
    say(f"goodput: {label}rate {rate:.3g} req/s {trial.decision} after {len(trial.windows)} windows"
        + (f" ({_check_text(trial.checks)})" if trial.checks else f" ({trial.why})"))
    return trial


def search_goodput(measure: Measure, search: GoodputSearch, say: Say = lambda _s: None, label: str = "") -> dict[str, Any]:
    """Bisect the request rate; the result's ``goodput_rps`` is the highest rate shown to meet
    the SLO (None when even ``rate_min`` does not), ``bracket`` the [meets, misses] pair the
    true limit lies between, and ``rates`` every rate tried in order."""
    trials: list[RateTrial] = []
    bound: dict[str, Any] | None = None
    hi = search.rate_max
    if hi is None:
        # auto_tune's first run: every request at once gives the throughput the server can
        # reach; no rate above it can be sustained.
        first = measure(math.inf, 0)
        bound = window_summary(first, search.slo.limits(), search.percentile)
        thr = bound.get("request_throughput")
        hi = float(thr) if bound["ok"] and isinstance(thr, (int, float)) and thr > 0 else None
        say(f"goodput: {label}all requests at once: {thr if thr is None else f'{thr:.3g}'} req/s; the search's top"
            + ("" if hi is None else f" is {hi:.3g} req/s"))
        if hi is None:
            return _outcome(None, None, None, trials, bound, f"the window at an unbounded rate failed: {bound.get('error', '')}")
        if hi <= search.rate_min:
            hi = search.rate_min * 2  # the server is slower than rate_min: still bracket it
    top = try_rate(measure, hi, search, say, label)
    trials.append(top)
    if top.decision == "meets":
        return _outcome(hi, hi, None, trials, bound, "the highest rate tried meets the SLO: raise rate_max to find the limit")
    low = try_rate(measure, search.rate_min, search, say, label)
    trials.append(low)
    if low.decision != "meets":
        return _outcome(None, None, search.rate_min, trials, bound, f"even rate_min {search.rate_min:g} req/s does not meet the SLO")
    lo = search.rate_min
    while (hi - lo) / hi > search.tolerance and len(trials) < search.max_rates:
        mid = math.sqrt(lo * hi)
        t = try_rate(measure, mid, search, say, label)
        trials.append(t)
        if t.decision == "meets":
            lo = mid
        else:
            hi = mid
    why = (f"bracket [{lo:.3g}, {hi:.3g}] req/s within tolerance {search.tolerance:g}" if (hi - lo) / hi <= search.tolerance
           else f"stopped after max_rates={search.max_rates} rates with bracket [{lo:.3g}, {hi:.3g}] req/s")
    return _outcome(lo, lo, hi, trials, bound, why)


def _outcome(goodput: float | None, lo: float | None, hi: float | None, trials: list[RateTrial],
             bound: dict[str, Any] | None, why: str) -> dict[str, Any]:
    at = next((t for t in trials if lo is not None and t.rate == lo), None)
    thr = (bound or {}).get("request_throughput")
    return {"goodput_rps": goodput, "bracket": [lo, hi], "stopped": why,
            # The ceiling: what the server reached with every request at once (the search's top when measured).
            "max_throughput_rps": thr if isinstance(thr, (int, float)) else None,
            "of_max_throughput": goodput / thr if goodput is not None and isinstance(thr, (int, float)) and thr > 0 else None,
            "request_goodput_at": at.as_dict()["request_goodput"] if at else None,
            "checks_at": at.checks if at else [],
            "unbounded_window": bound, "rates": [t.as_dict() for t in trials],
            "windows": sum(len(t.windows) for t in trials) + (1 if bound else 0)}
