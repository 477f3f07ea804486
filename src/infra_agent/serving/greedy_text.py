"""What a server answers greedily to a fixed probe set: the text behind the speed.

A change that claims to keep the model's numbers (a scheduler knob, a kernel rewrite, a
code change) must leave the answers as they were: a server that answers from other
weights, skips layers or samples from a cheaper model is faster at a different job.  The
serving probe asks every server it measures, once (the answers are a property of the
configuration, not of the load), for greedy completions of :data:`PROMPTS`: ``POST
/v1/completions`` with ``temperature: 0``, ``max_tokens`` tokens and the top-2 logprobs of
each, sent one at a time on an otherwise idle server, so no batch composition moves them.
The judge compares the two sides of an experiment (``judge/greedy_text.py``).

A server that cannot answer this (no completions endpoint, no logprobs) is recorded as
such, with the reason, and the comparison is then not made: it never counts as agreement.
"""

from __future__ import annotations

import math
from typing import Any

import httpx

# Fixed, plain prompts: the same on both sides of every experiment and in every run.
PROMPTS: tuple[str, ...] = (
    "The capital of France is",
    "def fibonacci(n):\n    ",
    "Once upon a time, in a small village by the sea,",
    "The three primary colours are",
)
DEFAULT_TOKENS = 12
TIMEOUT_S = 60.0


def _position(top: Any, chosen: str) -> dict[str, Any]:
    """One generated token: its text and the gap (nats) between the best and second-best logprob."""
    if not isinstance(top, dict) or not top:
        return {"token": chosen, "gap": None}
    ranked = sorted(((str(k), float(v)) for k, v in top.items() if isinstance(v, (int, float)) and math.isfinite(v)),
                    key=lambda kv: -kv[1])
    return {"token": chosen, "gap": ranked[0][1] - ranked[1][1] if len(ranked) >= 2 else None,
            "second": next((k for k, _ in ranked if k != chosen), None)}


def greedy_answers(url: str, model: str | None, headers: dict[str, str] | None = None,
                   max_tokens: int = DEFAULT_TOKENS, prompts: tuple[str, ...] = PROMPTS) -> dict[str, Any]:
    """The server's greedy answers to ``prompts``, as JSON for ``Feedback.meta["greedy"]``:
    ``{"answers": [{"text", "tokens": [{"token", "gap", "second"}]}], "max_tokens"}``, or
    ``{"unavailable": reason}`` when the server cannot give them."""
    answers = []
    base = url.rstrip("/")
    try:
        with httpx.Client(timeout=TIMEOUT_S, headers=headers or {}) as client:
            for prompt in prompts:
                body: dict[str, Any] = {"prompt": prompt, "max_tokens": max_tokens, "temperature": 0, "logprobs": 2,
                                        "stream": False}
                if model:
                    body["model"] = model
                r = client.post(f"{base}/v1/completions", json=body)
                if r.status_code != 200:
                    return {"unavailable": f"POST /v1/completions answered HTTP {r.status_code}: {r.text[:200]}"}
                choice = (r.json().get("choices") or [{}])[0]
                lp = choice.get("logprobs") or {}
                tokens, tops = lp.get("tokens"), lp.get("top_logprobs")
                if not isinstance(tokens, list) or not isinstance(tops, list) or len(tokens) != len(tops):
                    return {"unavailable": "the completions answer has no per-token logprobs (logprobs: 2)"}
                answers.append({"text": str(choice.get("text", "")),
                                "tokens": [_position(t, str(tok)) for tok, t in zip(tokens, tops, strict=True)]})
    except (httpx.HTTPError, ValueError) as exc:
        return {"unavailable": f"the greedy probe set could not be sent: {type(exc).__name__}: {exc}"[:300]}
    return {"answers": answers, "max_tokens": max_tokens}


def answers_for(target: Any, max_tokens: int = DEFAULT_TOKENS) -> dict[str, Any]:
    """``greedy_answers`` of a running target, asked once per target object and kept on it: a
    server kept up across windows and experiments answers the same configuration the same."""
    cached = getattr(target, "_greedy_answers", None)
    if isinstance(cached, dict) and cached.get("max_tokens", max_tokens) == max_tokens:
        return cached
    got = greedy_answers(target.url, getattr(target, "model", None), getattr(target, "request_headers", None) or {},
                         max_tokens)
    try:
        target._greedy_answers = got
    except AttributeError:  # a target type without a __dict__: asked again next time
        pass
    return got


__all__ = ["DEFAULT_TOKENS", "PROMPTS", "answers_for", "greedy_answers"]
