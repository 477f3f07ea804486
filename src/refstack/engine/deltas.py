"""A request's output as its sink sees it: sampled tokens turned into text, and that text
handed out in deltas.

``extend_text`` feeds one sampled token through the request's stream decoder and ends the
request on an EOS token or a stop string; ``take_delta`` is the next ``RequestOutput`` for
the sink, holding back text that may still turn out to be a stop string's beginning.  Both
touch one request alone (the engine's ``_append_text`` and ``_emit`` call them, and
subclasses extend those), so they are written apart from the engine's locks and threads.
"""

from __future__ import annotations

from collections.abc import Collection

from refstack.engine.request import Request, RequestOutput

__all__ = ["extend_text", "take_delta"]


def extend_text(req: Request, tok: int, eos_ids: Collection[int]) -> str | None:
    """Extend the request's text; the finish reason if an EOS or stop string ended it."""
    if tok in eos_ids and not req.params.ignore_eos:
        return "stop"
    checked = len(req.text)
    req.text += req.decoder.feed(tok)
    cut = req.stop_matcher.find(req.text, checked)
    if cut >= 0:
        req.text = req.text[:cut]
        req.decoder.flush()  # drop any partial character after the stop string
        return "stop"
    return None


def take_delta(req: Request, finished: bool) -> RequestOutput | None:
    """The text and token ids the sink has not seen yet (None when there are none and the
    request goes on).  Text that could still be the start of a stop string stays back until
    it cannot, or until the request finishes."""
    upto = len(req.text) if finished else min(len(req.text), req.stop_matcher.safe_len(req.text))
    upto = max(upto, req.emitted_chars)
    delta = req.text[req.emitted_chars : upto]
    new_ids = tuple(req.output_ids[req.emitted_tokens :])
    if not delta and not new_ids and not finished:
        return None
    req.emitted_chars = upto
    req.emitted_tokens = len(req.output_ids)
    return RequestOutput(req.request_id, delta, new_ids, finished, req.finish_reason,
                         len(req.prompt_ids), len(req.output_ids))
