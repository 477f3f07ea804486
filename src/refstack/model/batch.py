"""What one forward pass works on: the engine's chunks, flattened into one token stream.

Token-wise work (norms, projections, MoE, LM head) runs once over all tokens of the
step; only the sequence-mixing cores (KDA, attention) look at sequence boundaries.
Decode tokens go first in the stream, so the batched decode path reads a plain
slice ``[:num_decode]`` instead of gathering.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass, field, replace
from typing import NamedTuple

import torch
from torch import Tensor


@dataclass(frozen=True, slots=True)
class SeqChunk:
    """Tokens of one sequence to run this step.

    ``start_pos`` is how many tokens of this sequence the slot's cache/state already
    holds.  One token is a decode step; more is (a chunk of) prefill.
    """

    slot: int
    token_ids: Sequence[int]
    start_pos: int
    # Image embeddings that replace some of these tokens' embeddings: (offsets in the
    # chunk, rows [k, hidden]); see refstack.encode.mm.
    embeds: tuple[Tensor, Tensor] | None = None


@dataclass(frozen=True, slots=True)
class PrefillSpan:
    """A prefill chunk's place in the flattened stream: tokens ``[begin, end)``."""

    slot: int
    start_pos: int
    begin: int
    end: int


@dataclass(frozen=True, slots=True)
class PaddedPrefill:
    """Several prefill chunks as one ``[S, n_max]`` batch, padded at each chunk's end.

    Many short prompts arriving together (the start of a batch benchmark, a burst of
    requests) would otherwise run the sequence-mixing cores once per sequence.
    """

    index: Tensor  # [S, n_max] stream index of each position; padding repeats a valid index
    valid: Tensor  # [S, n_max] bool: a real token, not padding
    # valid.nonzero() as (chunk, offset) index tensors, made on the host: x[valid_at] is
    # x[valid] without the device-to-host sync a boolean mask costs on a GPU.
    valid_at: tuple[Tensor, Tensor]
    slots: Tensor  # [S]
    starts: Tensor  # [S] start_pos of each chunk
    token_slots: Tensor  # [P] slot of every prefill token, stream order
    token_positions: Tensor  # [P] its position in its sequence
    max_len: int  # longest attended length, max(start + n)

    @classmethod
    def build(cls, spans: Sequence[PrefillSpan]) -> PaddedPrefill | None:
        """The padded batch, or None when per-sequence runs are the better plan."""
        lens = [p.end - p.begin for p in spans]
        n_max = max(lens)
        # Padding past twice the real tokens would cost more than the loop it replaces.
        if len(spans) < 2 or len(spans) * n_max > 2 * sum(lens):
            return None
        offsets = torch.arange(n_max)
        begins = torch.tensor([p.begin for p in spans])
        lens_t = torch.tensor(lens)
        valid = offsets.unsqueeze(0) < lens_t.unsqueeze(1)
        index = begins.unsqueeze(1) + torch.where(valid, offsets.unsqueeze(0), 0)
        slots = torch.tensor([p.slot for p in spans])
        starts = torch.tensor([p.start_pos for p in spans])
        return cls(
            index=index,
            valid=valid,
            valid_at=valid.nonzero(as_tuple=True),  # type: ignore[arg-type]  # a tuple of two for a 2-d mask
            slots=slots,
            starts=starts,
            token_slots=torch.repeat_interleave(slots, lens_t),
            token_positions=torch.cat([torch.arange(p.start_pos, p.start_pos + n) for p, n in zip(spans, lens)]),
            max_len=max(p.start_pos + n for p, n in zip(spans, lens)),
        )


class Sequences(NamedTuple):
    """A step's chunks as rows of the token stream (see ``ForwardBatch.sequences``)."""

    begins: Tensor  # [n] int64: first row of each
    lengths: Tensor  # [n] int64
    slots: Tensor  # [n] int64: its cache slot
    fresh: Tensor  # [n] bool: it starts at position 0 (its state starts from zero)


