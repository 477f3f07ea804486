"""Log-probabilities of generated tokens: computed on the engine thread, rendered in
OpenAI's shapes by the routes.

A request that asks for logprobs carries ``LogprobParams`` (``SamplingParams`` plus
how many alternatives to report, plus the list its entries go to).  ``LogprobEngine``
hooks the engine's sampling step: for just those rows of the step's logits it takes
the log-softmax, and as each of their tokens is appended it records the token's
log-probability and the top alternatives.  A step with no such request does one
``isinstance`` per sampled row and nothing else, so the default path stays as fast as
before.

What the numbers are: the log-softmax of the model's logits over the tokens the engine
can sample (unused padding ids and prompt-only specials are masked, as the sampler
masks them), before temperature and top-p, like vLLM's default ``raw_logprobs``.  One
entry per generated token, the EOS that ends a request included, so the entries sum to
the log-probability of the whole completion under the model.

**Prompt logprobs** (completions with ``echo``, ``LogprobParams.prompt_logprobs``):
teacher-forced, the log-probability of each *actual* prompt token given the tokens
before it, with the same top alternatives and the same masking as generated tokens.
The engine asks the model for the logits after every position of such a request's
prefill chunks (``HybridModel.forward_chunks_all_positions``), so a prompt prefilled
in chunks over several steps gets every entry; requests that do not ask cost nothing
more.  The first prompt token has no entry (nothing comes before it: OpenAI's shape
reports it as null).  A prompt token the engine never samples (a special token after
the first position) has probability 0 under that masked distribution, reported as
``FLOOR``.
"""

from __future__ import annotations

import math
from dataclasses import dataclass, field
from typing import Any

import torch

from refstack.engine.engine import Engine
from refstack.engine.request import Request
from refstack.engine.sampling import SamplingParams

# Most alternatives per token (vLLM's default --max-logprobs, and OpenAI chat's cap).
MAX_LOGPROBS = 20
# A log-probability that is -inf (or not a number) does not fit JSON; vLLM sends this.
FLOOR = -9999.0

# (token id, its log-probability, ((alternative id, log-probability), ...) best first)
Entry = tuple[int, float, tuple[tuple[int, float], ...]]


@dataclass(frozen=True, slots=True)
class LogprobParams(SamplingParams):
    """Sampling params of a request that wants logprobs; ``entries`` is filled by the engine thread."""

    logprobs: int = 0  # alternatives per token, 0 to MAX_LOGPROBS
    entries: list[Entry] = field(default_factory=list, compare=False, repr=False)
    # Also the prompt's tokens (echo): ``prompt_entries[j]`` is prompt token j + 1's entry.
    prompt_logprobs: bool = False
    prompt_entries: list[Entry] = field(default_factory=list, compare=False, repr=False)

    def __post_init__(self) -> None:
        SamplingParams.__post_init__(self)
        assert 0 <= self.logprobs <= MAX_LOGPROBS, f"logprobs must be in [0, {MAX_LOGPROBS}]"


class LogprobEngine(Engine):
    """The engine, recording logprob entries for requests whose params are ``LogprobParams``."""

    @property
    def prompt_logprobs_supported(self) -> bool:
        """Whether prompt logprobs (``LogprobParams.prompt_logprobs``) are filled in: the
        model must give the logits after every prompt position."""
        return hasattr(self.model, "forward_chunks_all_positions")

    def __init__(self, *args: Any, **kwargs: Any) -> None:
        super().__init__(*args, **kwargs)
        # This step's log-softmax rows, by request; only on the engine thread, and empty
        # outside _sample or when no request of the step asked for logprobs.
        self._step_logprobs: dict[Request, _Row] = {}

    def _sample(self, ready: list[Any]) -> None:
        wanted = [(c.request, c.request.params, row) for c, row in ready if isinstance(c.request.params, LogprobParams)]
        if not wanted:
            super()._sample(ready)
            return
        self._step_logprobs = self._log_softmax(wanted)
        try:
            super()._sample(ready)
        finally:
            self._step_logprobs = {}

    def _run_model(self, chunks: list[Any], seqs: list[Any]) -> torch.Tensor:
        every = [i for i, c in enumerate(chunks) if _prompt_rows(c) > 0]
        if not every or not self.prompt_logprobs_supported:
            return super()._run_model(chunks, seqs)
        last, rows = self.model.forward_chunks_all_positions(seqs, self.cache, every)
        for i in every:
            self._record_prompt(chunks[i], rows[i])
        return last  # type: ignore[no-any-return]

    def _record_prompt(self, chunk: Any, logits: torch.Tensor) -> None:
        """Entries for the prompt tokens this chunk's positions predict (teacher forcing)."""
        req, params = chunk.request, chunk.request.params
        m = _prompt_rows(chunk)
        first = chunk.start_pos + 1  # the prompt token the chunk's first position predicts
        rows = logits[:m].float().cpu()  # an inference tensor: masked out of place
        lp = torch.log_softmax(rows.masked_fill(self._unsampleable[: rows.shape[-1]], float("-inf")), dim=-1)
        targets = req.prompt_ids[first : first + m]
        chosen = lp.gather(1, torch.tensor(targets, dtype=torch.long).unsqueeze(1)).squeeze(1).tolist()
        k = min(params.logprobs, lp.shape[-1])
        if k:
            values, ids = lp.topk(k, dim=-1)
            tops = [tuple((i, finite(v)) for i, v in zip(r_ids, r_vals))
                    for r_ids, r_vals in zip(ids.tolist(), values.tolist())]
        else:
            tops = [()] * m
        params.prompt_entries.extend((tok, finite(v), top) for tok, v, top in zip(targets, chosen, tops))

    def _log_softmax(self, wanted: list[tuple[Request, LogprobParams, torch.Tensor]]) -> dict[Request, _Row]:
        logits = torch.stack([row for _, _, row in wanted]).float()
        logits.masked_fill_(self._unsampleable[: logits.shape[-1]], float("-inf"))
        lp = torch.log_softmax(logits, dim=-1)
        k = max(params.logprobs for _, params, _ in wanted)
        tops: list[list[tuple[int, float]]] = [[] for _ in wanted]
        if k:
            values, ids = lp.topk(min(k, lp.shape[-1]), dim=-1)
            for i, (_, params, _) in enumerate(wanted):
                n = params.logprobs
                tops[i] = list(zip(ids[i, :n].tolist(), values[i, :n].tolist()))
        return {req: (params, lp[i], tops[i]) for i, (req, params, _) in enumerate(wanted)}

    def _append_text(self, req: Request, tok: int) -> str | None:
        # Called once per sampled token, before the delta carrying it reaches the sink.
        got = self._step_logprobs.get(req) if self._step_logprobs else None
        if got is not None:
            params, row, top = got
            params.entries.append((tok, finite(float(row[tok])), tuple((i, finite(v)) for i, v in top)))
        return super()._append_text(req, tok)


