"""The KV page codec of disaggregated serving: what the prefill side sends, how the decode
side reads it back.

A request's cache is its attention layers' K and V rows for the prompt and its KDA states
(``capture``).  It travels as pages, each ``header | body``:

- the header (``_PAGE``): kind, layer, KV head or KDA head, first and end position, the
  page's **block key** and a CRC-32 of the body;
- the body: raw fp32 rows.

The block key is the prefix-cache key a KV store indexes pages by (Mooncake's object key,
vLLM's block hash): a SHA-256 chain over the prompt's token ids, one link per
``page_tokens`` positions, so a page's key names the whole prefix up to its end and two
requests sharing a prefix share keys.  The CRC lets the receiver reject a torn page.
Both are computed in Python, per page, as a real connector's packing does: this is the
transfer thread's GIL-bound work (case study B).

``pack_layer`` is one layer's rows of one prefill chunk (or its KDA state) in one page, keyed
like the bulk form: what the prefill side sends layer by layer (``kv_transfer_granularity =
layer``) while the next layer computes; ``pack_pages(..., layers=[i], rows=(p0, p1))`` is the
paged form of the same.  ``unpack``
takes any mix of the forms and refuses a set of pages that leaves a layer's rows or state
uncovered, so a decode side never starts from a partly transferred cache.

``pack_pages`` yields the paged form (the ``kv-transfer`` thread sends it in batches of
``PUT_BATCH`` pages, one store message each, as Mooncake's batch put does);
``pack_bulk`` is one message with every tensor (the engine thread's form when
``kv_transfer`` is off), carrying the same keys and checksum so the two modes hand the
store the same information.
"""

from __future__ import annotations

import hashlib
import struct
import zlib
from array import array
from collections.abc import Collection, Iterator, Sequence

import numpy as np
import torch

from refstack.model.cache import ModelCache

KIND_K, KIND_V, KIND_STATE, KIND_BULK, KIND_LAYER = 0, 1, 2, 3, 4
# kind, layer, head, first position, end position, block key (SHA-256), CRC-32 of the body
_PAGE = struct.Struct("<BHHII32sI")
HEADER_BYTES = _PAGE.size
# Pages per store message: one socket write, so one GIL release, per batch.  Short batches
# keep each of the transfer thread's GIL stretches short (~0.1 ms), so an engine thread
# coming back from a native call waits little for it; 32 or 128 measured worse with the
# GIL released (docs/performance.md, "Case study B").
PUT_BATCH = 8

Snapshot = dict[str, dict[int, torch.Tensor]]  # "keys" / "values": [Hkv, P, Dh]; "states": [H, K, V]


class PageError(ValueError):
    """A page that does not decode: a short header, a wrong checksum, an unknown kind."""


def capture(cache: ModelCache, slot: int, length: int, copy: bool = True) -> Snapshot:
    """The slot's KV rows [:length] of every attention layer and its KDA states (cloned
    when ``copy``: the slot is reused while the pages are still being packed)."""
    def take(t: torch.Tensor) -> torch.Tensor:
        return t.clone(memory_format=torch.contiguous_format) if copy else t

    return {"keys": {l: take(k[slot, :, :length]) for l, k in cache.keys.items()},
            "values": {l: take(v[slot, :, :length]) for l, v in cache.values.items()},
            "states": {l: take(s[slot]) for l, s in cache.states.items()}}


def block_keys(token_ids: Sequence[int], length: int, page_tokens: int) -> list[bytes]:
    """One SHA-256 per block of ``page_tokens`` positions of the prompt, each over the previous
    key and the block's token ids (so a key names the whole prefix up to its block's end)."""
    if page_tokens < 1:
        raise ValueError(f"page_tokens must be >= 1, got {page_tokens}")
    if length > len(token_ids):
        raise ValueError(f"length {length} is past the {len(token_ids)} token ids")
    keys: list[bytes] = []
    prev = b"\0" * 32
    for p0 in range(0, length, page_tokens):
        prev = hashlib.sha256(prev + array("i", token_ids[p0 : p0 + page_tokens]).tobytes()).digest()
        keys.append(prev)
    return keys


def _page(kind: int, layer: int, head: int, p0: int, p1: int, key: bytes, body: bytes) -> bytes:
    return _PAGE.pack(kind, layer, head, p0, p1, key, zlib.crc32(body)) + body