@dataclass(slots=True)
class ForwardBatch:
    token_ids: Tensor  # [T] decode tokens first, then prefill chunks
    positions: Tensor  # [T] absolute position of each token in its sequence
    num_decode: int
    decode_slots: Tensor  # [D]
    decode_positions: Tensor  # [D] == start_pos of each decode chunk
    # (first, last + 1) when the decode slots are consecutive ascending, so caches can
    # be sliced rather than gathered.
    decode_slot_range: tuple[int, int] | None
    max_decode_len: int  # longest attended length among decode chunks (0 if none)
    fresh_decode_slots: Tensor | None  # decode slots at position 0 (one-token prompts), if any
    prefills: list[PrefillSpan]
    padded_prefill: PaddedPrefill | None  # all prefills as one padded batch, when worth it
    last_token_index: Tensor  # [num_chunks] stream index of each chunk's last token, chunk order
    # Filled by the model once per forward, shared by all attention layers.
    rope: tuple[Tensor, Tensor] | None = field(default=None)
    # Stream rows whose token embedding is replaced (image tokens), and the rows put there.
    embed_rows: Tensor | None = field(default=None)
    embed_values: Tensor | None = field(default=None)
    _sequences: Sequences | None = field(default=None, init=False, repr=False)

    @property
    def num_tokens(self) -> int:
        return int(self.token_ids.shape[0])

    def sequences(self) -> Sequences:
        """Every chunk as a sequence in stream order (each decode token a sequence of one),
        for kernels that take a whole mixed step at once.  Built on first use, shared by
        all layers."""
        if self._sequences is None:
            nd = self.num_decode
            begins = list(range(nd)) + [p.begin for p in self.prefills]
            lengths = [1] * nd + [p.end - p.begin for p in self.prefills]
            slots = self.decode_slots.tolist() + [p.slot for p in self.prefills]
            fresh = (self.decode_positions == 0).tolist() + [p.start_pos == 0 for p in self.prefills]
            self._sequences = Sequences(torch.tensor(begins, dtype=torch.long), torch.tensor(lengths, dtype=torch.long),
                                        torch.tensor(slots, dtype=torch.long), torch.tensor(fresh, dtype=torch.bool))
        return self._sequences

    def to(self, device: torch.device) -> ForwardBatch:
        """This batch with every tensor on ``device``, through one host-to-device copy."""
        pp = self.padded_prefill
        tensors = [self.token_ids, self.positions, self.decode_slots, self.decode_positions, self.last_token_index]
        if self.fresh_decode_slots is not None:
            tensors.append(self.fresh_decode_slots)
        if pp is not None:
            tensors += [pp.index, pp.valid, *pp.valid_at, pp.slots, pp.starts, pp.token_slots, pp.token_positions]
        moved = iter(_to_device(tensors, device))
        token_ids, positions, decode_slots, decode_positions, last_token_index = (next(moved) for _ in range(5))
        fresh = next(moved) if self.fresh_decode_slots is not None else None
        padded = None
        if pp is not None:
            index, valid, valid_rows, valid_cols, slots, starts, token_slots, token_positions = moved
            padded = PaddedPrefill(index, valid, (valid_rows, valid_cols), slots, starts, token_slots, token_positions,
                                   pp.max_len)
        return replace(self, token_ids=token_ids, positions=positions, decode_slots=decode_slots,
                       decode_positions=decode_positions, last_token_index=last_token_index,
                       fresh_decode_slots=fresh, padded_prefill=padded)

    @classmethod
    def from_chunks(cls, chunks: Sequence[SeqChunk], num_slots: int, max_seq_len: int,
                    device: torch.device | None = None) -> ForwardBatch:
        """The step's batch; its tensors on ``device`` (default: the CPU)."""
        batch = cls._build(chunks, num_slots, max_seq_len)
        return batch if device is None or device.type == "cpu" else batch.to(device)

    @classmethod
    def _build(cls, chunks: Sequence[SeqChunk], num_slots: int, max_seq_len: int) -> ForwardBatch:
        if not chunks:
            raise ValueError("forward_chunks: got no chunks")
        seen: set[int] = set()
        for c in chunks:
            n = len(c.token_ids)
            if n == 0:
                raise ValueError(f"SeqChunk for slot {c.slot} has no tokens")
            if not 0 <= c.slot < num_slots:
                raise ValueError(f"SeqChunk slot {c.slot} outside the cache's {num_slots} slots")
            if c.start_pos < 0 or c.start_pos + n > max_seq_len:
                raise ValueError(
                    f"SeqChunk slot {c.slot}: positions {c.start_pos}..{c.start_pos + n - 1} exceed "
                    f"the cache's max_seq_len {max_seq_len}"
                )
            # Two chunks of one slot in a step would race on the same state.
            if c.slot in seen:
                raise ValueError(f"slot {c.slot} appears twice in one forward_chunks call")
            seen.add(c.slot)

        decode = [i for i, c in enumerate(chunks) if len(c.token_ids) == 1]
        prefill = [i for i, c in enumerate(chunks) if len(c.token_ids) > 1]
        ids: list[int] = []
        pos: list[int] = []
        last = [0] * len(chunks)
        for i in decode:
            c = chunks[i]
            last[i] = len(ids)
            ids.append(int(c.token_ids[0]))
            pos.append(c.start_pos)
        spans: list[PrefillSpan] = []
        for i in prefill:
            c = chunks[i]
            begin = len(ids)
            ids.extend(int(t) for t in c.token_ids)
            pos.extend(range(c.start_pos, c.start_pos + len(c.token_ids)))
            spans.append(PrefillSpan(c.slot, c.start_pos, begin, len(ids)))
            last[i] = len(ids) - 1

        embed_rows, embed_values = _embeds(chunks, decode + prefill, last)
        dec_slots = [chunks[i].slot for i in decode]
        dec_pos = [chunks[i].start_pos for i in decode]
        slot_range = None
        if dec_slots and dec_slots == list(range(dec_slots[0], dec_slots[0] + len(dec_slots))):
            slot_range = (dec_slots[0], dec_slots[0] + len(dec_slots))
        return cls(
            token_ids=torch.tensor(ids, dtype=torch.long),
            positions=torch.tensor(pos, dtype=torch.long),
            num_decode=len(decode),
            decode_slots=torch.tensor(dec_slots, dtype=torch.long),
            decode_positions=torch.tensor(dec_pos, dtype=torch.long),
            decode_slot_range=slot_range,
            max_decode_len=max(dec_pos) + 1 if dec_pos else 0,
            fresh_decode_slots=(
                torch.tensor([s for s, p in zip(dec_slots, dec_pos) if p == 0], dtype=torch.long)
                if 0 in dec_pos
                else None
            ),
            prefills=spans,
            padded_prefill=PaddedPrefill.build(spans) if len(spans) > 1 else None,
            last_token_index=torch.tensor(last, dtype=torch.long),
            embed_rows=embed_rows,
            embed_values=embed_values,
        )


