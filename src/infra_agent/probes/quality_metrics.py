"""The quality probe's numbers: teacher-forced prompt logprobs of two servers, compared.

Pure functions over the OpenAI legacy completions ``logprobs`` object of an ``echo``
answer (``{tokens, token_logprobs, top_logprobs, text_offset}``, the first prompt
token's entries null), so they can be tested without a server.  The metric names and
directions a criterion can use are in :mod:`infra_agent.workspace.check_metrics`.

Per position ``i >= 1`` of a prompt (the first token has no logprob), with ``P`` the
baseline server's and ``Q`` the candidate's reported distribution:

- ``kl``: KL(P || Q) over the buckets "each token reported by both servers" plus one
  "other" bucket holding the rest of each side's probability mass.  The API reports a
  top-N per side, not the distribution: a token in one side's top-N but not the other's
  has no known probability on the other side, so it joins "other" on both sides.
  Both sides then share one partition of the vocabulary, and the KL of a coarsened
  pair of distributions never exceeds the KL of the full pair (the log-sum
  inequality): **the value is a lower bound of the true KL**, tight when the top-N
  sets hold most of the mass.
- ``top1``: whether both servers' most likely token is the same one.
- ``err``: ``|log P(actual) - log Q(actual)|``, the absolute difference of the actual
  token's logprob.  The API gives logprobs, not raw logits, so this is the error of
  the normalised log-probability, not of a logit.
- ``nll_baseline`` / ``nll_candidate``: ``-log P(actual)``; ``exp`` of their mean is a
  server's perplexity on the prompt set, meaningful only for a model with real
  weights (refstack's presets draw random weights: their perplexity is near the
  vocabulary's size and says nothing about language).
"""

from __future__ import annotations

import math
from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field
from typing import Any

from infra_agent.workspace.check_metrics import (  # noqa: F401 - re-exported: the probe's metric names
    QUALITY_METRICS,
    describe,
    err_metric,
    is_quality_metric,
    quality_metric_direction,
)

# Probability mass below this is treated as none (an "other" bucket that rounding left).
_EPS = 1e-12

# ---------------------------------------------------------------- one answer


class Unusable(ValueError):
    """An answer that holds no teacher-forced prompt logprobs; the message says why."""


@dataclass
class PromptLogprobs:
    """One server's teacher-forced logprobs of one prompt, positions 1..L-1."""

    first_token: str
    tokens: list[str]
    token_logprobs: list[float]
    top: list[dict[str, float]]  # the reported top-N (and the actual token) per position

    def __len__(self) -> int:
        return len(self.tokens)


def parse_echo(answer: Mapping[str, Any]) -> PromptLogprobs:
    """The prompt's logprobs from a ``/v1/completions`` answer to ``echo: true, logprobs: N``.

    Raises :class:`Unusable` when the answer holds none: no ``logprobs`` (a server that
    ignores the parameter), or a first token with a logprob (a server that ignored
    ``echo``: those are generated tokens, not the prompt's)."""
    choices = answer.get("choices")
    if not isinstance(choices, list) or not choices or not isinstance(choices[0], Mapping):
        raise Unusable("the answer has no choices")
    lp = choices[0].get("logprobs")
    if not isinstance(lp, Mapping):
        raise Unusable("the answer has no logprobs (choices[0].logprobs is "
                       + ("missing)" if "logprobs" not in choices[0] else f"{type(lp).__name__})"))
    tokens, values, tops = lp.get("tokens"), lp.get("token_logprobs"), lp.get("top_logprobs")
    if not (isinstance(tokens, list) and isinstance(values, list) and isinstance(tops, list)) \
            or not len(tokens) == len(values) == len(tops):
        raise Unusable("the logprobs lack equal-length tokens, token_logprobs and top_logprobs lists")
    usage = answer.get("usage")
    n = len(tokens)
    if isinstance(usage, Mapping) and isinstance(usage.get("prompt_tokens"), int):
        n = min(n, int(usage["prompt_tokens"]))  # max_tokens 1: a generated token may follow the prompt
    if n < 2:
        raise Unusable(f"the logprobs cover {n} token(s); an echoed prompt needs at least 2")
    if values[0] is not None:
        raise Unusable("the first token has a logprob, so these are not the prompt's (was echo ignored?)")
    out = PromptLogprobs(first_token=str(tokens[0]), tokens=[], token_logprobs=[], top=[])
    for i in range(1, n):
        value = values[i]
        if not isinstance(value, (int, float)) or isinstance(value, bool) or math.isnan(value):
            raise Unusable(f"position {i} has no logprob ({value!r})")
        top = tops[i] if isinstance(tops[i], Mapping) else {}
        entry = {str(k): float(v) for k, v in top.items() if isinstance(v, (int, float)) and not isinstance(v, bool)}
        entry.setdefault(str(tokens[i]), float(value))
        out.tokens.append(str(tokens[i]))
        out.token_logprobs.append(float(value))
        out.top.append(entry)
    return out


# ---------------------------------------------------------------- one position


def bucket_kl(p_top: Mapping[str, float], q_top: Mapping[str, float]) -> float:
    """KL(P || Q) over the tokens both report plus one "other" bucket (a lower bound, >= 0)."""
    shared = [t for t in p_top if t in q_top]
    kl = 0.0
    p_known = q_known = 0.0
    for t in shared:
        lp, lq = p_top[t], q_top[t]
        p = math.exp(lp)
        p_known += p
        q_known += math.exp(lq)
        if p > 0.0:
            kl += p * (lp - lq)
    p_other, q_other = max(0.0, 1.0 - p_known), max(0.0, 1.0 - q_known)
    if p_other > _EPS:
        kl += p_other * (math.log(p_other) - math.log(max(q_other, _EPS)))
    return max(kl, 0.0)


