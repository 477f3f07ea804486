"""What rank 0 tells the other ranks each step, as two broadcasts of int64 host tensors.

Rank 0 runs the scheduler; the others only mirror its forwards.  A step is the chunks
(slot, start position, token ids) and, for teacher-forced prompt logprobs, which chunks
want logits at every position.  A fixed four-word header (op, chunks, tokens, every)
says how long the payload is, so no pickling and no size guess: ``[slot, start,
length] * chunks``, the token ids, the ``every`` indices.
"""

from __future__ import annotations

from collections.abc import Collection, Sequence
from dataclasses import dataclass

import torch

from infra_agent import tracing
from refstack.model.batch import SeqChunk
from refstack.tp.comm import Comm

OP_FORWARD, OP_STOP = 1, 2
HEADER_WORDS = 4


@dataclass(frozen=True, slots=True)
class StepMessage:
    op: int
    chunks: tuple[SeqChunk, ...] = ()
    every: tuple[int, ...] = ()


def encode(chunks: Sequence[SeqChunk], every: Collection[int]) -> tuple[torch.Tensor, torch.Tensor]:
    tokens = [t for c in chunks for t in c.token_ids]
    meta = [v for c in chunks for v in (c.slot, c.start_pos, len(c.token_ids))]
    header = torch.tensor([OP_FORWARD, len(chunks), len(tokens), len(every)], dtype=torch.int64)
    return header, torch.tensor(meta + tokens + sorted(every), dtype=torch.int64)


def decode(header: torch.Tensor, payload: torch.Tensor) -> StepMessage:
    op, n_chunks, n_tokens, _ = (int(v) for v in header.tolist())
    if op != OP_FORWARD:
        return StepMessage(op)
    words = payload.tolist()
    meta, tokens = words[: 3 * n_chunks], words[3 * n_chunks : 3 * n_chunks + n_tokens]
    every = words[3 * n_chunks + n_tokens :]
    chunks, at = [], 0
    for i in range(n_chunks):
        slot, start, length = meta[3 * i : 3 * i + 3]
        chunks.append(SeqChunk(slot=slot, token_ids=tokens[at : at + length], start_pos=start))
        at += length
    return StepMessage(op, tuple(chunks), tuple(every))


def send_step(comm: Comm, chunks: Sequence[SeqChunk], every: Collection[int]) -> None:
    """Rank 0: announce a forward over ``chunks``."""
    header, payload = encode(chunks, every)
    with tracing.span("tp.broadcast", cat="tp", what="step", rank=comm.rank, bytes=8 * (4 + payload.numel())):
        comm.broadcast_host(header)
        comm.broadcast_host(payload)


def send_stop(comm: Comm) -> None:
    comm.broadcast_host(torch.tensor([OP_STOP, 0, 0, 0], dtype=torch.int64))


def receive_step(comm: Comm) -> StepMessage:
    """Any other rank: the next thing rank 0 announced (blocks until it does)."""
    header = torch.empty(HEADER_WORDS, dtype=torch.int64)
    comm.broadcast_host(header)
    op, n_chunks, n_tokens, n_every = (int(v) for v in header.tolist())
    if op != OP_FORWARD:
        return StepMessage(op)
    payload = torch.empty(3 * n_chunks + n_tokens + n_every, dtype=torch.int64)
    comm.broadcast_host(payload)
    return decode(header, payload)