def _embeds(chunks: Sequence[SeqChunk], order: list[int], last: list[int]) -> tuple[Tensor | None, Tensor | None]:
    """The stream rows of the chunks' spliced embeddings (a chunk's tokens are the rows
    ``last - n + 1 .. last``), and the embeddings, in one tensor each; None when none."""
    rows: list[Tensor] = []
    values: list[Tensor] = []
    for i in order:
        e = chunks[i].embeds
        if e is not None:
            rows.append(e[0] + (last[i] - len(chunks[i].token_ids) + 1))
            values.append(e[1])
    if not rows:
        return None, None
    return torch.cat(rows), torch.cat(values)


def _to_device(tensors: list[Tensor], device: torch.device) -> list[Tensor]:
    """Copies of small CPU index tensors on ``device``, all through one pinned, non-blocking copy.

    A copy from pageable memory blocks the host until the GPU has drained its queue; a
    step builds a dozen such tensors, so one packed int64 buffer replaces a dozen syncs.
    """
    flat = torch.cat([t.reshape(-1).to(torch.long) for t in tensors])
    moved = flat.pin_memory().to(device, non_blocking=True)
    out, offset = [], 0
    for t in tensors:
        n = t.numel()
        out.append(moved[offset : offset + n].view(t.shape).to(t.dtype))
        offset += n
    return out