# A request's share of a step: its params, its log-softmax row, its top alternatives.
_Row = tuple[LogprobParams, torch.Tensor, list[tuple[int, float]]]


def _prompt_rows(chunk: Any) -> int:
    """How many prompt tokens (after the first) this scheduled chunk's positions predict,
    for a request that wants prompt logprobs; 0 otherwise."""
    params = chunk.request.params
    if not (isinstance(params, LogprobParams) and params.prompt_logprobs):
        return 0
    end = min(chunk.start_pos + len(chunk.token_ids), len(chunk.request.prompt_ids) - 1)
    return max(0, end - chunk.start_pos)


def finite(x: float) -> float:
    return x if math.isfinite(x) else FLOOR


class LogprobCursor:
    """Hands out a request's entries in step with its deltas (one entry per token id)."""

    def __init__(self, params: SamplingParams) -> None:
        self.entries: list[Entry] = params.entries if isinstance(params, LogprobParams) else []
        self.enabled = isinstance(params, LogprobParams)
        self._next = 0

    def take(self, n: int) -> list[Entry]:
        # The engine thread appends a token's entry before it hands on the delta with
        # that token, so the entries for these n tokens are there already.
        got = self.entries[self._next : self._next + n]
        self._next += len(got)
        return got


class CompletionLogprobs:
    """OpenAI's legacy completions shape: ``{tokens, token_logprobs, top_logprobs, text_offset}``.

    ``top_logprobs[i]`` maps the best ``logprobs`` tokens (and, as vLLM does, the chosen
    one) to their log-probabilities; ``text_offset[i]`` is the character offset in the
    completion's text where token i's text starts.
    """

    def __init__(self, tokenizer: Any) -> None:
        self._tok = tokenizer
        self._decoder = tokenizer.stream_decoder()
        self._offset = 0

    def render_prompt(self, prompt_ids: list[int], entries: list[Entry], text_len: int) -> dict[str, Any]:
        """The echoed prompt's part (``echo``): its first token with null logprobs, then one
        entry per later prompt token; ``text_len`` is the echoed prompt text's length,
        where the generated tokens' offsets start."""
        text = self._tok.token_text
        first = prompt_ids[0]
        out: dict[str, Any] = {"tokens": [text(first)], "token_logprobs": [None], "top_logprobs": [None],
                               "text_offset": [0]}
        self._offset += len(self._decoder.feed(first))
        self._add(out, entries)
        self._offset = text_len
        self._decoder = self._tok.stream_decoder()
        return out

    def render(self, entries: list[Entry]) -> dict[str, Any]:
        out: dict[str, Any] = {"tokens": [], "token_logprobs": [], "top_logprobs": [], "text_offset": []}
        self._add(out, entries)
        return out

    def _add(self, out: dict[str, Any], entries: list[Entry]) -> None:
        text = self._tok.token_text
        for tok, lp, top in entries:
            out["tokens"].append(text(tok))
            out["token_logprobs"].append(lp)
            alts = {text(i): v for i, v in top}
            alts.setdefault(text(tok), lp)
            out["top_logprobs"].append(alts)
            out["text_offset"].append(self._offset)
            self._offset += len(self._decoder.feed(tok))


class ChatLogprobs:
    """OpenAI's chat shape: ``{"content": [{token, logprob, bytes, top_logprobs: [...]}]}``.

    ``bytes`` is the token's UTF-8 bytes as integers (null for a special token);
    ``top_logprobs`` holds exactly the ``top_logprobs`` best tokens, best first.
    """

    def __init__(self, tokenizer: Any) -> None:
        self._tok = tokenizer

    def _one(self, tok: int, lp: float) -> dict[str, Any]:
        raw = self._tok.token_bytes(tok)
        return {"token": self._tok.token_text(tok), "logprob": lp, "bytes": None if raw is None else list(raw)}

    def render(self, entries: list[Entry]) -> dict[str, Any]:
        return {"content": [{**self._one(tok, lp), "top_logprobs": [self._one(i, v) for i, v in top]}
                            for tok, lp, top in entries]}
