"""Teacher-forced logprobs and greedy tokens from real servers, and how two of them differ."""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

import httpx

from infra_agent.probes.quality import load_prompts
from infra_agent.probes.quality_metrics import PromptLogprobs, parse_echo, top1

# The quality probe's shipped prompt set: fixed, plain ASCII, each fits the tiny context.
PROMPTS = load_prompts()[:10]
FLAGS = ("--cpu-kernels", "torch", "--dtype", "float32", "--torch-threads", "1")


def fp32_bound(logprob: float) -> float:
    """How far a TP run's logprob may be from the single rank's at fp32: the kernel lab's
    partition contract (examples/tp-numerics, ``FP32_LEVEL``: 3e-5 + 1e-5·|x| elementwise),
    "TP reproduces the single-device result up to fp32 summation order".  Why that covers
    a whole forward: TP changes only the association of sums (the row-parallel o_proj is
    a sum of 2 partial dot products of length 32 instead of one of 64; the experts' GEMMs
    run on other row groupings; the gather moves bytes), each a few fp32 ulps (2^-24
    relative) of O(1) activations; four layers of residual stream carry a few ulps on,
    and a log-softmax of |x| <= ~10 adds ~1e-6.  Measured: <= 2e-6."""
    return 3e-5 + 1e-5 * abs(logprob)


def echo(url: str) -> list[PromptLogprobs]:
    """Every prompt position's teacher-forced logprob and top-20 (the quality probe's request)."""
    out = []
    with httpx.Client(timeout=120) as client:
        for prompt in PROMPTS:
            r = client.post(url + "/v1/completions", json={"prompt": prompt, "max_tokens": 0, "echo": True,
                                                          "logprobs": 20, "temperature": 0})
            r.raise_for_status()
            out.append(parse_echo(r.json()))
    return out


def greedy(url: str, max_tokens: int = 16) -> list[list[str]]:
    """Each prompt's greedy completion as tokens (names, so invalid UTF-8 compares exactly)."""
    out = []
    with httpx.Client(timeout=120) as client:
        for prompt in PROMPTS:
            r = client.post(url + "/v1/completions", json={"prompt": prompt, "max_tokens": max_tokens,
                                                          "temperature": 0, "logprobs": 0, "ignore_eos": True})
            r.raise_for_status()
            out.append(r.json()["choices"][0]["logprobs"]["tokens"])
    return out


@dataclass
class Difference:
    positions: int
    max_err: float  # largest |logprob difference| over every token both top-20s list
    worst_excess: float  # largest |difference| - fp32_bound: > 0 means outside the bound
    top1_flips: list[tuple[int, int, float]]  # (prompt, position, the single rank's top-2 gap there)

    def describe(self) -> str:
        return (f"{self.positions} positions, max |logprob diff| {self.max_err:.3g}, "
                f"{len(self.top1_flips)} top-1 flips {self.top1_flips[:5]}")


def difference(single: list[PromptLogprobs], tp: list[PromptLogprobs]) -> Difference:
    positions, max_err, excess = 0, 0.0, float("-inf")
    flips: list[tuple[int, int, float]] = []
    for p, (a, b) in enumerate(zip(single, tp)):
        assert a.tokens == b.tokens, "the same prompt tokenizes the same"
        for i, (ta, tb) in enumerate(zip(a.top, b.top)):
            positions += 1
            for tok in ta.keys() & tb.keys():
                err = abs(ta[tok] - tb[tok])
                max_err = max(max_err, err)
                excess = max(excess, err - fp32_bound(ta[tok]))
            if top1(ta) != top1(tb):
                ranked = sorted(ta.values(), reverse=True)
                flips.append((p, i, ranked[0] - ranked[1]))
    return Difference(positions, max_err, excess, flips)


def as_json(d: Difference) -> dict[str, Any]:
    return {"positions": d.positions, "max_err": d.max_err, "flips": len(d.top1_flips)}