def pack_pages(snap: Snapshot, length: int, page_tokens: int, token_ids: Sequence[int],
               layers: Collection[int] | None = None, keys: list[bytes] | None = None,
               rows: tuple[int, int] | None = None) -> Iterator[bytes]:
    """The snapshot as pages: per attention layer, ``page_tokens`` positions of K, then of V,
    one page per KV head; per KDA layer, one page per head (keyed by the last block).
    ``layers``: only those model layers; ``keys``: the block keys, when already computed;
    ``rows``: the snapshot's K and V hold only positions ``[p0, p1)`` of the prompt (a chunk
    sent on its own), paged at the same block boundaries (a page's key is its block's)."""
    if keys is None:
        keys = block_keys(token_ids, length, page_tokens)
    lo, hi = rows if rows is not None else (0, length)
    for layer in sorted(snap["keys"]):
        if layers is not None and layer not in layers:
            continue
        for kind, t in ((KIND_K, snap["keys"][layer]), (KIND_V, snap["values"][layer])):
            for b in range(lo // page_tokens, -(-hi // page_tokens)):
                p0, p1 = max(lo, b * page_tokens), min(hi, (b + 1) * page_tokens)
                for head in range(t.shape[0]):
                    yield _page(kind, layer, head, p0, p1, keys[b], t[head, p0 - lo : p1 - lo].numpy().tobytes())
    last = keys[-1] if keys else b"\0" * 32
    for layer in sorted(snap["states"]):
        if layers is not None and layer not in layers:
            continue
        state = snap["states"][layer]
        for head in range(state.shape[0]):
            yield _page(KIND_STATE, layer, head, 0, length, last, state[head].numpy().tobytes())


def batches(pages: Iterator[bytes], size: int = PUT_BATCH) -> Iterator[list[bytes]]:
    """Pages grouped ``size`` at a time (the last group may be shorter)."""
    batch: list[bytes] = []
    for page in pages:
        batch.append(page)
        if len(batch) == size:
            yield batch
            batch = []
    if batch:
        yield batch


def pack_bulk(snap: Snapshot, length: int, page_tokens: int, token_ids: Sequence[int]) -> bytes:
    """The snapshot as one page: the block keys, then every tensor's bytes in a fixed order
    (see ``unpack``), one checksum over it all."""
    keys = block_keys(token_ids, length, page_tokens)
    parts = [struct.pack("<I", len(keys)), *keys]
    for layer in sorted(snap["keys"]):
        parts += (snap["keys"][layer].numpy().tobytes(), snap["values"][layer].numpy().tobytes())
    parts += [snap["states"][layer].numpy().tobytes() for layer in sorted(snap["states"])]
    return _page(KIND_BULK, 0, 0, 0, length, keys[-1] if keys else b"\0" * 32, b"".join(parts))


def capture_layer(cache: ModelCache, slot: int, layer: int, p0: int, p1: int) -> Snapshot:
    """Views of one model layer's rows: an attention layer's K and V at positions ``[p0, p1)``,
    or a KDA layer's state (whole; the caller takes it once the prompt is done)."""
    if layer in cache.keys:
        return {"keys": {layer: cache.keys[layer][slot, :, p0:p1]},
                "values": {layer: cache.values[layer][slot, :, p0:p1]}, "states": {}}
    return {"keys": {}, "values": {}, "states": {layer: cache.states[layer][slot]}}


def pack_layer(snap: Snapshot, layer: int, p0: int, p1: int, keys: list[bytes]) -> bytes:
    """One layer of a snapshot as one page (``KIND_LAYER``): the block keys, then the layer's
    K and V rows for positions ``[p0, p1)`` or its KDA state; one checksum over it all."""
    parts = [struct.pack("<I", len(keys)), *keys]
    if layer in snap["keys"]:
        parts += (snap["keys"][layer].numpy().tobytes(), snap["values"][layer].numpy().tobytes())
    else:
        parts.append(snap["states"][layer].numpy().tobytes())
    return _page(KIND_LAYER, layer, 0, p0, p1, keys[-1] if keys else b"\0" * 32, b"".join(parts))


class _Coverage:
    """What a set of pages filled: rows per (K or V, layer, head), state heads per layer."""

    def __init__(self, cache: ModelCache, length: int, n_kv: int, n_state: int) -> None:
        self.want_rows = {(name, l, h): length for name in ("keys", "values") for l in cache.keys for h in range(n_kv)}
        self.want_heads = {(l, h) for l in cache.states for h in range(n_state)}
        self.rows: dict[tuple[str, int, int], int] = {}
        self.heads: set[tuple[int, int]] = set()

    def kv(self, name: str, layer: int, heads: range, rows: int) -> None:
        for h in heads:
            self.rows[(name, layer, h)] = self.rows.get((name, layer, h), 0) + rows

    def missing(self) -> str | None:
        for key, want in self.want_rows.items():
            if self.rows.get(key, 0) < want:
                name, l, h = key
                return f"layer {l} {name[:-1]} head {h}: {self.rows.get(key, 0)} of {want} rows"
        lost = sorted(self.want_heads - self.heads)
        return f"layer {lost[0][0]} KDA state head {lost[0][1]}" if lost else None


def unpack(pages: Sequence[bytes | memoryview], cache: ModelCache, length: int) -> Snapshot:
    """Pages (any mix of the forms) back into tensors shaped like ``capture``'s; every checksum
    verified, and every layer's rows and state covered (a ``PageError`` names the first gap).

    The pages are written into numpy arrays (a slice assignment per page, no torch op per
    page): the decode worker shares the machine's cores with the prefill worker being
    measured, so its side of the transfer is kept cheap."""
    n_kv, dh = next(iter(cache.keys.values())).shape[1::2] if cache.keys else (0, 0)
    state_shape = tuple(next(iter(cache.states.values())).shape[1:]) if cache.states else (0, 0, 0)
    arrays: dict[str, dict[int, np.ndarray]] = {
        "keys": {l: np.empty((n_kv, length, dh), np.float32) for l in cache.keys},
        "values": {l: np.empty((n_kv, length, dh), np.float32) for l in cache.values},
        "states": {l: np.empty(state_shape, np.float32) for l in cache.states}}
    seen = _Coverage(cache, length, n_kv, state_shape[0])
    s_len = int(np.prod(state_shape))
    for i, page in enumerate(pages):
        if len(page) < HEADER_BYTES:
            raise PageError(f"page {i}: {len(page)} bytes, shorter than its {HEADER_BYTES}-byte header")
        kind, layer, head, p0, p1, _key, crc = _PAGE.unpack_from(page)
        body = memoryview(page)[HEADER_BYTES:]
        if zlib.crc32(body) != crc:
            raise PageError(f"page {i} (kind {kind}, layer {layer}, head {head}): checksum mismatch")
        rows = np.frombuffer(body, dtype=np.float32)
        if kind in (KIND_BULK, KIND_LAYER):
            off = (4 + 32 * int(np.frombuffer(body[:4], dtype="<u4")[0])) // 4
            layers = (sorted(cache.keys), sorted(cache.states)) if kind == KIND_BULK else (
                [layer] if layer in cache.keys else [], [layer] if layer in cache.states else [])
            if kind == KIND_LAYER and not any(layers):
                raise PageError(f"page {i}: layer {layer} is neither an attention nor a KDA layer here")
            q0, q1 = (p0, p1) if kind == KIND_LAYER else (0, length)  # a layer page may hold a chunk's rows
            n = n_kv * (q1 - q0) * dh
            for l in layers[0]:
                for name in ("keys", "values"):
                    arrays[name][l][:, q0:q1] = rows[off : off + n].reshape(n_kv, q1 - q0, dh)
                    seen.kv(name, l, range(n_kv), q1 - q0)
                    off += n
            for l in layers[1]:
                arrays["states"][l][...] = rows[off : off + s_len].reshape(state_shape)
                seen.heads.update((l, h) for h in range(state_shape[0]))
                off += s_len
        elif kind == KIND_STATE:
            arrays["states"][layer][head] = rows.reshape(state_shape[1:])
            seen.heads.add((layer, head))
        elif kind in (KIND_K, KIND_V):
            name = "keys" if kind == KIND_K else "values"
            arrays[name][layer][head, p0:p1] = rows.reshape(p1 - p0, dh)
            seen.kv(name, layer, range(head, head + 1), p1 - p0)
        else:
            raise PageError(f"page {i}: unknown kind {kind}")
    gap = seen.missing()
    if gap is not None:
        raise PageError(f"incomplete transfer of {len(pages)} pages: {gap}")
    return {name: {l: torch.from_numpy(a) for l, a in per.items()} for name, per in arrays.items()}


def install(cache: ModelCache, slot: int, snap: Snapshot, length: int) -> None:
    """Write a snapshot into ``slot``: KV rows [:length] and the KDA states."""
    with torch.inference_mode():
        for l, k in snap["keys"].items():
            cache.keys[l][slot, :, :length].copy_(k)
            cache.values[l][slot, :, :length].copy_(snap["values"][l])
        for l, s in snap["states"].items():
            cache.states[l][slot].copy_(s)
