"""``ServingProbe``: the e2e tier, a serving benchmark turned into Feedback.

Its typed config is :class:`ServingConfig` (every key optional).  The target is, in
order: ``ctx.target`` (a server the caller keeps running, e.g. the executor's A/B
pair), ``url`` (an already-running server), or the workspace target launched with the
knobs for this run.

Client metrics and the server's per-phase histogram deltas go side by side, each tagged
with the scenario and the knob values, so a finding can point at the phase (queue,
prefill, decode) that moved.  Each window also records the machine's load while it ran
(``target/host_load.py``): ``result["host"]``, ``meta["host"]`` and the
``host_foreign_cpu`` / ``host_load_1m`` measurements.  Window ``i`` of a run sends prompt
set ``ctx.prompt_set + i`` (``serving/prompt_sets.py``); ``meta["prompts"]`` records each
window's seed.
"""

from __future__ import annotations

import json
from contextlib import nullcontext
from typing import Any, ClassVar

from pydantic import Field

from infra_agent.errors import InfraAgentError
from infra_agent.feedback import (
    Artifact,
    Feedback,
    Finding,
    Location,
    Measurement,
    Summary,
    Tier,
)
from infra_agent.probes.base import Probe, ProbeConfig, ProbeContext
from infra_agent.probes.serving_encode import encode_findings
from infra_agent.probes.serving_telemetry import (
    TELEMETRY_METRICS,
    WindowWatch,
    add_telemetry,
)
from infra_agent.serving.greedy_text import DEFAULT_TOKENS, answers_for
from infra_agent.serving.metrics import request_samples
from infra_agent.serving.runner import default_log_dir, run_on_target
from infra_agent.target import open_target
from infra_agent.target.host_load import HostSampler, host_summary, target_processes
from infra_agent.trace.loop_stall_finding import NAGLE_QUESTION
from infra_agent.vocabulary import FindingKind
from infra_agent.workspace.models import Scenario, metric_direction

_DEFAULT_RESULT_METRICS = ("total_token_throughput", "median_ttft_ms", "p99_ttft_ms", "median_tpot_ms",
                           "p99_tpot_ms", "median_e2el_ms", "p99_e2el_ms")
_MAX_SAMPLES = 5000  # per measurement kept in Feedback; the summary uses all of them
# A gap this short between two content chunks means they came out of one read: no
# engine produces tokens 0.5 ms apart while its TPOT is many times that.
_BURST_GAP_MS = 0.5
_BURST_SHARE = 0.3  # this share of such gaps at a TPOT >= 10x the gap is reported


def _burst_delivery(ok: list[dict[str, Any]], phases: dict[str, list[float]]) -> dict[str, Any] | None:
    """Evidence that streamed chunks arrive in bursts, or None when they arrive spread out.

    The yardstick is how long a token takes to make: the server's own TPOT when it
    exports one, else each request's E2E latency over its output tokens.  The client's
    TPOT cannot serve: a held-back stream shrinks it along with the gaps."""
    gaps = [g for r in ok for g in request_samples(r, "itl")]
    if len(gaps) < 20:
        return None
    if phases.get("tpot"):
        per_token, source = sum(phases["tpot"]) / len(phases["tpot"]), "server TPOT"
    else:
        rates = [e / n for r in ok for e, n, err in zip(r["e2els"], r["output_lens"], r["errors"], strict=True) if not err and n > 0 and e is not None]
        if not rates:
            return None
        per_token, source = 1e3 * sum(rates) / len(rates), "client E2E latency / output tokens"
    share = sum(g < _BURST_GAP_MS for g in gaps) / len(gaps)
    if share < _BURST_SHARE or per_token < 10 * _BURST_GAP_MS:
        return None
    cpu = [float(r["client_cpu_share"]) for r in ok if isinstance(r.get("client_cpu_share"), (int, float))]
    return {"short_share": share, "per_token_ms": per_token, "per_token_from": source, "gaps": len(gaps),
            # One core's worth is the client's limit (an asyncio loop runs on one thread).
            "client_cpu_share": max(cpu) if cpu else None}


