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
  (GIL contention, missing overlap, idle threads, span trends ...) whose locations name
  a component and, where the workspace allows, a knob.

The Feedback holds the serving probe's measurements of the window (the same names, so
the judge compares e2e metrics across probes), the timeline's own (``overlap_share``,
``gil_wait_share``, ``thread_busy_share``, ``gil_holder_share``, and from the collector's
spans ``gc_pause_ms``, the window's longest collection, and ``gc_share``) and the merged Perfetto
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
import threading
from contextlib import ExitStack
from pathlib import Path
from typing import Any, ClassVar, Literal

from pydantic import Field

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
from infra_agent.probes.target_processes import pick_process
from infra_agent.probes.timeline_locate import knobs_for, locate, span_categories
from infra_agent.vocabulary import FindingKind
from infra_agent.workspace.models import Scenario

# Span category (or name prefix) -> the component a finding about it is located in.
DEFAULT_SPAN_COMPONENTS: dict[str, str] = {
    "ep": "comm", "comm": "comm", "nccl": "comm", "kv": "kv_transfer", "transfer": "kv_transfer",
    "engine": "engine", "http": "server", "model": "model", "gc": "runtime.gc",
}
# Metrics a timeline run reports beside the serving ones.
TIMELINE_METRICS: tuple[str, ...] = ("overlap_share", "gil_wait_share", "thread_busy_share", "gil_holder_share",
                                     "gc_pause_ms", "gc_share",
                                     "input_throughput")


