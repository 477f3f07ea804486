"""The engine's own state during a window: running and waiting requests, KV cache usage,
preemptions, prefix-cache hits, from its Prometheus gauges and counters.

The per-phase histograms (``prom.py``) say how long requests spent queued; these say why:
a queue with free batch slots and a full KV cache is a memory question, a queue with every
slot busy and KV to spare is a ``max_num_seqs`` question, and a preemption means requests
were evicted and recomputed.  Gauges are instantaneous, so the window's two scrapes cannot
see them: :class:`TelemetrySampler` polls ``/metrics`` in a thread while the window runs
and keeps mean and max of each gauge; counters are the difference of its first and last
scrape.

Names come from the engines' sources:

- vLLM (v1 engine, ``vllm/v1/metrics/loggers.py``): ``vllm:num_requests_running``,
  ``vllm:num_requests_waiting``, ``vllm:kv_cache_usage_perc`` (a fraction, 1 = full;
  before v1 ``vllm:gpu_cache_usage_perc``), ``vllm:num_preemptions_total``,
  ``vllm:prefix_cache_queries_total`` / ``vllm:prefix_cache_hits_total`` (tokens; before
  v1 ``vllm:gpu_prefix_cache_queries`` / ``..._hits``).
- SGLang (``sglang/srt/metrics/collector.py``): ``sglang:num_running_reqs``,
  ``sglang:num_queue_reqs``, ``sglang:token_usage`` (fraction of KV tokens in use),
  ``sglang:cache_hit_rate`` (a gauge), ``sglang:num_retracted_requests_total`` (a counter:
  SGLang calls a preemption a retraction; older releases only the gauge
  ``sglang:num_retracted_reqs``, the last batch's count, which is summed over the polls).
- refstack (``refstack/server/metrics.py``): ``refstack:num_requests_running``,
  ``refstack:num_requests_waiting``; it never preempts and has no prefix cache.
"""

from __future__ import annotations

import threading
from collections.abc import Mapping
from typing import Any
from urllib.parse import urlsplit

# signal -> (how label sets combine, names most recent first), per stack
GAUGES: dict[str, dict[str, tuple[str, ...]]] = {
    "vllm": {"running": ("vllm:num_requests_running",), "waiting": ("vllm:num_requests_waiting",),
             "kv_cache_usage": ("vllm:kv_cache_usage_perc", "vllm:gpu_cache_usage_perc")},
    "sglang": {"running": ("sglang:num_running_reqs",), "waiting": ("sglang:num_queue_reqs",),
               "kv_cache_usage": ("sglang:token_usage",), "prefix_cache_hit_rate": ("sglang:cache_hit_rate",),
               "retracted_now": ("sglang:num_retracted_reqs",)},
    "refstack": {"running": ("refstack:num_requests_running",), "waiting": ("refstack:num_requests_waiting",)},
}
COUNTERS: dict[str, dict[str, tuple[str, ...]]] = {
    "vllm": {"preemptions": ("vllm:num_preemptions_total", "vllm:num_preemptions"),
             "prefix_cache_queries": ("vllm:prefix_cache_queries_total", "vllm:gpu_prefix_cache_queries_total"),
             "prefix_cache_hits": ("vllm:prefix_cache_hits_total", "vllm:gpu_prefix_cache_hits_total")},
    "sglang": {"preemptions": ("sglang:num_retracted_requests_total",)},
    "refstack": {},
}
# A fraction of one shared pool is not a sum over engines: the fullest one is the one that queues.
_MAX_OVER_LABELS = frozenset({"kv_cache_usage", "prefix_cache_hit_rate"})


_WANTED = {n: sig for table in (GAUGES, COUNTERS) for sigs in table.values() for sig, names in sigs.items() for n in names}


def parse_values(text: str) -> dict[str, float]:
    """Every sample of a gauge or counter named above, summed over its label sets (fractions:
    the largest), by sample name (a counter's ``_total`` kept).

    A line scan, not a full exposition parser: it runs in a thread of the load generator's
    process every poll, and parsing all of vLLM's histograms there would take the client's
    GIL for milliseconds per poll."""
    out: dict[str, float] = {}
    for line in text.splitlines():
        if not line or line[0] == "#":
            continue
        brace = line.find("{")
        space = line.find(" ")
        end = brace if 0 <= brace < space or (brace >= 0 and space < 0) else space
        sig = _WANTED.get(line[:end]) if end > 0 else None
        if sig is None:
            continue
        rest = line[line.rfind("}") + 1:] if brace >= 0 else line[end:]
        try:
            v = float(rest.split()[0])
        except (IndexError, ValueError):
            continue
        name = line[:end]
        out[name] = max(out.get(name, v), v) if sig in _MAX_OVER_LABELS else out.get(name, 0.0) + v
    return out


