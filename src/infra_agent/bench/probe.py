"""``ServingProbe``: the e2e tier, a serving benchmark turned into Feedback.

Config keys (all optional):

- ``scenarios``: workspace scenario names to run (default: every scenario);
- ``scenario``: an inline scenario dict (the workspace ``Scenario`` schema), run as
  ``"inline"``; with ``url`` it is the only way to say what to send;
- ``url``, ``metrics_url``, ``model``: benchmark an already-running server instead of
  launching the workspace target;
- ``knobs``: knob overrides on top of ``ctx.knobs``;
- ``repeats``: windows per scenario (default 1); throughput samples are per window;
- ``percentiles``: e.g. ``[50, 90, 99]``;
- ``queue_share``: the queue/TTFT share above which "queue time dominates TTFT" is
  reported (default 0.5).

Client metrics and the server's per-phase histogram deltas go side by side, each tagged
with the scenario and the knob values, so a finding can point at the phase (queue,
prefill, decode) that moved.
"""

from __future__ import annotations

import json
from contextlib import nullcontext
from typing import Any, ClassVar

from infra_agent.bench.metrics import request_samples
from infra_agent.bench.runner import default_log_dir, run_on_target
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
from infra_agent.probes.base import Probe, ProbeContext
from infra_agent.target import open_target
from infra_agent.workspace.models import Scenario

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
        rates = [e / n for r in ok for e, n, err in zip(r["e2els"], r["output_lens"], r["errors"], strict=True) if not err and n > 0]
        if not rates:
            return None
        per_token, source = 1e3 * sum(rates) / len(rates), "client E2E latency / output tokens"
    share = sum(g < _BURST_GAP_MS for g in gaps) / len(gaps)
    if share < _BURST_SHARE or per_token < 10 * _BURST_GAP_MS:
        return None
    return {"short_share": share, "per_token_ms": per_token, "per_token_from": source, "gaps": len(gaps)}


class _UrlTarget:
    """A plain URL seen through the ``RunningTarget`` surface (nothing to watch)."""

    def __init__(self, url: str, metrics_url: str | None, model: str | None) -> None:
        self.url, self.metrics_url, self.model, self.log_path, self.pid = url.rstrip("/"), metrics_url, model, None, None

    def check_alive(self) -> None:
        return None

    def log_tail(self, n: int = 40) -> str:
        return ""


