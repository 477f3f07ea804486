"""``TimelineProbe``: one serving window with spans and GIL samples, as Feedback (tier ``trace``).

It measures the target the way the serving probe does (``ctx.target`` when the caller
keeps a server running, else the workspace target launched with this run's knobs plus
``trace_knobs``), and around one scenario window it also

- clears the server's span buffer (``GET {trace_path}?reset=true``) and fetches the
  window's spans afterwards (``GET {trace_path}``);
- samples one process of the target with ``py-spy dump`` (``PySpyDumpSampler``): the
  server itself, (``sample_process: auto``) the busiest of the server and its child
  processes over the first ``lead_s`` of the window, or the child whose process name
  (``/proc/PID/comm``) is the given one, e.g. ``prefill-worker`` for the prefill worker
  of a disaggregated refstack (whose main thread may sleep in a native call, so CPU time
  does not find it).  When ptrace is refused the analysis runs on spans alone and
  says so (a ``sampler_unavailable`` finding);
- runs the timeline analysis (:mod:`infra_agent.trace`) and turns it into findings
  (GIL contention, a serving thread blocked, missing overlap, idle threads, span trends
  ...) whose locations name a component and, where the workspace allows, a knob.  A
  target without spans (a server we did not write) still gets every sampled thread's
  states from py-spy alone.

Its parts: the config (``timeline_config.py``), the sampled window
(``timeline_sampling.py``), the analysis (``timeline_analysis.py``), the locating of
findings (``timeline_locate.py``) and the target's profiler (``timeline_profile.py``).

The Feedback holds the serving probe's measurements of the window (the same names, so
the judge compares e2e metrics across probes), the timeline's own (``overlap_share``,
``gil_wait_share``, ``thread_busy_share``, ``gil_holder_share``, ``thread_blocked_share`` per
sampled thread, and from the collector's spans ``gc_pause_ms``, the window's longest
collection, and ``gc_share``) and the merged Perfetto
trace as an artifact.

**Comparing two values of a knob** (``compare_knob``): the probe starts two servers of
the configuration under test that differ only in that knob (``compare_values``, for a
bool ``[false, true]``), runs ``compare_pairs`` interleaved windows on them (A B, B A,
...), and reports the per-pair ratio ``metric(values[1]) / metric(values[0])`` as the
measurement ``ratio_name`` (one sample per pair).  ``min_ratio`` turns it into a gate,
decided on the ratio's 95% interval as the judge decides every ratio: wholly below it the
run is ``ok=False`` with the ratio named; straddling it, the gate is inconclusive and the
judge pools the pairs of further runs (``meta.gate``, judge/pooling.py).  That is how a
workspace check expresses "prefill throughput with kv_transfer on >= 0.95 x with it off,
same workload" (``meta.gate_failed`` names the ratio: the windows were measured, so the
judge still reads them for a hypothesis about their throughput).  The sampled window then runs on the server with the configuration's own
value, so its findings describe the configuration under test.
"""

from __future__ import annotations

import json
from contextlib import ExitStack
from typing import Any, ClassVar
from urllib.parse import urlsplit

from infra_agent.errors import InfraAgentError
from infra_agent.feedback import (
    Artifact,
    Feedback,
    Finding,
    Measurement,
    Tier,
)
from infra_agent.probes import timeline_profile
from infra_agent.probes.base import Probe, ProbeConfig, ProbeContext
from infra_agent.probes.knob_compare import pair_ratios, record_verdict, resolve_pair
from infra_agent.probes.timeline_analysis import analyse_window
from infra_agent.probes.timeline_config import TimelineConfig
from infra_agent.probes.timeline_sampling import sampled_window
from infra_agent.vocabulary import FindingKind
from infra_agent.workspace.models import Scenario

# Metrics a timeline run reports beside the serving ones.
TIMELINE_METRICS: tuple[str, ...] = ("overlap_share", "gil_wait_share", "thread_busy_share", "gil_holder_share",
                                     "gc_pause_ms", "gc_share", "thread_blocked_share",
                                     "loop_stall_ms", "input_throughput")


