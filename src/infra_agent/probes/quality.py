"""``QualityProbe``: does a change keep the model's numbers? (tier ``check``)

It sends a fixed prompt set to a **candidate** and a **baseline** server through
``POST /v1/completions`` with ``echo: true, logprobs: N, max_tokens: 0, temperature:
0`` (vLLM answers it, and refstack does), which returns each prompt token's
teacher-forced log-probability given the tokens before it, with the top-N
alternatives.  Position by position it compares the two (see
:mod:`infra_agent.probes.quality_metrics`) and reports, one sample per prompt:

- ``kl_div``: KL(baseline || candidate), a lower bound of the true KL (top-N buckets
  plus one "other" bucket: only top-N logprobs come over the API);
- ``top1_agreement``: the share of positions whose most likely token agrees;
- ``logprob_err_p50`` / ``p90`` / ``p99`` (``percentiles``): the actual token's
  absolute logprob difference (logprobs, not raw logits, come over the API);
- ``perplexity`` (the candidate's), ``baseline_perplexity`` and ``perplexity_ratio``:
  meaningful only for a model with real weights.

The pooled values (every position of every prompt together) are in
``meta["quality"]`` and in the summary finding.

**The two servers.**  The candidate is, in order: ``ctx.target`` (a server the caller
keeps running, as the serving probe takes it), ``candidate_url``, or the workspace
target launched with this run's knobs (``ctx.knobs`` plus ``knobs``), which is how the
agent loop runs it as a workspace check on every experiment's configuration.  The
baseline is ``baseline_url``, or the workspace target launched with the workspace's
default knobs plus ``baseline_knobs``: a fixed reference (say, no quantisation), so a
criterion such as ``kl_div <= 0.01`` bounds every configuration's distance from it,
not only a step's distance from its parent.

A server that cannot answer (HTTP 400 or 422 to the request, or an answer without
prompt logprobs) gives a ``no_logprobs`` finding and **no** metrics, never zeros, and
the run is ``ok=False`` (the requests and their refusals: ``quality_echo.py``).  ``max_kl_div`` / ``min_top1_agreement`` make the run fail
when the pooled value crosses them, for use as a check gate without a criterion.
"""

from __future__ import annotations

import json
import time
from contextlib import ExitStack
from importlib import resources
from pathlib import Path
from typing import Any, ClassVar, Literal

import httpx
from pydantic import Field, field_validator

from infra_agent.errors import InfraAgentError
from infra_agent.feedback import (
    Artifact,
    Feedback,
    Finding,
    Location,
    Measurement,
    Tier,
)
from infra_agent.probes.base import Probe, ProbeConfig, ProbeContext
from infra_agent.probes.quality_echo import (
    NoLogprobs,
    Side,
    UrlTarget,
    discover_model,
    prompt_logprobs,
)
from infra_agent.probes.quality_metrics import (
    QUALITY_METRICS,
    PromptComparison,
    PromptLogprobs,
    TokenMismatch,
    compare_prompt,
    describe,
    err_metric,
    is_quality_metric,
    per_prompt,
    pooled,
    quality_metric_direction,
    worst_positions,
)
from infra_agent.vocabulary import FindingKind

DEFAULT_PROMPTS = "quality_prompts.txt"  # in infra_agent/probes/data/