def _measure(name: str, unit: str, samples: list[float], better: str | None, **tags: str) -> Measurement:
    kept = samples if len(samples) <= _MAX_SAMPLES else samples[:: len(samples) // _MAX_SAMPLES + 1]
    return Measurement(name=name, unit=unit, samples=kept, summary=Summary.of(samples), better=better, tags=tags)  # type: ignore[arg-type]


class ServingProbe(Probe):
    name: ClassVar[str] = "serving"
    tier: ClassVar[Tier] = Tier.e2e

    @property
    def scope(self) -> list[str]:
        return ["client", "server", "queue", "prefill", "decode"]

    def run(self, config: dict[str, Any], ctx: ProbeContext) -> Feedback:
        fb = Feedback(probe=self.name, tier=self.tier, scope=self.scope)
        ws = ctx.workspace
        plan = self._plan(config, ws)
        knobs = {**ctx.knobs, **dict(config.get("knobs") or {})}
        repeats = int(config.get("repeats", 1))
        pcts = [float(p) for p in config.get("percentiles", [50, 90, 99])]
        ctx.workdir.mkdir(parents=True, exist_ok=True)
        try:
            if config.get("url"):
                values: dict[str, Any] = knobs
                opener: Any = nullcontext(_UrlTarget(config["url"], config.get("metrics_url"), config.get("model")))
            else:
                assert ws is not None, "ServingProbe needs a workspace or a 'url' in its config"
                values = ws.resolve_knobs(knobs)
                opener = open_target(ws, values, default_log_dir(ws))
            with opener as target:
                if target.log_path:
                    fb.artifacts.append(Artifact(kind="log", path=str(target.log_path), description="server log"))
                for name, sc in plan:
                    runs: list[dict[str, Any]] = []
                    try:
                        for i in range(repeats):
                            result = run_on_target(target, sc, scenario_name=name, knobs=values, progress=ctx.progress, percentiles=pcts)
                            path = ctx.workdir / f"serving-{name}-{i}.json"
                            path.write_text(json.dumps(result, indent=1))
                            fb.artifacts.append(Artifact(kind="result", path=str(path), description=f"{name} run {i}"))
                            runs.append(result)
                            if not result.get("ok", True):
                                break  # the server is gone; later windows would only repeat the failure
                    finally:
                        # Windows that finished before an error are measurements all the same.
                        self._summarise(fb, name, runs, values, config)
                    if runs and not runs[-1].get("ok", True):
                        break
        except InfraAgentError as exc:
            fb.ok, fb.error = False, str(exc)
            return fb
        if not any(m.name == "output_throughput" for m in fb.measurements):
            fb.ok = False
            fb.error = fb.error or "no run produced a result"
        return fb

    @staticmethod
    def _plan(config: dict[str, Any], ws: Any) -> list[tuple[str, Scenario]]:
        if config.get("scenario") is not None:
            return [("inline", Scenario.model_validate(config["scenario"]))]
        if ws is None:
            raise InfraAgentError("ServingProbe: give a 'scenario' (inline) when there is no workspace")
        names = config.get("scenarios") or list(ws.scenarios)
        return [(n, ws.scenario(n)) for n in names]

    def _summarise(self, fb: Feedback, name: str, runs: list[dict[str, Any]], knobs: dict[str, Any], config: dict[str, Any]) -> None:
        knob_tag = ",".join(f"{k}={v}" for k, v in sorted(knobs.items()))
        tags = {"scenario": name, **({"knob": knob_tag} if knob_tag else {})}
        ok = [r for r in runs if r.get("ok", True)]
        for r in runs:
            if not r.get("ok", True):
                fb.findings.append(Finding(
                    kind="run failed", severity="error", message=r.get("error", "run failed"),
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
            fb.measurements.append(_measure(f"server_{phase}_mean_ms", "ms", vals, "lower", component=phase, **tags))
        self._findings(fb, name, ok, phases, float(config.get("queue_share", 0.5)))

    @staticmethod
    def _findings(fb: Feedback, name: str, ok: list[dict[str, Any]], phases: dict[str, list[float]], queue_share: float) -> None:
        failed = sum(int(r["failed"]) for r in ok)
        if failed:
            first = next((e for r in ok for e in r.get("errors", []) if e), "")
            fb.findings.append(Finding(
                kind="failed requests", severity="error",
                message=f"{failed} of {failed + sum(int(r['completed']) for r in ok)} requests failed in scenario {name}",
                evidence={"failed": failed, "first_error": first[:300]},
                next_question="Are failures load-dependent (timeouts, capacity) or a protocol problem?",
            ))
        client_ttft = sum(r["mean_ttft_ms"] for r in ok) / len(ok)
        queue = sum(phases.get("queue", [])) / len(phases["queue"]) if phases.get("queue") else None
        ttft_ref = sum(phases["ttft"]) / len(phases["ttft"]) if phases.get("ttft") else client_ttft
        if queue is not None and ttft_ref > 0 and queue / ttft_ref >= queue_share:
            fb.findings.append(Finding(
                kind="queue time dominates TTFT", severity="warning",
                message=f"requests wait {queue:.1f} ms in the queue of a {ttft_ref:.1f} ms TTFT ({queue / ttft_ref:.0%}) in {name}",
                location=Location(component="scheduler"),
                evidence={"queue_ms": queue, "ttft_ms": ttft_ref, "share": queue / ttft_ref},
                next_question="Is batch capacity (max running sequences, KV slots) too small for this concurrency?",
            ))
        prefill = sum(phases["prefill"]) / len(phases["prefill"]) if phases.get("prefill") else None
        if prefill is not None and ttft_ref > 0 and prefill / ttft_ref >= 0.5 and (queue is None or prefill > queue):
            fb.findings.append(Finding(
                kind="prefill dominates TTFT", severity="info",
                message=f"prefill takes {prefill:.1f} ms of a {ttft_ref:.1f} ms TTFT in {name}",
                location=Location(component="prefill"), evidence={"prefill_ms": prefill, "ttft_ms": ttft_ref},
                next_question="Would a larger prefill chunk or a faster attention kernel cut prefill time?",
            ))
        burst = _burst_delivery(ok, phases)
        if burst is not None:
            fb.findings.append(Finding(
                kind="streamed tokens arrive in bursts", severity="warning",
                message=(f"{burst['short_share']:.0%} of inter-token gaps are under {_BURST_GAP_MS:g} ms while a token takes "
                         f"{burst['per_token_ms']:.1f} ms to make ({burst['per_token_from']}) in {name}: chunks are held "
                         "back and delivered together, so TTFT, ITL and TPOT on this stream measure the holding, not the engine"),
                location=Location(component="api_server"), evidence=burst,
                next_question=("Is Nagle's algorithm on for the server's connections (TCP_NODELAY unset; stalls of about "
                               "40 ms, one delayed ACK, on reused keep-alive connections), or does the server batch "
                               "stream output on purpose (a stream interval)?"),
            ))
        if phases.get("ttft") and client_ttft > 0:
            gap = client_ttft - ttft_ref
            if gap / client_ttft > 0.3:
                fb.findings.append(Finding(
                    kind="client/server TTFT gap", severity="info",
                    message=f"client TTFT {client_ttft:.1f} ms vs server {ttft_ref:.1f} ms in {name}: {gap:.1f} ms outside the engine",
                    location=Location(component="api_server"), evidence={"client_ttft_ms": client_ttft, "server_ttft_ms": ttft_ref},
                    next_question="Is time lost in the HTTP layer (tokenisation, detokenisation, event loop) before the engine sees the request?",
                ))
