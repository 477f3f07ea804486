"""Per-request stream timing under the two latency definitions a client can use.

``vllm`` (the default) is what ``vllm bench serve`` measures, so our numbers compare
with the ones users already quote:

- every streamed chunk that carries ``choices`` is a token event, *including* chunks
  whose text is empty (special tokens, a partial UTF-8 character);
- one deviation: a chat chunk that only announces the role (``delta.role``, no text)
  is not a token.  vLLM's server sends it with the first token, about 0.1 ms before the
  token's own chunk, so leaving it out moves TTFT by that much and drops one near-zero
  ITL gap per chat answer; a server that sends it at once (refstack does) would
  otherwise have its TTFT read as the HTTP round trip, queueing left out;
- TTFT is send -> the first such chunk; each later one adds one ITL gap;
- E2EL ends at the last such chunk (the trailing usage chunk and ``[DONE]`` do not
  move it).

``content`` is the stricter reading: only chunks with non-empty text count (a chat
answer's ``content``, ``reasoning_content`` or ``reasoning``), so TTFT is the first
visible character and an empty chunk's gap merges into the next one; E2EL ends with the
stream.  On a server that streams many empty chunks the two disagree a lot (TTFT later,
fewer and longer ITL gaps), which is why a result reports both, labelled.

A request whose stream had token chunks but no text at all (only special tokens) is a
valid completion under both: its tokens come from ``usage``; it just has no
content-based TTFT.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Literal

LatencyDefinition = Literal["vllm", "content"]
LATENCY_DEFINITIONS: tuple[LatencyDefinition, ...] = ("vllm", "content")


@dataclass(slots=True)
class Timeline:
    """One definition's view of a stream: first event, gaps, last event (perf_counter seconds)."""

    first: float | None = None
    last: float | None = None
    gaps: list[float] = field(default_factory=list)
    events: int = 0

    def event(self, now: float) -> None:
        if self.first is None:
            self.first = now
        else:
            assert self.last is not None
            self.gaps.append(now - self.last)
        self.last = now
        self.events += 1


@dataclass(slots=True)
class StreamClock:
    """Fed one parsed data chunk at a time; keeps both definitions in one pass."""

    start: float
    chunks: Timeline = field(default_factory=Timeline)  # vllm: chunks with choices
    content: Timeline = field(default_factory=Timeline)  # content: chunks with text

    def chunk(self, now: float, has_choices: bool, has_text: bool) -> None:
        if has_choices:
            self.chunks.event(now)
        if has_text:
            self.content.event(now)
