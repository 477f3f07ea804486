"""The KV page codec and the store's batch put: round trips, block keys, torn pages, and a
prefill worker that keeps a slot until its pages are out (case study B's transfer path)."""

from __future__ import annotations

import random
import struct
import threading
import zlib
from pathlib import Path
from typing import Any

import pytest
import torch

from refstack.disagg import pages
from refstack.model.cache import ModelCache
from refstack.model.config import HybridConfig


def _cache(length: int) -> ModelCache:
    cache = ModelCache(HybridConfig.preset("tiny"), num_slots=2)
    g = torch.Generator().manual_seed(0)
    for t in [*cache.keys.values(), *cache.values.values(), *cache.states.values()]:
        t.copy_(torch.randn(t.shape, generator=g))
    return cache


def _same(a: pages.Snapshot, b: pages.Snapshot) -> bool:
    return all(torch.equal(a[k][l], b[k][l]) for k in a for l in a[k])


@pytest.mark.parametrize("page_tokens", [1, 2, 7, 16, 4096])
def test_paged_and_bulk_forms_round_trip_bit_for_bit(page_tokens: int) -> None:
    length = 37
    cache = _cache(length)
    ids = [random.Random(1).randrange(512) for _ in range(length)]
    snap = pages.capture(cache, 1, length)
    paged = list(pages.pack_pages(snap, length, page_tokens, ids))
    layers, heads = len(cache.keys), cache.keys[next(iter(cache.keys))].shape[1]
    blocks = -(-length // page_tokens)
    states = sum(s.shape[1] for s in cache.states.values())
    assert len(paged) == layers * 2 * blocks * heads + states
    assert _same(pages.unpack(paged, cache, length), snap)
    bulk = pages.pack_bulk(snap, length, page_tokens, ids)
    assert _same(pages.unpack([bulk], cache, length), snap)
    # batches keep every page, in order
    assert [p for b in pages.batches(iter(paged), 5) for p in b] == paged


def test_block_keys_chain_over_the_prefix() -> None:
    a = pages.block_keys([1, 2, 3, 4, 5], 5, 2)
    b = pages.block_keys([1, 2, 3, 4, 9], 5, 2)
    c = pages.block_keys([7, 2, 3, 4, 5], 5, 2)
    assert len(a) == 3 and a[:2] == b[:2] and a[2] != b[2]  # a shared prefix shares its keys
    assert all(x != y for x, y in zip(a, c))  # a key names the whole prefix, not its block alone
    with pytest.raises(ValueError, match="page_tokens"):
        pages.block_keys([1], 1, 0)
    with pytest.raises(ValueError, match="past the 1 token ids"):
        pages.block_keys([1], 2, 1)


def test_a_torn_or_unknown_page_is_refused_with_its_index() -> None:
    length = 4
    cache = _cache(length)
    paged = list(pages.pack_pages(pages.capture(cache, 0, length), length, 2, [1, 2, 3, 4]))
    torn = bytearray(paged[3])
    torn[-1] ^= 0xFF
    with pytest.raises(pages.PageError, match="page 3 .*checksum mismatch"):
        pages.unpack(paged[:3] + [bytes(torn)], cache, length)
    with pytest.raises(pages.PageError, match="page 0: 5 bytes, shorter"):
        pages.unpack([b"short"], cache, length)
    odd = bytearray(paged[0])
    odd[0] = 9
    body = bytes(odd[pages.HEADER_BYTES:])
    hdr = list(struct.unpack_from("<BHHII32sI", odd))
    hdr[-1] = zlib.crc32(body)
    with pytest.raises(pages.PageError, match="unknown kind 9"):
        pages.unpack([struct.pack("<BHHII32sI", *hdr) + body], cache, length)


def test_the_store_takes_a_batch_put_as_its_pages(tmp_path: Path) -> None:
    import multiprocessing

    from refstack.disagg.kvstore import KVStoreClient, serve_forever

    ctx = multiprocessing.get_context("spawn")
    path = str(tmp_path / "kv.sock")
    ready, child = ctx.Pipe(duplex=False)
    proc = ctx.Process(target=serve_forever, args=(path, child), daemon=True)
    proc.start()
    try:
        assert ready.poll(60)
        ready.recv()
        client = KVStoreClient(path)
        client.put("r", b"first")
        client.put_many("r", [b"a", b"", b"c" * 70000])
        client.seal("r")
        assert client.get("r") == [b"first", b"a", b"", b"c" * 70000]
        # The store keeps messages as framed; a torn batch put is found by the reader,
        # with the page it tore at.
        from refstack.disagg.kvstore import PUT_MANY
        client._send(PUT_MANY, "torn", struct.pack("<II", 2, 3) + b"abc" + struct.pack("<I", 99) + b"xy")
        client.seal("torn")
        with pytest.raises(ConnectionError, match=r"torn: page 1 \(99 bytes\) runs past"):
            client.get("torn")
        client.close()
    finally:
        proc.terminate()
        proc.join(10)


@pytest.mark.slow
def test_a_prefill_worker_with_one_slot_waits_for_each_transfer_and_finishes_all() -> None:
    """kv_transfer on keeps a handed-off request's slot until its pages are out: with a
    single slot every next prefill waits for the previous transfer, and all complete."""
    from refstack.disagg.frontend import DisaggEngine
    from refstack.engine import SamplingParams
    from refstack.knobs import engine_config, parse_knobs

    engine = DisaggEngine(engine_config(parse_knobs({"preset": "tiny", "max_running": "1", "kv_page_tokens": "1",
                                                     "dtype": "float32", "disagg": "true"})))
    engine.start()
    done = threading.Event()
    outs: dict[int, list[Any]] = {i: [] for i in range(4)}

    def sink(i: int) -> Any:
        def on(out: Any) -> None:
            outs[i].append(out)
            if all(o and o[-1].finished for o in outs.values()):
                done.set()
        return on

    try:
        params = SamplingParams(temperature=0.0, max_tokens=3, ignore_eos=True)
        for i in range(4):
            engine.add_request([256] + [(7 * i + j) % 256 for j in range(60)], params, sink(i))
        assert done.wait(120), {i: len(o) for i, o in outs.items()}
        assert all(o[-1].finish_reason == "length" and o[-1].completion_tokens == 3 for o in outs.values())
    finally:
        engine.stop()