def top1(top: Mapping[str, float]) -> str:
    return max(top.items(), key=lambda kv: kv[1])[0]


# ---------------------------------------------------------------- a prompt set


@dataclass
class PromptComparison:
    """Per-position numbers of one prompt, baseline against candidate."""

    kl: list[float]
    top1: list[bool]
    err: list[float]
    nll_baseline: list[float]
    nll_candidate: list[float]
    top1_tokens: list[tuple[str, str]] = field(default_factory=list)  # (baseline's, candidate's) per position
    # The baseline's probability mass in the KL's singleton buckets (the rest is "other"):
    # how much of the distribution the lower bound resolves.
    resolved: list[float] = field(default_factory=list)


class TokenMismatch(ValueError):
    """The two servers tokenised a prompt differently: positions cannot be paired."""


def compare_prompt(base: PromptLogprobs, cand: PromptLogprobs) -> PromptComparison:
    if base.tokens != cand.tokens or base.first_token != cand.first_token:
        diff = next((i for i, (a, b) in enumerate(zip(base.tokens, cand.tokens)) if a != b), min(len(base), len(cand)))
        raise TokenMismatch(f"{len(base) + 1} vs {len(cand) + 1} tokens, first difference at position {diff + 1}")
    out = PromptComparison([], [], [], [], [])
    for tb, tc, lb, lc in zip(base.top, cand.top, base.token_logprobs, cand.token_logprobs):
        out.kl.append(bucket_kl(tb, tc))
        out.resolved.append(min(1.0, sum(math.exp(v) for t, v in tb.items() if t in tc)))
        a, b = top1(tb), top1(tc)
        out.top1.append(a == b)
        out.top1_tokens.append((a, b))
        out.err.append(abs(lb - lc))
        out.nll_baseline.append(-lb)
        out.nll_candidate.append(-lc)
    return out


def percentile(values: Sequence[float], pct: float) -> float:
    """Linear-interpolation percentile (numpy's default), without numpy."""
    xs = sorted(values)
    if not xs:
        return math.nan
    k = (len(xs) - 1) * pct / 100.0
    lo, hi = math.floor(k), math.ceil(k)
    return xs[lo] + (xs[hi] - xs[lo]) * (k - lo)


def _mean(xs: Sequence[float]) -> float:
    return sum(xs) / len(xs) if xs else math.nan


def per_prompt(comparisons: Sequence[PromptComparison], percentiles: Sequence[float]) -> dict[str, list[float]]:
    """One sample per prompt of every metric (what the Feedback's measurements hold)."""
    out: dict[str, list[float]] = {"kl_div": [], "top1_agreement": [], **{err_metric(p): [] for p in percentiles},
                                   "perplexity": [], "baseline_perplexity": [], "perplexity_ratio": []}
    for c in comparisons:
        if not c.kl:
            continue
        out["kl_div"].append(_mean(c.kl))
        out["top1_agreement"].append(sum(c.top1) / len(c.top1))
        for p in percentiles:
            out[err_metric(p)].append(percentile(c.err, p))
        ppl_b, ppl_c = _ppl(c.nll_baseline), _ppl(c.nll_candidate)
        out["perplexity"].append(ppl_c)
        out["baseline_perplexity"].append(ppl_b)
        out["perplexity_ratio"].append(ppl_c / ppl_b if ppl_b > 0 and math.isfinite(ppl_b) else math.nan)
    return out


def pooled(comparisons: Sequence[PromptComparison], percentiles: Sequence[float]) -> dict[str, float]:
    """Every metric over all positions of all prompts together (token-weighted)."""
    kl = [x for c in comparisons for x in c.kl]
    agree = [x for c in comparisons for x in c.top1]
    err = [x for c in comparisons for x in c.err]
    nb = [x for c in comparisons for x in c.nll_baseline]
    nc = [x for c in comparisons for x in c.nll_candidate]
    ppl_b, ppl_c = _ppl(nb), _ppl(nc)
    resolved = [x for c in comparisons for x in c.resolved]
    out = {"positions": float(len(kl)), "kl_div": _mean(kl), "kl_div_max": max(kl, default=math.nan),
           "kl_resolved_mass": _mean(resolved),
           "top1_agreement": sum(agree) / len(agree) if agree else math.nan,
           "perplexity": ppl_c, "baseline_perplexity": ppl_b,
           "perplexity_ratio": ppl_c / ppl_b if ppl_b > 0 and math.isfinite(ppl_b) else math.nan}
    out.update({err_metric(p): percentile(err, p) for p in percentiles})
    return out


def _ppl(nll: Sequence[float]) -> float:
    if not nll:
        return math.nan
    m = _mean(nll)
    return math.exp(m) if m < 700 else math.inf


def worst_positions(comparisons: Sequence[PromptComparison], tokens: Sequence[Sequence[str]],
                    n: int = 3) -> list[dict[str, Any]]:
    """The ``n`` positions with the largest KL: prompt, position, the token and each side's top-1."""
    rows = [(c.kl[j], i, j) for i, c in enumerate(comparisons) for j in range(len(c.kl)) if c.kl[j] > 0]
    rows.sort(reverse=True)
    return [{"prompt": i, "position": j + 1, "token": tokens[i][j], "kl": kl,
             "top1_baseline": comparisons[i].top1_tokens[j][0], "top1_candidate": comparisons[i].top1_tokens[j][1],
             "logprob_err": comparisons[i].err[j]} for kl, i, j in rows[:n]]
