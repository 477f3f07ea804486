"""Text p99 TTFT with and without concurrent image load: inline encode vs ``--disagg epd``.

    python bench/epd.py [--preset tiny] [--text-requests 40] [--concurrency 2]
        [--images-per-request 2] [--encode-workers 1] [--set knob=value ...] [--json out.json]

Starts two refstack servers with the same knobs (``--set``): the monolithic engine,
which encodes images inline on its engine thread, and ``--disagg epd`` with
``--encode-workers`` encode processes.  Against each it runs two phases:

1. text only: ``--concurrency`` closed-loop clients send ``--text-requests`` chat
   requests (random text of ``--input-len`` tokens, ``--output-len`` tokens out);
2. a 1:1 mix: the same text clients, plus as many image clients sending chat requests
   with ``--images-per-request`` seeded random PNGs (``--image-size``) and the same text
   lengths, for as long as the text clients run.

Each phase starts with one warm-up request of its kind.  The table shows each server's
text p99 TTFT in both phases and their ratio (the goal: within 1.2x under EPD), the
image requests' p99 TTFT, and the text-only p99 of EPD against the monolithic server.
The requests go through infra-agent's load generator (``infra_agent.serving.client``);
TTFT is vLLM's (the first streamed chunk with choices).
"""

from __future__ import annotations

import argparse
import asyncio
import json
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

import numpy as np

sys.path.insert(0, str(Path(__file__).resolve().parent))
from kv_transfer_prefill import start_server, stop_server  # noqa: E402

from infra_agent.serving.client import (  # noqa: E402
    RequestInput,
    RequestOptions,
    make_http_client,
    send_request,
)
from infra_agent.serving.mm_dataset import random_mm_requests  # noqa: E402


def _requests(a: argparse.Namespace, n: int, images: int, seed: int) -> list[RequestInput]:
    size = f"{a.image_size}x{a.image_size}"
    return random_mm_requests(n, a.input_len, a.output_len, seed=seed, base_items_per_request=images,
                              bucket_config={size: 1.0}, text_only_ratio=0.0 if images else 1.0)


async def _phase(url: str, a: argparse.Namespace, model: str, mixed: bool, seed: int) -> dict[str, Any]:
    opts = RequestOptions(endpoint="chat", model=model)
    texts = _requests(a, a.text_requests, 0, seed)
    # Enough distinct image requests that none repeats (an encoder cache hit) within the phase.
    imgs = _requests(a, 2 * a.text_requests + 1, a.images_per_request, seed + 1) if mixed else []
    async with make_http_client(4 * a.concurrency) as client:
        warm = [texts[0]] + ([imgs[0]] if mixed else [])
        for r in warm:
            rec = await send_request(client, url, r, opts)
            assert rec.success, rec.error
        queue = list(texts[1:])
        text_recs: list[Any] = []
        img_recs: list[Any] = []
        done = asyncio.Event()

        async def text_client() -> None:
            while queue:
                text_recs.append(await send_request(client, url, queue.pop(0), opts))

        async def image_client(k: int) -> None:
            i = k
            while not done.is_set():
                img_recs.append(await send_request(client, url, imgs[1 + i % (len(imgs) - 1)], opts))
                i += a.concurrency

        start = time.perf_counter()
        tasks = [asyncio.create_task(image_client(k)) for k in range(a.concurrency if mixed else 0)]
        await asyncio.gather(*(text_client() for _ in range(a.concurrency)))
        done.set()
        await asyncio.gather(*tasks)
        wall = time.perf_counter() - start
    failed = [r.error for r in text_recs + img_recs if not r.success]
    assert not failed, failed[:3]

    def p99(recs: list[Any]) -> float | None:
        return float(np.percentile([r.ttft * 1e3 for r in recs], 99)) if recs else None

    return {"text_p99_ttft_ms": p99(text_recs), "text_median_ttft_ms": float(np.median([r.ttft * 1e3 for r in text_recs])),
            "image_p99_ttft_ms": p99(img_recs), "text_requests": len(text_recs), "image_requests": len(img_recs),
            "wall_s": wall}


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--preset", default="tiny")
    p.add_argument("--text-requests", type=int, default=40)
    p.add_argument("--concurrency", type=int, default=2)
    p.add_argument("--input-len", type=int, default=64)
    p.add_argument("--output-len", type=int, default=8)
    p.add_argument("--images-per-request", type=int, default=2)
    p.add_argument("--image-size", type=int, default=256)
    p.add_argument("--encode-workers", type=int, default=1)
    p.add_argument("--set", action="append", default=[], metavar="KNOB=VALUE")
    p.add_argument("--json", type=Path)
    a = p.parse_args(argv)
    knobs = ["--preset", a.preset]
    for kv in a.set:
        k, _, v = kv.partition("=")
        knobs += ["--" + k.replace("_", "-"), v]
    sides = {"monolithic (inline encode)": knobs,
             f"epd ({a.encode_workers} encode worker{'s' if a.encode_workers > 1 else ''})":
                 [*knobs, "--disagg", "epd", "--encode-workers", str(a.encode_workers)]}
    results: dict[str, Any] = {}
    with tempfile.TemporaryDirectory(prefix="bench-epd-") as tmp:
        for i, (side, args) in enumerate(sides.items()):
            url, proc = start_server(args, f"{tmp}/server{i}.log")
            try:
                model = f"refstack-{a.preset}"
                results[side] = {"text_only": asyncio.run(_phase(url, a, model, False, 100 + i)),
                                 "mixed": asyncio.run(_phase(url, a, model, True, 200 + i))}
            finally:
                stop_server(proc)
            r = results[side]
            r["ratio"] = r["mixed"]["text_p99_ttft_ms"] / r["text_only"]["text_p99_ttft_ms"]
            print(f"{side}: text p99 TTFT {r['text_only']['text_p99_ttft_ms']:.1f} ms text-only, "
                  f"{r['mixed']['text_p99_ttft_ms']:.1f} ms mixed", file=sys.stderr, flush=True)
    print("\n| server | text p99 TTFT, text only (ms) | text p99 TTFT, 1:1 image mix (ms) | mixed / text only | "
          "image p99 TTFT (ms) | image requests |")
    print("|---|---|---|---|---|---|")
    for side, r in results.items():
        print(f"| {side} | {r['text_only']['text_p99_ttft_ms']:.1f} | {r['mixed']['text_p99_ttft_ms']:.1f} | "
              f"{r['ratio']:.2f}x | {r['mixed']['image_p99_ttft_ms']:.1f} | {r['mixed']['image_requests']} |")
    mono, epd = results.values()
    print(f"\nEPD keeps text p99 TTFT within 1.2x of text-only under the mix: {'yes' if epd['ratio'] <= 1.2 else 'no'} "
          f"({epd['ratio']:.2f}x; monolithic {mono['ratio']:.2f}x)")
    if a.json:
        a.json.write_text(json.dumps({"args": vars(a) | {"json": str(a.json)}, "results": results}, indent=1))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