class TimelineConfig(ProbeConfig):
    """What to run, how to trace it, and what to expect; every key is optional."""

    scenarios: list[str] | None = Field(None, description="workspace scenarios; the first one is traced (default: the first declared)")
    scenario: Scenario | None = Field(None, description="an inline scenario, run as 'inline'")
    knobs: dict[str, Any] = Field(default_factory=dict, description="knob overrides on top of the context's knobs")
    trace_knobs: dict[str, Any] = Field(default_factory=lambda: {"trace": True, "trace_level": "layer"},
                                        description="knobs that turn tracing on when this probe launches the target "
                                                    "(only those the workspace declares are applied); trace_level "
                                                    "layer: the per-layer spans its EP and GIL findings need")
    trace_path: str = Field("/debug/trace", description="GET path of the server's Chrome trace")
    reset: bool = Field(True, description="clear the server's span buffer (?reset=true) before the window")
    sample: bool = Field(True, description="sample GIL holders with py-spy dump during the window")
    profile: bool = Field(False, description="also run the target's torch.profiler over the traced window (POST "
                                             "/start_profile, /stop_profile: refstack, vLLM, SGLang); its Kineto trace "
                                             "joins the timeline, with a GPU's streams and the launch_bound finding")
    sample_process: str = Field(
        "auto", min_length=1,
        description="auto: the busiest of the server and its child processes over the first lead_s; server: the "
                    "server; any other value: the child process of that name (/proc/PID/comm, e.g. prefill-worker)")
    lead_s: float = Field(0.5, ge=0, le=30, description="load time before the process is picked and sampling starts")
    sample_interval_s: float = Field(0.0, ge=0, le=5)
    expect_overlap: list[str] = Field(default_factory=list,
                                      description="'A:B' span groups (names or categories, '|' joins) that should overlap")
    knob_hints: dict[str, str] = Field(default_factory=dict,
                                       description="pattern -> knob: a finding whose holder file, function or span holds "
                                                   "the pattern names the knob")
    span_components: dict[str, str] = Field(default_factory=dict,
                                            description="span category -> component, over the defaults (ep -> comm ...)")
    by: Literal["cat", "name"] = "cat"
    repeats: int = Field(1, ge=1, le=20, description="sampled windows (the first is traced and analysed)")
    compare_knob: str | None = Field(None, description="run two servers differing only in this knob, interleaved")
    compare_values: list[Any] | None = Field(None, description="[reference, tested]; default [false, true] for a bool knob")
    compare_pairs: int = Field(3, ge=1, le=50)
    compare_metric: str = Field("input_throughput", description="result key (or input_throughput) the ratio is of")
    ratio_name: str | None = Field(None, description="measurement name of the ratio (default <knob>_ratio)")
    min_ratio: float | None = Field(None, gt=0, description="a gate on the ratio: ok=False when its 95% interval lies wholly below this")
    # The serving probe's keys, so the executor's A/B job can pass them on.
    result_metrics: list[str] | None = None
    percentiles: list[float] = Field(default_factory=lambda: [50.0, 90.0, 99.0])
    queue_share: float = Field(0.5, gt=0, le=1)


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
                values: dict[str, Any], tag: str) -> dict[str, Any]:
        from infra_agent.serving.runner import run_on_target

        result = run_on_target(target, sc, scenario_name=name, knobs=values, progress=False, percentiles=cfg.percentiles)
        _derive(result)
        path = ctx.workdir / f"timeline-{name}-{tag}.json"
        path.write_text(json.dumps(result, indent=1, default=str))
        return result

    # ------------------------------------------------------------------ one traced window

    def _traced(self, cfg: TimelineConfig, ctx: ProbeContext, fb: Feedback, name: str, sc: Scenario, target: Any,
                values: dict[str, Any], arm: str | None = None) -> None:
        from infra_agent.probes.serving import summarise_windows

        if target.log_path:
            fb.artifacts.append(Artifact(kind="log", path=str(target.log_path), description="server log"))
        trace_url = target.url.rstrip("/") + cfg.trace_path
        trace_note = None
        if cfg.reset:
            trace_note = _get_json(trace_url + ("&" if "?" in trace_url else "?") + "reset=true")[1]
        runs: list[dict[str, Any]] = []
        sampler_res = None
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
                        result, sampler_res, picked = self._sampled_window(cfg, ctx, target, name, sc, values)
                    finally:  # the profile covers the traced window only, and never outlives it
                        if profiling:
                            kineto, note = timeline_profile.stop(target.url)
                            profile_notes += [note] if note else []
                            if kineto is not None:
                                fb.artifacts.append(Artifact(kind="trace", path=str(kineto),
                                                             description="torch.profiler (Kineto) trace of the window"))
                else:
                    result = self._window(cfg, ctx, target, name, sc, values, f"{i}")
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
        if doc is None:
            fb.findings.append(Finding(
                kind=FindingKind.OVERLAP_UNMEASURABLE, severity="warning",
                message=f"no span trace from {cfg.trace_path}: {err or trace_note}",
                next_question=f"Start the target with tracing on ({', '.join(f'{k}={v}' for k, v in cfg.trace_knobs.items())}) "
                              "so the timeline can be analysed."))
            fb.meta["trace_error"] = err
            return
        spans_path = ctx.workdir / f"spans-{name}.json"
        spans_path.write_text(json.dumps(doc))
        fb.artifacts.append(Artifact(kind="trace", path=str(spans_path), description="server spans of the window"))
        self._analyse(cfg, ctx, fb, name, spans_path, sampler_res, picked, runs[0], arm, kineto, profile_notes)

    def _sampled_window(self, cfg: TimelineConfig, ctx: ProbeContext, target: Any, name: str, sc: Scenario,
                        values: dict[str, Any]) -> tuple[dict[str, Any], Any, dict[str, Any]]:
        from infra_agent.trace.sampler import PySpyDumpSampler, PySpyResult

        box: dict[str, Any] = {}

        def load() -> None:
            try:
                box["result"] = self._window(cfg, ctx, target, name, sc, values, "0")
            except BaseException as exc:  # noqa: BLE001 - re-raised on the probe's thread
                box["error"] = exc

        worker = threading.Thread(target=load, name="timeline-load", daemon=True)
        worker.start()
        sampler = None
        picked: dict[str, Any] = {}
        res = None
        if not cfg.sample:
            res = PySpyResult(None, None, None)
        elif target.pid is None:
            res = PySpyResult(None, None, "py-spy unavailable, spans only: the target's process id is unknown "
                                           "(a server given by URL)")
        else:
            pid, picked = pick_process(int(target.pid), cfg.sample_process, cfg.lead_s, worker)
            if worker.is_alive():
                sampler = PySpyDumpSampler(pid, ctx.workdir / f"gil-{name}.jsonl", interval_s=cfg.sample_interval_s).start()
        worker.join()
        if sampler is not None:
            res = sampler.stop()
        elif res is None:
            res = PySpyResult(None, None, "py-spy unavailable, spans only: the window ended before sampling started "
                                           f"(lead_s {cfg.lead_s:g} s is longer than the window)")
        if "error" in box:
            raise box["error"]
        return box["result"], res, picked

    # ------------------------------------------------------------------ analysis

    def _analyse(self, cfg: TimelineConfig, ctx: ProbeContext, fb: Feedback, name: str, spans_path: Path,
                 sampler_res: Any, picked: dict[str, Any], result: dict[str, Any], arm: str | None,
                 kineto: Path | None = None, profile_notes: list[str] | None = None) -> None:
        from infra_agent.trace.analyze import analyze
        from infra_agent.trace.feedback import timeline_feedback
        from infra_agent.trace.load import TraceLoadError, load_timeline
        from infra_agent.trace.merge import write_merged

        pyspy = sampler_res.path if sampler_res is not None else None
        notes = list(profile_notes or [])
        try:
            try:
                tl = load_timeline([spans_path], pyspy=pyspy, kineto=[kineto] if kineto is not None else [])
            except TraceLoadError as exc:
                if kineto is None or str(kineto) not in str(exc):
                    raise
                notes.append(f"torch.profiler trace left out: {exc}")  # it costs the Kineto part only
                tl = load_timeline([spans_path], pyspy=pyspy)
        except TraceLoadError as exc:
            fb.findings.append(Finding(kind=FindingKind.OVERLAP_UNMEASURABLE, severity="warning",
                                       message=f"the span trace could not be read: {exc}"))
            return
        if sampler_res is not None and sampler_res.warning:
            tl.warnings.append(sampler_res.warning)
        tl.warnings.extend(notes)
        if pyspy is not None:
            fb.artifacts.append(Artifact(kind="trace", path=str(pyspy), description="py-spy dump samples (JSON lines)"))
        expect = []
        for pair in cfg.expect_overlap:
            a, sep, b = pair.partition(":")
            if sep and a and b:
                expect.append((a, b))
        report = analyze(tl, by=cfg.by, expect_overlap=expect)
        hints = {**self._workspace_hints(ctx.workspace, tl, cfg), **cfg.knob_hints}
        tfb = timeline_feedback(report, knob_hints=hints, serving_result=result if result.get("ok", True) else None,
                                meta={"sampled_process": picked})
        components = {**DEFAULT_SPAN_COMPONENTS, **cfg.span_components}
        cats = span_categories(tl)
        tags = {"scenario": name, **({"knob": arm} if arm else {})}
        for f in tfb.findings:
            locate(f, components, cats, ctx.workspace, hints)
            f.evidence.setdefault("scenario", name)
            fb.findings.append(f)
        for m in tfb.measurements:
            m.tags.update(tags)
            fb.measurements.append(m)
        for w in report.waits[:8]:
            for thread, share in list(w.holder_threads.items())[:3]:
                fb.measurements.append(Measurement.from_samples("gil_holder_share", "ratio", [share], None, thread=thread,
                                                                interval=f"{w.group}@{w.thread}", **tags))
        merged = ctx.workdir / f"timeline-{name}.perfetto.json"
        try:
            write_merged(tl, merged)
            fb.artifacts.append(Artifact(kind="trace", path=str(merged),
                                         description="spans + GIL holder track on one clock (open in Perfetto)"))
        except (OSError, ValueError) as exc:
            tl.warnings.append(f"merged trace not written: {exc}")
        fb.meta.setdefault("timeline", {}).update({**tfb.meta, "report": _small_report(report)})

    @staticmethod
    def _workspace_hints(ws: Any, tl: Any, cfg: TimelineConfig) -> dict[str, str]:
        """Span name -> knob for span categories whose component exactly one workspace knob acts on."""
        if ws is None:
            return {}
        components = {**DEFAULT_SPAN_COMPONENTS, **cfg.span_components}
        out: dict[str, str] = {}
        for span_name, cat in span_categories(tl).items():
            comp = components.get(cat) or components.get(span_name.split(".", 1)[0])
            if comp is None:
                continue
            knobs = knobs_for(ws, comp)
            if len(knobs) == 1:
                out[span_name] = knobs[0]
        return out

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
        with ExitStack() as stack:
            targets = []
            for v in pair.values:
                targets.append(stack.enter_context(self._open(cfg, ctx, {**knobs, knob_name: v}, launch=True)))
            # a warm-up window per server (first requests pay one-time costs), not counted
            for target, values in targets:
                self._window(cfg, ctx, target, name, sc, values, f"warmup-{values[knob_name]}")
            for i in range(cfg.compare_pairs):
                for side in ((0, 1) if i % 2 == 0 else (1, 0)):
                    target, values = targets[side]
                    r = self._window(cfg, ctx, target, name, sc, values, f"{pair.arm(side)}-{i}")
                    results[side].append(r)
                    if not r.get("ok", True):
                        raise InfraAgentError(f"{pair.arm(side)}: window {i} failed: {r.get('error')}")
            ratios = pair_ratios(results[0], results[1], pair.metric)
            own_side = 1 if pair.own == pair.values[1] else 0 if pair.own == pair.values[0] else None
            # The configuration's own value is traced and sampled; its windows lead the Feedback.
            traced_side = own_side if own_side is not None else 1
            target, values = targets[traced_side]
            self._traced(cfg, ctx, fb, name, sc, target, values)
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


def _small_report(report: Any) -> dict[str, Any]:
    d = report.to_dict()
    return {"duration_us": d["duration_us"], "samples": d["samples"], "warnings": d["warnings"],
            "threads": d["threads"][:8], "expected_overlap": d["expected_overlap"], "waits": d["waits"][:4],
            "holder_spans": d["holder_spans"], "sources": d["sources"]}


__all__ = ["TimelineConfig", "TimelineProbe"]