class QualityConfig(ProbeConfig):
    """Where the two servers are and what to send; every key is optional."""

    baseline_url: str | None = Field(None, description="an already-running reference server (base URL, no /v1)")
    baseline_knobs: dict[str, Any] = Field(
        default_factory=dict, description="without baseline_url: the workspace target launched with its default knobs "
                                          "plus these")
    candidate_url: str | None = Field(None, description="measure this server instead of the context's target or the "
                                                        "launched workspace target")
    knobs: dict[str, Any] = Field(default_factory=dict, description="knob overrides on the context's knobs for the "
                                                                    "launched candidate")
    model: str | None = Field(None, description="model name sent to the candidate (default: the target's, else the "
                                                "first of GET /v1/models)")
    baseline_model: str | None = Field(None, description="model name sent to the baseline (default: as for model)")
    prompts_file: str | None = Field(None, description="prompts, one paragraph each (blank lines between, # comments); "
                                                       "relative to the workspace root; default: the shipped sample")
    num_prompts: int | None = Field(None, ge=1, description="use the first N prompts")
    logprobs: int = Field(5, ge=1, le=20, description="top-N alternatives per position (vLLM caps at its --max-logprobs)")
    percentiles: list[float] = Field(default_factory=lambda: [50.0, 90.0, 99.0],
                                     description="percentiles of the actual token's |logprob difference|")
    max_tokens: Literal[0, 1] = Field(0, description="0 (the prompt alone); 1 for a server that refuses 0")
    timeout_s: float = Field(120.0, gt=0, description="per request")
    max_kl_div: float | None = Field(None, ge=0, description="ok=False when the pooled kl_div is above this")
    min_top1_agreement: float | None = Field(None, ge=0, le=1,
                                             description="ok=False when the pooled top1_agreement is below this")

    @field_validator("baseline_url", "candidate_url")
    @classmethod
    def _http_url(cls, url: str | None) -> str | None:
        if url is not None and not url.startswith(("http://", "https://")):
            raise ValueError("expected an http:// or https:// base URL")
        return None if url is None else url.rstrip("/")

    @field_validator("percentiles")
    @classmethod
    def _pct(cls, pcts: list[float]) -> list[float]:
        for p in pcts:
            if not 0 < p <= 100:
                raise ValueError(f"expected percentiles in (0, 100], got {p:g}")
        return pcts


def load_prompts(path: Path | None = None) -> list[str]:
    """Paragraphs of a prompt file (blank lines between, ``#`` lines are comments)."""
    if path is None:
        text = resources.files("infra_agent.probes").joinpath("data").joinpath(DEFAULT_PROMPTS).read_text(encoding="utf-8")
    else:
        text = path.read_text(encoding="utf-8")
    prompts, current = [], []
    for line in text.splitlines():
        if line.lstrip().startswith("#"):
            continue
        if line.strip():
            current.append(line.strip())
        elif current:
            prompts.append(" ".join(current))
            current = []
    if current:
        prompts.append(" ".join(current))
    return prompts


