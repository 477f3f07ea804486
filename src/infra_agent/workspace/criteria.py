"""Criteria: the gates under ``criteria:`` in ``infra-agent.yaml``, and their metrics.

A :class:`Criterion` compares one metric against a baseline (``ratio``) or a fixed
``value``.  The metric is a key of a serving benchmark result (which way is better
comes from :func:`metric_direction`), a metric a shipped check probe reports
(:func:`check_metric_direction`), or, with ``custom: true``, one of the user's own.
"""

from __future__ import annotations

import re
from typing import TYPE_CHECKING, Literal

from pydantic import Field, model_validator

from infra_agent.workspace._base import _Strict
from infra_agent.workspace.knobs import MISSING, DomainError

if TYPE_CHECKING:
    from infra_agent.records import GateSpec

_HIGHER_BETTER = frozenset({"request_throughput", "output_throughput", "total_token_throughput", "request_goodput", "completed"})
_LOWER_BETTER = frozenset({"duration", "failed"})
# ``text_only_`` / ``image_``: a multimodal window's requests apart (serving/metrics.py).
_LATENCY = re.compile(r"^(?:text_only_|image_)?(mean|median|std|p\d+(\.\d+)?)_(ttft|tpot|itl|e2el)_ms$")


_COUNTS = frozenset({"total_input_tokens", "total_output_tokens"})  # result keys with no better direction
# Concrete latency keys offered as corrections (any pNN in (0, 100] is known).
_LATENCY_EXAMPLES = tuple(f"{s}_{m}_ms" for m in ("ttft", "tpot", "itl", "e2el")
                          for s in ("mean", "median", "std", "p50", "p90", "p95", "p99"))
METRIC_FORMS = ("request_throughput, output_throughput, total_token_throughput, request_goodput, completed, failed, "
                "duration, total_input_tokens, total_output_tokens, [text_only_|image_](mean|median|std|pNN)_(ttft|tpot|itl|e2el)_ms")


def metric_direction(metric: str) -> Literal["higher", "lower"] | None:
    """Which way is better for a vLLM-style result key; None when unknown."""
    if metric in _HIGHER_BETTER:
        return "higher"
    if metric in _LOWER_BETTER or _LATENCY.match(metric):
        return "lower"
    return None


def check_metric_direction(metric: str) -> Literal["higher", "lower"] | None:
    """Which way is better for a metric a shipped check probe reports (the quality probe's
    ``kl_div``, ``top1_agreement`` ...); None when no such probe reports it.  A criterion
    on such a metric names the check that measures it (``check:``)."""
    from infra_agent.workspace.check_metrics import quality_metric_direction

    return quality_metric_direction(metric)


def known_metric(metric: str) -> bool:
    """Whether a serving benchmark result holds ``metric`` (``pNN`` with 0 < NN <= 100)."""
    if metric in _HIGHER_BETTER or metric in _LOWER_BETTER or metric in _COUNTS:
        return True
    m = _LATENCY.match(metric)
    if m is None:
        return False
    stat = m.group(1)
    return not stat.startswith("p") or 0 < float(stat[1:]) <= 100


def metric_suggestions(metric: str, n: int = 3) -> list[str]:
    """Known result keys close to a misspelled ``metric`` (best first)."""
    import difflib

    names = sorted(_HIGHER_BETTER | _LOWER_BETTER | _COUNTS) + list(_LATENCY_EXAMPLES)
    return difflib.get_close_matches(metric, names, n=n, cutoff=0.6)


class Criterion(_Strict):
    """A gate: ``metric op ratio × baseline`` or ``metric op value``."""

    name: str
    metric: str
    scenario: str | None = None  # may be left out when there is one scenario
    # The workspace check whose probe measures ``metric`` (the quality probe's ``kl_div``):
    # the criterion is then judged on that check's Feedback, not on a scenario's windows.
    check: str | None = None
    op: Literal[">=", "<=", ">", "<"] | None = None  # defaults from the metric's direction
    ratio: float | None = Field(None, gt=0)
    value: float | None = None
    # A metric that no benchmark result holds (a probe's own measurement): its name is
    # not checked, and ``op`` must be given.
    custom: bool = False

    @model_validator(mode="after")
    def _known_metric(self) -> Criterion:
        if self.check is not None or check_metric_direction(self.metric) is not None:
            return self  # a check's metric (Workspace._cross_checks pairs the two)
        if not self.custom and not known_metric(self.metric):
            close = metric_suggestions(self.metric)
            known = f"did you mean {close[0]!r}?" if close else f"one of {METRIC_FORMS}"
            raise DomainError(("metric",), f"a metric a benchmark result holds ({known}), or `custom: true` on the "
                              "criterion for a metric of your own", self.metric)
        return self

    @model_validator(mode="after")
    def _one_threshold(self) -> Criterion:
        if (self.ratio is None) == (self.value is None):
            got = "both" if self.ratio is not None else "neither"
            raise DomainError((), "exactly one of `ratio` (relative to baseline) or `value` (absolute)", got)
        if self.op is None:
            direction = metric_direction(self.metric) or check_metric_direction(self.metric)
            if direction is None:
                raise DomainError(("op",), f"an explicit op (>=, <=, >, <), as metric {self.metric!r} has no known direction", MISSING)
            self.op = ">=" if direction == "higher" else "<="
        return self

    @property
    def relative(self) -> bool:
        return self.ratio is not None

    @property
    def spec(self) -> GateSpec:
        """The criterion as a gate: the one form every later layer reads (never its text)."""
        # Imported here: the records load numpy (Feedback), and loading a workspace stays light.
        from infra_agent.records import GateSpec

        assert self.op is not None  # _one_threshold defaulted it
        threshold = self.ratio if self.ratio is not None else self.value
        assert threshold is not None
        return GateSpec(kind="relative" if self.relative else "absolute", metric=self.metric, op=self.op,
                        threshold=float(threshold), scenario=self.scenario, check=self.check)