class TimelineProbe(Probe):
    name: ClassVar[str] = "timeline"
    base_tier: ClassVar[Tier] = Tier.trace
    Config: ClassVar[type[ProbeConfig]] = TimelineConfig
    components: ClassVar[tuple[str, ...]] = ("engine", "model", "runtime", "kv_transfer", "comm", "server")
    locality: ClassVar[tuple[str, ...]] = ("thread", "span")

    @classmethod
    def measures(cls, metric: str) -> bool:
        from infra_agent.probes.serving import ServingProbe

        return ServingProbe.measures(metric) or metric in TIMELINE_METRICS or metric.endswith("_ratio")

    # ------------------------------------------------------------------ run

    def run(self, config: Any, ctx: ProbeContext) -> Feedback:
        from infra_agent.probes.serving import ServingProbe

        cfg: TimelineConfig = self.parse_config(config)  # type: ignore[assignment]
        fb = Feedback(probe=self.name, tier=self.tier(cfg), scope=self.scope)
        ws = ctx.workspace
        try:
            plan = ServingProbe._plan(cfg, ws)  # type: ignore[arg-type]
        except InfraAgentError as exc:
            fb.ok, fb.error = False, str(exc).replace("serving probe", "timeline probe")
            return fb
        name, sc = plan[0]
        ctx.workdir.mkdir(parents=True, exist_ok=True)
        knobs = {**ctx.knobs, **cfg.knobs}
        try:
            if cfg.compare_knob is not None:
                self._compare(cfg, ctx, fb, name, sc, knobs)
            else:
                with self._open(cfg, ctx, knobs) as (target, values):
                    if cfg.greedy_tokens:
                        # The answers behind the speed, once per server, before the trace is
                        # reset (serving/greedy_text.py): an A/B of this probe is held to them too.
                        from infra_agent.serving.greedy_text import answers_for

                        fb.meta["greedy"] = answers_for(target, cfg.greedy_tokens)
                    self._traced(cfg, ctx, fb, name, sc, target, values)
        except InfraAgentError as exc:
            fb.ok, fb.error = False, fb.error or str(exc)
        if fb.ok and not any(m.name == "output_throughput" for m in fb.measurements):
            fb.ok, fb.error = False, fb.error or "no window produced a result"
        return fb

    def _open(self, cfg: TimelineConfig, ctx: ProbeContext, knobs: dict[str, Any], launch: bool = False) -> Any:
        """The target and the knob values it runs with: ``ctx.target``, or the workspace target launched."""
        from contextlib import contextmanager

        from infra_agent.serving.runner import default_log_dir
        from infra_agent.target import open_target

        ws = ctx.workspace

        @contextmanager
        def opened() -> Any:
            if ctx.target is not None and not launch:
                yield ctx.target, dict(knobs)
                return
            if ws is None:
                raise InfraAgentError("the timeline probe needs a workspace target or a running target to measure")
            trace = {k: v for k, v in cfg.trace_knobs.items() if k in ws.knobs}
            values = ws.resolve_knobs({**knobs, **trace})
            with open_target(ws, values, default_log_dir(ws)) as target:
                yield target, values

        return opened()

    def _window(self, cfg: TimelineConfig, ctx: ProbeContext, target: Any, name: str, sc: Scenario,
                values: dict[str, Any], tag: str, prompt_set: int) -> dict[str, Any]:
        from infra_agent.serving.runner import run_on_target

        # Every window on one server sends a prompt set of its own (serving/prompt_sets.py).
        result = run_on_target(target, sc, scenario_name=name, knobs=values, progress=False, percentiles=cfg.percentiles,
                               prompt_set=prompt_set)
        _derive(result)
        path = ctx.workdir / f"timeline-{name}-{tag}.json"
        path.write_text(json.dumps(result, indent=1, default=str))
        return result

    # ------------------------------------------------------------------ one traced window

    def _traced(self, cfg: TimelineConfig, ctx: ProbeContext, fb: Feedback, name: str, sc: Scenario, target: Any,
                values: dict[str, Any], arm: str | None = None, first_set: int | None = None) -> None:
        from infra_agent.probes.serving import summarise_windows

        first = first_set if first_set is not None else ctx.prompt_set or 0

        if target.log_path:
            fb.artifacts.append(Artifact(kind="log", path=str(target.log_path), description="server log"))
        trace_url = target.url.rstrip("/") + cfg.trace_path
        trace_note = None
        if cfg.reset:
            trace_note = _get_json(trace_url + ("&" if "?" in trace_url else "?") + "reset=true")[1]
        runs: list[dict[str, Any]] = []
        sampler_res = stall_res = None
        picked: dict[str, Any] = {}
        kineto, profile_notes = None, []
        profiling = cfg.profile
        if profiling:
            note = timeline_profile.start(target.url, ctx.workdir)
            profiling = note is None
            profile_notes += [note] if note else []
        try:
            for i in range(cfg.repeats):
                if i == 0:
                    try:
                        result, sampler_res, picked, stall_res = sampled_window(
                            cfg, lambda: self._window(cfg, ctx, target, name, sc, values, "0", first), target.pid,
                            ctx.workdir / f"gil-{name}.jsonl", urlsplit(target.url).port)
                    finally:  # the profile covers the traced window only, and never outlives it
                        if profiling:
                            kineto, note = timeline_profile.stop(target.url)
                            profile_notes += [note] if note else []
                            if kineto is not None:
                                fb.artifacts.append(Artifact(kind="trace", path=str(kineto),
                                                             description="torch.profiler (Kineto) trace of the window"))
                else:
                    result = self._window(cfg, ctx, target, name, sc, values, f"{i}", first + i)
                runs.append(result)
                fb.artifacts.append(Artifact(kind="result", path=str(ctx.workdir / f"timeline-{name}-{i}.json"),
                                             description=f"{name} window {i}"))
                if not result.get("ok", True):
                    break
        finally:
            summarise_windows(fb, name, runs, values, ctx.workspace, cfg.queue_share, cfg.result_metrics)
            _per_window_extra(fb, name, runs)
        if not runs or not runs[0].get("ok", True):
            fb.ok, fb.error = False, runs[0].get("error", "the traced window failed") if runs else "no window ran"
            return
        doc, err = _get_json(trace_url)
        spans_path = None
        if doc is None:
            fb.findings.append(Finding(
                kind=FindingKind.OVERLAP_UNMEASURABLE, severity="warning",
                message=f"no span trace from {cfg.trace_path}: {err or trace_note}",
                next_question=f"Start the target with tracing on ({', '.join(f'{k}={v}' for k, v in cfg.trace_knobs.items())}) "
                              "so the timeline can be analysed."))
            fb.meta["trace_error"] = err
            # A server without our spans (vLLM, SGLang): its threads' states come from py-spy alone.
            if sampler_res is None or sampler_res.path is None:
                # Nothing to analyse, and the reason must not be lost with it (a window shorter than
                # lead_s, py-spy refused): without it the Feedback would hold no thread states and no why.
                from infra_agent.trace.feedback import sampler_unavailable

                why = (sampler_res.warning if sampler_res is not None else None) or "py-spy did not sample the window"
                fb.findings.append(sampler_unavailable(why))
                return
        else:
            spans_path = ctx.workdir / f"spans-{name}.json"
            spans_path.write_text(json.dumps(doc))
            fb.artifacts.append(Artifact(kind="trace", path=str(spans_path), description="server spans of the window"))
        analyse_window(cfg, ctx, fb, name, spans_path, sampler_res, picked, runs[0], arm, kineto, profile_notes,
                       stall_res)

    # ------------------------------------------------------------------ two values of a knob

    def _compare(self, cfg: TimelineConfig, ctx: ProbeContext, fb: Feedback, name: str, sc: Scenario,
                 knobs: dict[str, Any]) -> None:
        assert cfg.compare_knob is not None
        pair = resolve_pair(ctx.workspace, cfg.compare_knob, cfg.compare_values, knobs, cfg.compare_metric,
                            cfg.ratio_name)
        knob_name = pair.knob
        fb.meta["compare"] = {"knob": knob_name, "values": list(pair.values), "own": pair.own, "metric": pair.metric,
                              "ratio": pair.ratio_name}
        results: dict[int, list[dict[str, Any]]] = {0: [], 1: []}
        # Pair i's two windows send one prompt set; the warm-ups and the traced windows others.
        base = ctx.prompt_set or 0
        with ExitStack() as stack:
            targets = []
            for v in pair.values:
                targets.append(stack.enter_context(self._open(cfg, ctx, {**knobs, knob_name: v}, launch=True)))
            # a warm-up window per server (first requests pay one-time costs), not counted
            for target, values in targets:
                self._window(cfg, ctx, target, name, sc, values, f"warmup-{values[knob_name]}", base + cfg.compare_pairs)
            for i in range(cfg.compare_pairs):
                for side in ((0, 1) if i % 2 == 0 else (1, 0)):
                    target, values = targets[side]
                    r = self._window(cfg, ctx, target, name, sc, values, f"{pair.arm(side)}-{i}", base + i)
                    results[side].append(r)
                    if not r.get("ok", True):
                        raise InfraAgentError(f"{pair.arm(side)}: window {i} failed: {r.get('error')}")
            ratios = pair_ratios(results[0], results[1], pair.metric)
            own_side = 1 if pair.own == pair.values[1] else 0 if pair.own == pair.values[0] else None
            # The configuration's own value is traced and sampled; its windows lead the Feedback.
            traced_side = own_side if own_side is not None else 1
            target, values = targets[traced_side]
            self._traced(cfg, ctx, fb, name, sc, target, values, first_set=base + cfg.compare_pairs + 1)
            from infra_agent.probes.serving import summarise_windows

            other = Feedback(probe=self.name, tier=self.tier(cfg), scope=self.scope)
            summarise_windows(other, name, results[1 - traced_side], targets[1 - traced_side][1], ctx.workspace,
                              cfg.queue_share, cfg.result_metrics)
            _per_window_extra(other, name, results[1 - traced_side])
            for m in other.measurements:
                m.tags["knob"] = pair.arm(1 - traced_side)
                fb.measurements.append(m)
            mine = Feedback(probe=self.name, tier=self.tier(cfg), scope=self.scope)
            _per_window_extra(mine, name, results[traced_side])
            for m in mine.measurements:
                m.tags["knob"] = pair.arm(traced_side)
                fb.measurements.append(m)
        record_verdict(fb, pair, ratios, name, cfg.min_ratio)


# ---------------------------------------------------------------------- helpers


def _derive(result: dict[str, Any]) -> None:
    """``input_throughput``: prompt tokens per second of the window (the prefill rate when outputs are short)."""
    if result.get("ok", True) and isinstance(result.get("total_input_tokens"), (int, float)) \
            and isinstance(result.get("duration"), (int, float)) and result["duration"] > 0:
        result["input_throughput"] = float(result["total_input_tokens"]) / float(result["duration"])


def _per_window_extra(fb: Feedback, name: str, runs: list[dict[str, Any]]) -> None:
    vals = [float(r["input_throughput"]) for r in runs if r.get("ok", True) and isinstance(r.get("input_throughput"), (int, float))]
    if vals and not any(m.name == "input_throughput" and m.tags.get("scenario") == name for m in fb.measurements):
        fb.measurements.append(Measurement.from_samples("input_throughput", "tok/s", vals, "higher", component="client",
                                                        scenario=name))


def _get_json(url: str, timeout_s: float = 60.0) -> tuple[Any, str | None]:
    return timeline_profile.request_json(url, timeout_s=timeout_s)


__all__ = ["TimelineProbe"]
