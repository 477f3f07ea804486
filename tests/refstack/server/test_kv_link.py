"""The layer page form, the completeness check of ``unpack``, and the modelled KV link
against a real KV store process."""

from __future__ import annotations

import multiprocessing
import random
import time
from collections.abc import Iterator
from pathlib import Path

import pytest
import torch

from refstack.disagg import pages
from refstack.disagg.kvstore import KVStoreClient, serve_forever
from refstack.disagg.link import KVLink, LinkError
from refstack.model.cache import ModelCache
from refstack.model.config import HybridConfig


def _cache() -> ModelCache:
    cache = ModelCache(HybridConfig.preset("tiny"), num_slots=2)
    g = torch.Generator().manual_seed(0)
    for t in [*cache.keys.values(), *cache.values.values(), *cache.states.values()]:
        t.copy_(torch.randn(t.shape, generator=g))
    return cache


def _same(a: pages.Snapshot, b: pages.Snapshot) -> bool:
    return all(torch.equal(a[k][l], b[k][l]) for k in a for l in a[k])


def test_layer_pages_round_trip_and_a_missing_layer_is_refused() -> None:
    length, cache = 29, _cache()
    ids = [random.Random(2).randrange(512) for _ in range(length)]
    keys = pages.block_keys(ids, length, 8)
    layers = [pages.pack_layer(pages.capture_layer(cache, 1, i, 0, length), i, 0, length, keys) for i in range(4)]
    assert _same(pages.unpack(layers, cache, length), pages.capture(cache, 1, length))
    # The paged form of one layer at a time, mixed with layer pages: the same rows.
    mixed = layers[:2] + [p for i in (2, 3) for p in pages.pack_pages(pages.capture(cache, 1, length), length, 8, ids,
                                                                        layers=[i], keys=keys)]
    assert _same(pages.unpack(mixed, cache, length), pages.capture(cache, 1, length))
    # A chunked prompt: the attention layers' rows in two chunks (13 positions, then 16: the second
    # chunk's paged form starts mid-block), the KDA states once; in any order.
    chunks = [pages.pack_layer(pages.capture_layer(cache, 1, i, p0, p1), i, p0, p1, keys)
              for p0, p1 in ((13, 29), (0, 13)) for i in (1, 3)]
    paged = [p for i in (1, 3) for p in pages.pack_pages(pages.capture_layer(cache, 1, i, 13, 29), length, 8, ids,
                                                          layers=[i], keys=keys, rows=(13, 29))]
    first = [pages.pack_layer(pages.capture_layer(cache, 1, i, 0, 13), i, 0, 13, keys) for i in (1, 3)]
    for form in (chunks, first + paged):
        assert _same(pages.unpack([layers[0], layers[2], *form], cache, length), pages.capture(cache, 1, length))
    with pytest.raises(pages.PageError, match="incomplete transfer of 3 pages: layer 3 key head 0: 0 of 29 rows"):
        pages.unpack(layers[:3], cache, length)
    with pytest.raises(pages.PageError, match="layer 2 KDA state head 0"):
        pages.unpack([layers[0], layers[1], layers[3]], cache, length)
    paged = list(pages.pack_pages(pages.capture(cache, 1, length), length, 8, ids))
    with pytest.raises(pages.PageError, match="incomplete transfer.*rows"):
        pages.unpack(paged[1:], cache, length)  # one K page short


@pytest.fixture
def store(tmp_path: Path) -> Iterator[str]:
    ctx = multiprocessing.get_context("spawn")
    path = str(tmp_path / "kv.sock")
    ready, child = ctx.Pipe(duplex=False)
    proc = ctx.Process(target=serve_forever, args=(path, child), daemon=True)
    proc.start()
    try:
        assert ready.poll(60)
        ready.recv()
        yield path
    finally:
        proc.terminate()
        proc.join(10)


def test_the_link_holds_each_message_for_its_bytes_and_seals_after_them(store: str) -> None:
    link = KVLink(store, gbps=0.001)  # 1 MB/s: 20 KB take 20 ms on the wire
    try:
        start = time.perf_counter()
        link.post("r", [b"a" * 10_000], 0)
        link.post("r", [b"b" * 10_000, b"c"], 1)
        posted = time.perf_counter() - start
        link.finish("r")
        took = time.perf_counter() - start
        assert posted < took and took >= 0.02  # posting did not wait; the seal came after the wire time
        client = KVStoreClient(store)
        assert client.get("r") == [b"a" * 10_000, b"b" * 10_000, b"c"]
        # A message the store's framing cannot carry (an id over 65,535 bytes) fails its request
        # alone: later messages of it are skipped, finish names it, the link goes on.
        bad = "x" * 70_000
        link.post(bad, [b"1"], 0)
        link.post(bad, [b"2"], 1)
        with pytest.raises(LinkError, match="put failed"):
            link.finish(bad)
        link.post("s", [b"ok"], 0)
        link.finish("s")
        assert client.get("s") == [b"ok"]
        # drop forgets a request's pages after its messages
        link.post("d", [b"gone"], 0)
        link.drop("d")
        link.post("e", [b"kept"], 0)
        link.finish("e")
        assert client.get("e") == [b"kept"]
        client.seal("d")
        assert client.get("d") == []
        client.close()
    finally:
        link.close()


def test_a_compute_paced_link_holds_a_message_for_the_forward_time_its_bytes_took(store: str) -> None:
    # Ratio 2: a message holds the wire twice the forward time per byte the link has seen.
    # Forwards of 10 ms that each post 10 KB (request granularity: the bytes leave after the
    # forward): 2 x 10 ms per 10 KB, so 20 KB take about 40 ms, whatever the machine's speed.
    link = KVLink(store, gbps=1000.0, compute_ratio=2.0)  # the ratio overrides the bandwidth
    try:
        assert link.seconds_per_byte == 0.0  # nothing measured yet: the warm-up's messages are free
        for i in range(3):
            link.forward_started()
            link.forward_ended(0.010)
            link.post(f"w{i}", [b"w" * 10_000], -1)
            link.finish(f"w{i}")
        link.forward_started()  # folds the third forward in: its bytes are all posted
        assert link.seconds_per_byte == pytest.approx(2 * 0.010 / 10_000)
        start = time.perf_counter()
        link.post("r", [b"a" * 20_000], -1)
        link.finish("r")
        assert time.perf_counter() - start >= 0.04
        # Layer granularity posts during the forward: the same pace, because the fold waits for
        # the next forward's start either way.
        layered = KVLink(store, gbps=0.0, compute_ratio=1.0)
        try:
            for i in range(3):
                layered.forward_started()
                layered.post(f"l{i}", [b"l" * 5_000], 0)
                layered.post(f"l{i}", [b"l" * 5_000], 1)
                layered.forward_ended(0.004)
            layered.forward_started()
            assert layered.seconds_per_byte == pytest.approx(0.004 / 10_000)
        finally:
            layered.close()
    finally:
        link.close()
