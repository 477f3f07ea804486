"""Same answers before any speed counts: the candidate's greedy text against its parent's.

Each side's serving windows carry the server's greedy answers to a fixed probe set
(``serving/greedy_text.py``, in ``Feedback.meta["greedy"]``).  Where the change claims to
keep the model's numbers, which is every change except one of a knob declared
``changes_outputs: true`` (a precision, a quantisation, the weights), the judge walks each
prompt's tokens on both sides to the first that differs:

- none differs: the same answer;
- it differs where the parent's best two tokens were within ``TIE_NATS`` of each other
  and the candidate took the second: a near tie, which a reordered float sum may flip
  (another thread count, a fused kernel), forgiven; the rest of that answer is not compared,
  since everything after a different token differs;
- anything else: the answer changed, and the candidate is not accepted, however fast.

Without logprobs on the parent's side no difference can be called a tie.  A side whose
server could not answer the probe set leaves the comparison unmade, said so in the text.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass, field
from typing import Any

from infra_agent.feedback import Feedback

# Near tie: the parent's best two logprobs closer than this (nats).  Float reordering moves
# logprobs by about 1e-5 in fp32 and 1e-2 in bf16; a different model moves them by whole nats.
TIE_NATS = 0.1


@dataclass
class TextComparison:
    compared: int = 0  # prompts compared on both sides
    near_ties: int = 0  # answers that parted at a near tie (forgiven)
    changed: list[dict[str, Any]] = field(default_factory=list)  # {"prompt", "at", "parent", "candidate", "gap"}
    unmade: str | None = None  # why no comparison was made

    def text(self) -> str:
        if self.unmade:
            return f"greedy text not compared: {self.unmade}"
        if not self.changed:
            ties = f" ({self.near_ties} parted at a near tie)" if self.near_ties else ""
            return f"the same greedy text on {self.compared} fixed prompt(s){ties}"
        first = self.changed[0]
        gap = "no logprobs on the parent's side" if first["gap"] is None else f"the parent's top-2 gap {first['gap']:.3g} nats"
        return (f"its greedy text differs from the parent's on {len(self.changed)} of {self.compared} fixed prompt(s): "
                f"prompt {first['prompt']} token {first['at']} is {first['candidate']!r}, not {first['parent']!r} "
                f"({gap}, above a near tie's {TIE_NATS:g})")


def _first_difference(parent: list[dict[str, Any]], cand: list[dict[str, Any]]) -> int | None:
    for i in range(max(len(parent), len(cand))):
        p = parent[i]["token"] if i < len(parent) else None
        c = cand[i]["token"] if i < len(cand) else None
        if p != c:
            return i
    return None


def compare_answers(parent: dict[str, Any], candidate: dict[str, Any], tie_nats: float = TIE_NATS) -> TextComparison:
    """Compare two ``meta["greedy"]`` records (the same prompts, in order)."""
    for side, rec in (("parent", parent), ("candidate", candidate)):
        if rec.get("unavailable"):
            return TextComparison(unmade=f"the {side}'s server: {rec['unavailable']}")
    pa, ca = parent.get("answers") or [], candidate.get("answers") or []
    if len(pa) != len(ca) or parent.get("max_tokens") != candidate.get("max_tokens"):
        return TextComparison(unmade="the two sides answered different probe sets")
    out = TextComparison(compared=len(pa))
    for k, (p, c) in enumerate(zip(pa, ca, strict=True)):
        at = _first_difference(p["tokens"], c["tokens"])
        if at is None:
            continue
        here = p["tokens"][at] if at < len(p["tokens"]) else None
        took = c["tokens"][at]["token"] if at < len(c["tokens"]) else None
        gap = here.get("gap") if here else None
        if gap is not None and gap < tie_nats and took is not None and took == here.get("second"):
            out.near_ties += 1
            continue
        out.changed.append({"prompt": k, "at": at, "parent": here["token"] if here else None, "candidate": took,
                            "gap": gap})
    return out


def side_answers(runs: Sequence[Feedback]) -> dict[str, Any] | None:
    """A side's greedy answers: the first of its windows that has them."""
    for fb in runs:
        rec = fb.meta.get("greedy")
        if isinstance(rec, dict):
            return rec
    return None


def claims_same_outputs(workspace: Any, change: Any) -> bool:
    """Every change claims to keep the model's answers except one that moves a knob declared
    ``changes_outputs`` (a code change claims it too: a kernel rewrite must answer the same)."""
    knobs = getattr(workspace, "knobs", {}) or {}
    return not any(getattr(knobs.get(name), "changes_outputs", False) for name in (getattr(change, "knobs", None) or {}))


def text_change(workspace: Any, change: Any, candidate: dict[str, list[Feedback]],
                baseline: dict[str, list[Feedback]]) -> TextComparison | None:
    """The comparison the accept rule reads; None when there is nothing to hold the change to
    (it declares a new output, or neither side carries a probe set: not a serving A/B)."""
    if not claims_same_outputs(workspace, change):
        return None
    cand = side_answers([fb for runs in candidate.values() for fb in runs])
    base = side_answers([fb for runs in baseline.values() for fb in runs])
    if cand is None or base is None:
        return None
    return compare_answers(base, cand)


__all__ = ["TIE_NATS", "TextComparison", "claims_same_outputs", "compare_answers", "side_answers", "text_change"]