def detect(values: Mapping[str, float]) -> str | None:
    for stack in ("vllm", "sglang", "refstack"):
        if any(n.startswith(stack + ":") for n in values):
            return stack
    return None


def _first(values: Mapping[str, float], names: tuple[str, ...]) -> tuple[str, float] | None:
    return next(((n, values[n]) for n in names if n in values), None)


def summarise(scrapes: list[dict[str, float]], interval_s: float) -> dict[str, Any]:
    """Mean and max of each gauge over the polls, each counter's change from first to last."""
    if not scrapes:
        return {"stack": None, "polls": 0, "note": "no scrape of /metrics succeeded during the window"}
    stack = next((s for s in map(detect, scrapes) if s), None)
    out: dict[str, Any] = {"stack": stack, "polls": len(scrapes), "interval_s": interval_s, "gauges": {}, "counters": {}}
    if stack is None:
        out["note"] = "no gauge or counter of a known engine (vLLM, SGLang, refstack) in /metrics"
        return out
    for sig, names in GAUGES[stack].items():
        seen = [hit for s in scrapes if (hit := _first(s, names)) is not None]
        if seen:
            vals = [v for _, v in seen]
            out["gauges"][sig] = {"metric": seen[0][0], "mean": sum(vals) / len(vals), "max": max(vals), "n": len(vals)}
    first, last = scrapes[0], scrapes[-1]
    for sig, names in COUNTERS[stack].items():
        a, b = _first(first, names), _first(last, names)
        if a is not None and b is not None:
            # A counter that fell means the server restarted: no delta rather than a negative one.
            out["counters"][sig] = {"metric": b[0], "delta": b[1] - a[1] if b[1] >= a[1] else None}
    q, h = out["counters"].get("prefix_cache_queries"), out["counters"].get("prefix_cache_hits")
    if q and h and q["delta"] and h["delta"] is not None:
        out["prefix_cache_hit_rate"] = h["delta"] / q["delta"]
    elif "prefix_cache_hit_rate" in out["gauges"]:
        out["prefix_cache_hit_rate"] = out["gauges"]["prefix_cache_hit_rate"]["mean"]
    retracted = out["gauges"].get("retracted_now")
    if "preemptions" not in out["counters"] and retracted:
        # Older SGLang: only the last batch's retractions, a gauge; its max says whether any happened.
        out["counters"]["preemptions"] = {"metric": retracted["metric"], "delta": retracted["max"], "from_gauge": True}
    return out


class TelemetrySampler:
    """Polls ``metrics_url`` every ``interval_s`` in a daemon thread between ``start`` and ``stop``."""

    def __init__(self, metrics_url: str, headers: Mapping[str, str] | None = None, interval_s: float = 0.5) -> None:
        self.url, self.headers, self.interval_s = metrics_url, dict(headers or {}), interval_s
        self._scrapes: list[dict[str, float]] = []
        self._errors = 0
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._run, name="telemetry-sampler", daemon=True)

    def _poll(self, client: Any) -> None:
        try:
            resp = client.get(self.url, headers=self.headers)
            if resp.status_code == 200:
                self._scrapes.append(parse_values(resp.text))
                return
        except Exception:  # noqa: BLE001 - a missed poll is a gap in the series, never a failed window
            pass
        self._errors += 1

    def _run(self) -> None:
        import httpx

        with httpx.Client(timeout=5.0, trust_env=False) as client:
            self._poll(client)
            while not self._stop.wait(self.interval_s):
                self._poll(client)
            self._poll(client)  # the last one, after the window: the counters' end

    def start(self) -> TelemetrySampler:
        self._thread.start()
        return self

    def stop(self) -> dict[str, Any]:
        self._stop.set()
        self._thread.join(10.0)
        out = summarise(list(self._scrapes), self.interval_s)
        out["failed_polls"] = self._errors
        return out


def sample_during(metrics_url: str | None, headers: Mapping[str, str] | None = None,
                  base_url: str | None = None) -> TelemetrySampler | None:
    """A started sampler, or None without a metrics URL.  ``headers`` (credentials) go only to
    a metrics URL on ``base_url``'s own origin, as the window's own scrapes do."""
    if not metrics_url:
        return None
    a, b = urlsplit(metrics_url), urlsplit(base_url or "")
    if (a.scheme, a.netloc) != (b.scheme, b.netloc):
        headers = None
    sampler = TelemetrySampler(metrics_url, headers)
    sampler.start()
    return sampler