class _UrlTarget:
    """A plain URL seen through the ``RunningTarget`` surface (nothing to watch)."""

    def __init__(self, url: str, metrics_url: str | None, model: str | None) -> None:
        self.url, self.metrics_url, self.model, self.log_path, self.pid = url.rstrip("/"), metrics_url, model, None, None

    def check_alive(self) -> None:
        return None

    def log_tail(self, n: int = 40) -> str:
        return ""


def _changed(values: dict[str, Any], ws: Any) -> dict[str, Any]:
    """Knob values that differ from the workspace defaults (all of them without a workspace)."""
    if ws is None:
        return values
    return {k: v for k, v in values.items() if k not in ws.knobs or ws.knobs[k].default != v}


def _measure(name: str, unit: str, samples: list[float], better: str | None, **tags: str) -> Measurement:
    kept = samples if len(samples) <= _MAX_SAMPLES else samples[:: len(samples) // _MAX_SAMPLES + 1]
    return Measurement(name=name, unit=unit, samples=kept, summary=Summary.of(samples), better=better, tags=tags)  # type: ignore[arg-type]


def summarise_windows(fb: Feedback, name: str, runs: list[dict[str, Any]], knobs: dict[str, Any], ws: Any,
                      queue_share: float = 0.5, result_metrics: list[str] | None = None) -> None:
    """Add the serving probe's measurements and findings for ``runs`` (the result dicts of one
    scenario's windows) to ``fb``: per-request latencies, throughputs, server phases, one
    sample per window of each result key, and the queue/prefill/burst findings.  Other
    probes that run serving windows (the timeline probe) use it so the judge reads the
    same measurements from them."""
    ServingProbe._summarise(fb, name, runs, _changed(knobs, ws), queue_share)
    add_telemetry(fb, name, runs)
    ServingProbe._per_window(fb, name, runs, result_metrics)
    _host_measurements(fb, name, runs)


def _host_measurements(fb: Feedback, name: str, runs: list[dict[str, Any]]) -> None:
    """The machine's load, one sample per window (``result["host"]``), pooled like every other
    measurement, so a verdict shows the noise it was made under."""
    ok = [r["host"] for r in runs if r.get("ok", True) and isinstance(r.get("host"), dict)]
    for metric, key, unit in (("host_foreign_cpu", "foreign_cpu", "cores"), ("host_load_1m", "loadavg_end", "load")):
        vals = [float(h[key]) for h in ok if isinstance(h.get(key), (int, float))]
        if vals:
            fb.measurements.append(_measure(metric, unit, vals, "lower", component="runtime", scenario=name))


class ServingConfig(ProbeConfig):
    """What to send and where; every key is optional."""

    scenarios: list[str] | None = Field(None, description="workspace scenario names to run (default: every scenario)")
    scenario: Scenario | None = Field(None, description="an inline scenario, run as 'inline'")
    url: str | None = Field(None, description="benchmark this already-running server instead of launching the target")
    metrics_url: str | None = None
    model: str | None = None
    knobs: dict[str, Any] = Field(default_factory=dict, description="knob overrides on top of the context's knobs")
    repeats: int = Field(1, ge=1, le=100, description="measured windows per scenario; throughput samples are per window")
    percentiles: list[float] = Field(default_factory=lambda: [50.0, 90.0, 99.0])
    queue_share: float = Field(0.5, gt=0, le=1, description="queue/TTFT share above which queueing is reported")
    greedy_tokens: int = Field(DEFAULT_TOKENS, ge=0, le=256,
                               description="greedy tokens per prompt of the fixed probe set asked once per server (the "
                                           "judge holds a change to its parent's text); 0: not asked")
    result_metrics: list[str] | None = Field(
        None, description="result keys reported once per window (what criteria name, e.g. p99_ttft_ms); "
                          "default: total_token_throughput and the median and p99 of ttft, tpot and e2el")


class ServingProbe(Probe):
    name: ClassVar[str] = "serving"
    base_tier: ClassVar[Tier] = Tier.e2e
    Config: ClassVar[type[ProbeConfig]] = ServingConfig
    components: ClassVar[tuple[str, ...]] = ("client", "server", "engine", "model", "runtime", "kv_transfer", "comm")
    # Server-side phase histograms: the queue, prefill and decode intervals.
    locality: ClassVar[tuple[str, ...]] = ("span",)

    @classmethod
    def measures(cls, metric: str) -> bool:
        return (metric_direction(metric) is not None or metric in ("ttft_ms", "tpot_ms", "itl_ms", "e2el_ms")
                or (metric.startswith("server_") and metric.endswith("_ms")) or metric in ("host_foreign_cpu", "host_load_1m")
                or metric in TELEMETRY_METRICS)

    def run(self, config: Any, ctx: ProbeContext) -> Feedback:
        cfg: ServingConfig = self.parse_config(config)  # type: ignore[assignment]
        fb = Feedback(probe=self.name, tier=self.tier(cfg), scope=self.scope)
        ws = ctx.workspace
        try:
            plan = self._plan(cfg, ws)
        except InfraAgentError as exc:
            fb.ok, fb.error = False, str(exc)
            return fb
        knobs = {**ctx.knobs, **cfg.knobs}
        repeats = cfg.repeats
        pcts = list(cfg.percentiles)
        ctx.workdir.mkdir(parents=True, exist_ok=True)
        windows: list[dict[str, Any]] = []  # the machine's load per window, for meta["host"]
        first_set = ctx.prompt_set or 0
        try:
            if ctx.target is not None:
                values: dict[str, Any] = knobs
                opener: Any = nullcontext(ctx.target)
            elif cfg.url:
                values = knobs
                opener = nullcontext(_UrlTarget(cfg.url, cfg.metrics_url, cfg.model))
            else:
                if ws is None:
                    raise InfraAgentError("the serving probe needs a workspace target, a 'url' or a running target to measure")
                values = ws.resolve_knobs(knobs)
                opener = open_target(ws, values, default_log_dir(ws))
            with opener as target:
                if target.log_path:
                    fb.artifacts.append(Artifact(kind="log", path=str(target.log_path), description="server log"))
                own = target_processes(target)
                if cfg.greedy_tokens:
                    # The answers behind the speed, once per server (serving/greedy_text.py).
                    fb.meta["greedy"] = answers_for(target, cfg.greedy_tokens)
                for name, sc in plan:
                    runs: list[dict[str, Any]] = []
                    try:
                        for i in range(repeats):
                            sampler = HostSampler(*own)
                            sampler.start()
                            with WindowWatch(target) as watch:  # the engine's gauges and the server's CPU
                                result = run_on_target(target, sc, scenario_name=name, knobs=values, progress=ctx.progress,
                                                       percentiles=pcts, prompt_set=first_set + i)
                            watch.into(result)
                            result["host"] = sampler.stop().as_dict()
                            if isinstance(result.get("prompts"), dict):
                                fb.meta.setdefault("prompts", []).append({"scenario": name, **result["prompts"]})
                            windows.append({"scenario": name, "index": i, **result["host"]})
                            path = ctx.workdir / f"serving-{name}-{i}.json"
                            path.write_text(json.dumps(result, indent=1))
                            fb.artifacts.append(Artifact(kind="result", path=str(path), description=f"{name} run {i}"))
                            runs.append(result)
                            if not result.get("ok", True):
                                break  # the server is gone; later windows would only repeat the failure
                    finally:
                        # Windows that finished before an error are measurements all the same.
                        summarise_windows(fb, name, runs, values, ws, cfg.queue_share, cfg.result_metrics)
                    if runs and not runs[-1].get("ok", True):
                        break
        except InfraAgentError as exc:
            fb.ok, fb.error = False, str(exc)
            return fb
        finally:
            if windows:
                fb.meta["host"] = host_summary(windows)
        if not any(m.name == "output_throughput" for m in fb.measurements):
            fb.ok = False
            fb.error = fb.error or "no run produced a result"
        return fb

    @staticmethod
    def _per_window(fb: Feedback, name: str, runs: list[dict[str, Any]], keys: list[str] | None) -> None:
        """Result keys as measurements with one sample per window, named as the result names them.

        The judge compares these across interleaved runs; the per-request samples above
        (``ttft_ms`` ...) describe distributions, not runs."""
        ok = [r for r in runs if r.get("ok", True)]
        have = {m.name for m in fb.measurements if m.tags.get("scenario") == name}
        for key in keys if keys is not None else _DEFAULT_RESULT_METRICS:
            if key in have:
                continue
            vals = [float(r[key]) for r in ok if isinstance(r.get(key), (int, float))]
            if vals:
                unit = "ms" if key.endswith("_ms") else "tok/s" if "token" in key else "req/s" if "request" in key else ""
                better = metric_direction(key)
                fb.measurements.append(_measure(key, unit, vals, better, component="client", scenario=name))

    @staticmethod
    def _plan(cfg: ServingConfig, ws: Any) -> list[tuple[str, Scenario]]:
        if cfg.scenario is not None:
            return [("inline", cfg.scenario)]
        if ws is None:
            raise InfraAgentError("the serving probe needs an inline 'scenario' when there is no workspace")
        names = cfg.scenarios or list(ws.scenarios)
        return [(n, ws.scenario(n)) for n in names]

    @classmethod
    def _summarise(cls, fb: Feedback, name: str, runs: list[dict[str, Any]], knobs: dict[str, Any], queue_share: float) -> None:
        # Only the knobs off their defaults: the rest is the workspace, and repeating every
        # value on every line buried the few that matter.
        knob_tag = ",".join(f"{k}={v}" for k, v in sorted(knobs.items()))
        tags = {"scenario": name, **({"knob": knob_tag} if knob_tag else {})}
        ok = [r for r in runs if r.get("ok", True)]
        for r in runs:
            if not r.get("ok", True):
                fb.findings.append(Finding(
                    kind=FindingKind.RUN_FAILED, severity="error", message=r.get("error", "run failed"),
                    location=Location(file=r.get("log_path")) if r.get("log_path") else None,
                    evidence={"log_tail": (r.get("log_tail") or "")[-2000:]},
                    next_question="Why did the server exit under this load? Read the log tail.",
                ))
        if not ok:
            return
        for key, unit in (("output_throughput", "tok/s"), ("request_throughput", "req/s"), ("request_goodput", "req/s")):
            vals = [float(r[key]) for r in ok if r.get(key) is not None]
            if vals:
                fb.measurements.append(_measure(key, unit, vals, "higher", component="client", **tags))
        for metric in ("ttft", "tpot", "itl", "e2el"):
            samples = [s for r in ok for s in request_samples(r, metric)]
            fb.measurements.append(_measure(f"{metric}_ms", "ms", samples, "lower", component="client", **tags))
        phases: dict[str, list[float]] = {}
        for r in ok:
            for phase, d in (r.get("server_metrics") or {}).items():
                if d.get("mean_s") is not None:
                    phases.setdefault(phase, []).append(d["mean_s"] * 1e3)
        for phase, vals in phases.items():
            fb.measurements.append(_measure(f"server_{phase}_mean_ms", "ms", vals, "lower", component="engine", interval=phase, **tags))
        # A phase the server's stack exports but this scrape lacked: say which, with the
        # names looked for, so a missing number is never mistaken for a phase not there.
        missing = {p: d.get("expected") for r in ok for p, d in (r.get("server_metrics") or {}).items() if d.get("missing")}
        if missing:
            fb.meta.setdefault("server_phases_missing", {})[name] = missing
        cls._findings(fb, name, ok, phases, queue_share)

    @staticmethod
    def _findings(fb: Feedback, name: str, ok: list[dict[str, Any]], phases: dict[str, list[float]], queue_share: float) -> None:
        failed = sum(int(r["failed"]) for r in ok)
        if failed:
            first = next((e for r in ok for e in r.get("errors", []) if e), "")
            fb.findings.append(Finding(
                kind=FindingKind.FAILED_REQUESTS, severity="error",
                message=f"{failed} of {failed + sum(int(r['completed']) for r in ok)} requests failed in scenario {name}",
                evidence={"failed": failed, "first_error": first[:300]},
                next_question="Are failures load-dependent (timeouts, capacity) or a protocol problem?",
            ))
        lengths = [r["answer_lengths"] for r in ok if isinstance(r.get("answer_lengths"), dict)]
        short, long = sum(int(a.get("short", 0)) for a in lengths), sum(int(a.get("long", 0)) for a in lengths)
        if short or long:
            checked = sum(int(a.get("checked", 0)) for a in lengths)
            fb.findings.append(Finding(
                kind=FindingKind.WRONG_ANSWER_LENGTH, severity="error",
                message=(f"{short + long} of {checked} answers in scenario {name} were not the length the request fixed "
                         f"(max_tokens with ignore_eos): {short} shorter, {long} longer; the server did not do the "
                         "work it is timed on"),
                evidence={"short": short, "long": long, "checked": checked, "scenario": name},
                next_question="Does the server stop early or ignore max_tokens (a cap, a cache of answers, a changed stop rule)?",
            ))
        client_ttft = sum(r["mean_ttft_ms"] for r in ok) / len(ok)
        queue = sum(phases.get("queue", [])) / len(phases["queue"]) if phases.get("queue") else None
        ttft_ref = sum(phases["ttft"]) / len(phases["ttft"]) if phases.get("ttft") else client_ttft
        if queue is not None and ttft_ref > 0 and queue / ttft_ref >= queue_share:
            fb.findings.append(Finding(
                kind=FindingKind.QUEUE_DOMINATES_TTFT, severity="warning",
                message=f"requests wait {queue:.1f} ms in the queue of a {ttft_ref:.1f} ms TTFT ({queue / ttft_ref:.0%}) in {name}",
                location=Location(component="engine.scheduler", span="queue"),
                evidence={"queue_ms": queue, "ttft_ms": ttft_ref, "share": queue / ttft_ref, "scenario": name},
                next_question="Is batch capacity (max running sequences, KV slots) too small for this concurrency?",
            ))
        prefill = sum(phases["prefill"]) / len(phases["prefill"]) if phases.get("prefill") else None
        if prefill is not None and ttft_ref > 0 and prefill / ttft_ref >= 0.5 and (queue is None or prefill > queue):
            fb.findings.append(Finding(
                kind=FindingKind.PREFILL_DOMINATES_TTFT, severity="info",
                message=f"prefill takes {prefill:.1f} ms of a {ttft_ref:.1f} ms TTFT in {name}",
                location=Location(component="model", span="prefill"), evidence={"prefill_ms": prefill, "ttft_ms": ttft_ref, "scenario": name},
                next_question="Would a larger prefill chunk or a faster attention kernel cut prefill time?",
            ))
        encode_findings(fb, name, ok, phases)
        burst = _burst_delivery(ok, phases)
        if burst is not None:
            fb.findings.append(Finding(
                kind=FindingKind.BURSTY_STREAM, severity="warning",
                message=(f"{burst['short_share']:.0%} of inter-token gaps are under {_BURST_GAP_MS:g} ms while a token takes "
                         f"{burst['per_token_ms']:.1f} ms to make ({burst['per_token_from']}) in {name}: chunks are held "
                         "back and delivered together, so TTFT, ITL and TPOT on this stream measure the holding, not the engine"
                         + (f"; the client used {burst['client_cpu_share']:.0%} of a core"
                            + (" (saturated: it may be the one holding chunks)" if burst["client_cpu_share"] >= 0.9 else "")
                            if burst.get("client_cpu_share") is not None else "")),
                location=Location(component="server"), evidence={**burst, "scenario": name},
                # Nagle is a question here: whether the server's sockets set TCP_NODELAY is unknown to a
                # client; the timeline probe reads it from them and ranks the explanations.
                next_question=NAGLE_QUESTION,
            ))
        if phases.get("ttft") and client_ttft > 0:
            gap = client_ttft - ttft_ref
            if gap / client_ttft > 0.3:
                # The server's own TTFT split where its metrics have the phases (vLLM, refstack: queue, prefill).
                inside = {p: sum(phases[p]) / len(phases[p]) for p in ("queue", "prefill") if phases.get(p)}
                split = "".join(f", {p} {v:.1f} ms" for p, v in inside.items())
                fb.findings.append(Finding(
                    kind=FindingKind.CLIENT_SERVER_TTFT_GAP, severity="info",
                    message=(f"client TTFT {client_ttft:.1f} ms vs server {ttft_ref:.1f} ms in {name}: {gap:.1f} ms outside "
                             "the engine" + (f" (the server's TTFT: {split[2:]})" if split else "")),
                    location=Location(component="server"),
                    evidence={"client_ttft_ms": client_ttft, "server_ttft_ms": ttft_ref, "scenario": name,
                              **{f"server_{p}_ms": v for p, v in inside.items()}},
                    next_question="Is time lost in the HTTP layer (tokenisation, detokenisation, event loop) before the engine sees the request?",
                ))
