"""Metrics of the shipped check probes that a workspace criterion can name.

A criterion on one of these names the workspace check that measures it (``check:``)
and is judged on that check's Feedback (:func:`infra_agent.judge.gates.criteria_gates`).
Today these are the quality probe's (:mod:`infra_agent.probes.quality`).  This module
imports nothing heavy: loading a workspace reads it.
"""

from __future__ import annotations

import re
from typing import Final, Literal

#: Every metric the quality probe reports: name -> (better direction, unit, description).
#: ``logprob_err_pNN`` is any percentile; the probe reports those in its ``percentiles``.
QUALITY_METRICS: Final[dict[str, tuple[Literal["higher", "lower"], str, str]]] = {
    "kl_div": ("lower", "nats/token",
               ("KL(baseline || candidate) per prompt position, over the union of both servers' top-N tokens with "
                "the remaining probability mass lumped into one 'other' bucket: a LOWER BOUND of the true KL "
                "(only top-N logprobs come over the API); one sample per prompt (its mean over positions)")),
    "top1_agreement": ("higher", "ratio",
                       ("share of prompt positions where both servers' most likely token is the same; one sample "
                        "per prompt")),
    "logprob_err_p50": ("lower", "nats",
                        ("median over a prompt's positions of |logprob_baseline(actual) - logprob_candidate(actual)|: "
                         "the actual token's log-probability error (raw logits are not available over the API); one "
                         "sample per prompt")),
    "logprob_err_p90": ("lower", "nats", "p90 of the actual token's |logprob difference| (see logprob_err_p50)"),
    "logprob_err_p99": ("lower", "nats", "p99 of the actual token's |logprob difference| (see logprob_err_p50)"),
    "perplexity": ("lower", "ppl",
                   ("the candidate's perplexity on the prompt set, exp(mean -logprob of the actual tokens); "
                    "meaningful only for a model with real weights (random-weight presets sit near the vocabulary "
                    "size); one sample per prompt")),
    "baseline_perplexity": ("lower", "ppl", "the baseline server's perplexity on the same prompts (see perplexity)"),
    "perplexity_ratio": ("lower", "ratio", "candidate perplexity / baseline perplexity, per prompt"),
}
_ERR_PCT = re.compile(r"^logprob_err_p(\d+(?:\.\d+)?)$")


def quality_metric_direction(metric: str) -> Literal["higher", "lower"] | None:
    """Which way is better for a quality metric; None when ``metric`` is not one."""
    if metric in QUALITY_METRICS:
        return QUALITY_METRICS[metric][0]
    m = _ERR_PCT.match(metric)
    return "lower" if m is not None and 0 < float(m.group(1)) <= 100 else None


def is_quality_metric(metric: str) -> bool:
    return quality_metric_direction(metric) is not None


def err_metric(pct: float) -> str:
    """``logprob_err_p99`` for 99, ``logprob_err_p99.9`` for 99.9."""
    return f"logprob_err_p{pct:g}"


def describe(metric: str) -> str:
    if metric in QUALITY_METRICS:
        return QUALITY_METRICS[metric][2]
    if _ERR_PCT.match(metric):
        return f"{metric[len('logprob_err_'):]} of the actual token's |logprob difference| (see logprob_err_p50)"
    return ""