class QualityProbe(Probe):
    name: ClassVar[str] = "quality"
    base_tier: ClassVar[Tier] = Tier.check
    Config: ClassVar[type[ProbeConfig]] = QualityConfig
    components: ClassVar[tuple[str, ...]] = ("model", "engine.cache", "kernel")
    locality: ClassVar[tuple[str, ...]] = ("precision",)

    @classmethod
    def measures(cls, metric: str) -> bool:
        return is_quality_metric(metric)

    def run(self, config: Any, ctx: ProbeContext) -> Feedback:
        cfg: QualityConfig = self.parse_config(config)  # type: ignore[assignment]
        fb = Feedback(probe=self.name, tier=self.tier(cfg), scope=self.scope)
        ws = ctx.workspace
        try:
            prompts = self._prompts(cfg, ws)
        except (OSError, InfraAgentError) as exc:
            fb.ok, fb.error = False, f"quality probe: cannot read the prompts: {exc}"
            return fb
        ctx.workdir.mkdir(parents=True, exist_ok=True)
        fb.meta["quality"] = {"prompts": len(prompts), "logprobs": cfg.logprobs,
                              "prompts_file": cfg.prompts_file or f"infra_agent/probes/data/{DEFAULT_PROMPTS}"}
        try:
            with ExitStack() as stack:
                base = self._baseline(cfg, ctx, stack)
                cand = self._candidate(cfg, ctx, stack)
                for side in (base, cand):
                    if side.target.log_path:
                        fb.artifacts.append(Artifact(kind="log", path=str(side.target.log_path),
                                                     description=f"{side.name} server log"))
                answers = self._ask(cfg, prompts, base, cand)
        except NoLogprobs as exc:
            return self._no_logprobs(fb, exc)
        except InfraAgentError as exc:
            fb.ok, fb.error = False, f"quality probe: {exc}"
            return fb
        self._compare(cfg, ctx, fb, prompts, answers, base, cand)
        return fb

    # ------------------------------------------------------------------ the servers

    def _prompts(self, cfg: QualityConfig, ws: Any) -> list[str]:
        path = None
        if cfg.prompts_file:
            path = Path(cfg.prompts_file)
            if not path.is_absolute():
                path = (ws.root if ws is not None else Path.cwd()) / path
        prompts = load_prompts(path)
        if cfg.num_prompts:
            prompts = prompts[: cfg.num_prompts]
        if not prompts:
            raise InfraAgentError(f"no prompts in {path or DEFAULT_PROMPTS}")
        return prompts

    def _launch(self, ctx: ProbeContext, stack: ExitStack, overrides: dict[str, Any]) -> tuple[Any, dict[str, Any]]:
        from infra_agent.serving.runner import default_log_dir
        from infra_agent.target import open_target

        ws = ctx.workspace
        values = ws.resolve_knobs(overrides)
        return stack.enter_context(open_target(ws, values, default_log_dir(ws))), dict(values)

    def _baseline(self, cfg: QualityConfig, ctx: ProbeContext, stack: ExitStack) -> Side:
        if cfg.baseline_url:
            return Side("baseline", UrlTarget(cfg.baseline_url, None), cfg.baseline_model or cfg.model, None)
        if ctx.workspace is None:
            raise InfraAgentError("the baseline needs a 'baseline_url' or a workspace target to launch")
        target, values = self._launch(ctx, stack, dict(cfg.baseline_knobs))
        return Side("baseline", target, cfg.baseline_model or cfg.model, values)

    def _candidate(self, cfg: QualityConfig, ctx: ProbeContext, stack: ExitStack) -> Side:
        if ctx.target is not None:
            return Side("candidate", ctx.target, cfg.model, {**ctx.knobs, **cfg.knobs})
        if cfg.candidate_url:
            return Side("candidate", UrlTarget(cfg.candidate_url, None), cfg.model, None)
        if ctx.workspace is None:
            raise InfraAgentError("the candidate needs a running target, a 'candidate_url' or a workspace target")
        target, values = self._launch(ctx, stack, {**ctx.knobs, **cfg.knobs})
        return Side("candidate", target, cfg.model, values)

    # ------------------------------------------------------------------ the requests

    def _ask(self, cfg: QualityConfig, prompts: list[str], base: Side,
             cand: Side) -> list[tuple[PromptLogprobs, PromptLogprobs]]:
        """Both servers' parsed answers per prompt; the first prompt goes to both before the rest."""
        out: list[tuple[PromptLogprobs, PromptLogprobs]] = []
        with httpx.Client(trust_env=False, timeout=cfg.timeout_s) as client:
            for side in (base, cand):
                if side.model is None:
                    side.model = discover_model(client, side)
            for i, prompt in enumerate(prompts):
                out.append((prompt_logprobs(client, base, i, prompt, max_tokens=cfg.max_tokens, logprobs=cfg.logprobs),
                            prompt_logprobs(client, cand, i, prompt, max_tokens=cfg.max_tokens, logprobs=cfg.logprobs)))
        return out

    def _no_logprobs(self, fb: Feedback, exc: NoLogprobs) -> Feedback:
        side = exc.side
        msg = (f"the {side.name} server ({side.url}) gives no teacher-forced prompt logprobs "
               f"(/v1/completions with echo and logprobs): {exc.why}")
        fb.ok, fb.error = False, msg
        fb.findings.append(Finding(
            kind=FindingKind.NO_LOGPROBS, severity="error", message=msg, location=Location(component="server"),
            evidence={"side": side.name, "url": side.url, "status": exc.status, "why": exc.why},
            next_question="Does this server support /v1/completions with echo: true and logprobs (vLLM does, and "
                          "refstack does)?  Without them no quality metric can be measured."))
        return fb

    # ------------------------------------------------------------------ the numbers

    def _compare(self, cfg: QualityConfig, ctx: ProbeContext, fb: Feedback, prompts: list[str],
                 answers: list[tuple[PromptLogprobs, PromptLogprobs]], base: Side, cand: Side) -> None:
        comparisons: list[PromptComparison] = []
        tokens: list[list[str]] = []
        skipped: list[dict[str, Any]] = []
        for i, (b, c) in enumerate(answers):
            try:
                comparisons.append(compare_prompt(b, c))
                tokens.append(b.tokens)
            except TokenMismatch as exc:
                skipped.append({"prompt": i, "why": str(exc)})
        if skipped:
            fb.findings.append(Finding(
                kind=FindingKind.TOKENIZATION_MISMATCH, severity="error" if not comparisons else "warning",
                message=f"{len(skipped)} of {len(answers)} prompt(s) were tokenised differently by the two servers "
                        "and left out", evidence={"skipped": skipped[:10]},
                next_question="Do both servers serve the same model with the same tokenizer?"))
        if not comparisons:
            fb.ok, fb.error = False, "the two servers tokenised every prompt differently: nothing to compare"
            return
        pcts = list(cfg.percentiles)
        samples = per_prompt(comparisons, pcts)
        whole = pooled(comparisons, pcts)
        changed = _changed_knobs(base.knobs, cand.knobs)
        for name, values in samples.items():
            direction = quality_metric_direction(name)
            unit = QUALITY_METRICS[name][1] if name in QUALITY_METRICS else "nats"
            fb.measurements.append(Measurement.from_samples(name, unit, values, direction, component="model"))
        worst = worst_positions(comparisons, tokens)
        q = fb.meta["quality"]
        q.update({"pooled": whole, "positions": int(whole["positions"]), "compared_prompts": len(comparisons),
                  "baseline": {"url": base.url, "model": base.model, "knobs": base.knobs},
                  "candidate": {"url": cand.url, "model": cand.model, "knobs": cand.knobs},
                  "changed_knobs": changed, "worst_positions": worst,
                  "metrics": {n: describe(n) for n in samples}})
        path = ctx.workdir / f"quality-{int(time.time() * 1000)}.json"
        path.write_text(json.dumps({**q, "per_prompt": samples,
                                    "positions_detail": [{"kl": c.kl, "top1": c.top1, "err": c.err} for c in comparisons]},
                                   default=str))
        fb.artifacts.append(Artifact(kind="result", path=str(path), description="quality probe: per-position numbers"))
        knob = next(iter(changed)) if len(changed) == 1 else None
        location = Location(component="model", knob=knob)
        p_hi = err_metric(max(pcts))
        summary = (f"KL(baseline || candidate) {whole['kl_div']:.3g} nats/token (a lower bound: the top-{cfg.logprobs} "
                   f"buckets resolve {whole['kl_resolved_mass']:.1%} of the baseline's mass), top-1 agreement {whole['top1_agreement']:.2%}, |logprob error| {p_hi[len('logprob_err_'):]} "
                   f"{whole[p_hi]:.3g}, over {int(whole['positions'])} positions of {len(comparisons)} prompt(s)"
                   + (f"; changed: {', '.join(f'{k}={v}' for k, v in changed.items())}" if changed else ""))
        failures = []
        if cfg.max_kl_div is not None and not whole["kl_div"] <= cfg.max_kl_div:
            failures.append(f"kl_div {whole['kl_div']:.3g} > {cfg.max_kl_div:g}")
        if cfg.min_top1_agreement is not None and not whole["top1_agreement"] >= cfg.min_top1_agreement:
            failures.append(f"top1_agreement {whole['top1_agreement']:.4f} < {cfg.min_top1_agreement:g}")
        fb.findings.insert(0, Finding(
            kind=FindingKind.LOGPROB_DIVERGENCE, severity="error" if failures else "info",
            message=("; ".join(failures) + ": " if failures else "") + summary, location=location,
            evidence={k: whole[k] for k in ("kl_div", "kl_div_max", "kl_resolved_mass", "top1_agreement", p_hi, "perplexity",
                                            "baseline_perplexity")} | {"worst": worst[:2]},
            next_question=("Which layer or knob moves the logprobs most (the worst positions are in the evidence)?"
                           if failures else None)))
        if failures:
            fb.ok, fb.error = False, "; ".join(failures)


def _changed_knobs(base: dict[str, Any] | None, cand: dict[str, Any] | None) -> dict[str, Any]:
    if base is None or cand is None:
        return {}
    return {k: v for k, v in cand.items() if base.get(k) != v}


__all__ = ["QualityConfig", "QualityProbe", "load_prompts"]
