"""Sampling: greedy, temperature, top-p and per-request seeds; stop-string matching.

One request's draw never depends on the other requests in its batch: each request
owns its ``torch.Generator``, and rows are sampled one by one after a batched
softmax.  That is what makes a seeded request reproducible under any batching.
"""

from __future__ import annotations

from dataclasses import dataclass, field

import torch


@dataclass(frozen=True, slots=True)
class SamplingParams:
    """Per-request generation settings (the OpenAI fields the engine honours)."""

    max_tokens: int = 16
    temperature: float = 1.0
    top_p: float = 1.0
    seed: int | None = None
    stop: tuple[str, ...] = ()
    ignore_eos: bool = False

    def __post_init__(self) -> None:
        assert self.max_tokens >= 1, "max_tokens must be >= 1"
        assert self.temperature >= 0.0, "temperature must be >= 0"
        assert 0.0 < self.top_p <= 1.0, "top_p must be in (0, 1]"

    @property
    def greedy(self) -> bool:
        return self.temperature == 0.0


def make_generator(seed: int) -> torch.Generator:
    gen = torch.Generator(device="cpu")
    gen.manual_seed(seed)
    return gen


def sample_tokens(
    logits: torch.Tensor, params: list[SamplingParams], generators: list[torch.Generator]
) -> list[int]:
    """One token per row of ``logits`` [n, vocab]."""
    assert logits.dim() == 2 and logits.shape[0] == len(params) == len(generators)
    logits = logits.float()
    out = logits.argmax(dim=-1).tolist()
    random_rows = [i for i, p in enumerate(params) if not p.greedy]
    if not random_rows:
        return out
    idx = torch.tensor(random_rows)
    temps = torch.tensor([params[i].temperature for i in random_rows]).unsqueeze(1)
    probs = torch.softmax(logits.index_select(0, idx) / temps, dim=-1)
    for row, i in enumerate(random_rows):
        p = probs[row]
        if params[i].top_p < 1.0:
            p = _top_p_filter(p, params[i].top_p)
        out[i] = int(torch.multinomial(p, 1, generator=generators[i]).item())
    return out


def _top_p_filter(probs: torch.Tensor, top_p: float) -> torch.Tensor:
    """Keep the smallest set of most likely tokens whose mass reaches ``top_p``."""
    sorted_p, order = probs.sort(descending=True)
    cum = sorted_p.cumsum(0)
    # A token stays if the mass *before* it is below top_p, so the top token always stays.
    keep = (cum - sorted_p) < top_p
    filtered = torch.zeros_like(probs)
    filtered[order[keep]] = sorted_p[keep]
    return filtered / filtered.sum()


@dataclass(slots=True)
class StopMatcher:
    """Finds stop strings in a growing text and says how much of it is safe to emit.

    Text that could still turn into a stop string is held back, so a streaming client
    never sees the start of a stop string that later matches.
    """

    stops: tuple[str, ...]
    _longest: int = field(init=False)

    def __post_init__(self) -> None:
        self._longest = max((len(s) for s in self.stops), default=0)

    def find(self, text: str, start: int) -> int:
        """Index of the first stop string ending after ``start``, or -1."""
        if not self.stops:
            return -1
        lo = max(0, start - self._longest + 1)
        hits = [i for i in (text.find(s, lo) for s in self.stops) if i >= 0]
        return min(hits) if hits else -1

    def safe_len(self, text: str) -> int:
        """Length of the prefix of ``text`` that cannot be the start of a stop string."""
        for k in range(min(self._longest - 1, len(text)), 0, -1):
            tail = text[-k:]
            if any(s.startswith(tail) for s in self.stops):
                return len(text) - k
        return len(text)
