"""The multimodal dataset: seeded and reproducible, vLLM's random-mm options, valid PNGs,
text-only requests at the given ratio, and text-only latencies apart in the result."""

from __future__ import annotations

import base64
import io
import zlib

import numpy as np
import pytest

from infra_agent.errors import ConfigError
from infra_agent.serving.client import RequestRecord
from infra_agent.serving.datasets import build_requests
from infra_agent.serving.metrics import compute_metrics
from infra_agent.serving.mm_dataset import png_bytes, random_mm_requests
from infra_agent.workspace import Scenario
from infra_agent.workspace.criteria import known_metric, metric_direction


def _images(req) -> list[bytes]:  # type: ignore[no-untyped-def]
    parts = req.prompt[0]["content"]
    return [base64.b64decode(p["image_url"]["url"].split(",", 1)[1]) for p in parts if p["type"] == "image_url"]


def test_same_seed_same_bytes_other_seed_other_bytes() -> None:
    kw = dict(base_items_per_request=2, num_mm_items_range_ratio=0.5, bucket_config={"32x48": 0.5, "16x16": 0.5},
              text_only_ratio=0.3)
    a = random_mm_requests(20, 30, 8, seed=5, **kw)
    b = random_mm_requests(20, 30, 8, seed=5, **kw)
    c = random_mm_requests(20, 30, 8, seed=6, **kw)
    assert [r.prompt for r in a] == [r.prompt for r in b]
    assert [r.prompt for r in a] != [r.prompt for r in c]
    assert [r.num_images for r in a] == [len(_images(r)) for r in a]
    # 2 ± 50%: 1 to 3 images, or none for a text-only request.
    assert {r.num_images for r in a} <= {0, 1, 2, 3} and any(r.num_images == 0 for r in a)


def test_text_only_ratio_and_item_counts() -> None:
    reqs = random_mm_requests(400, 10, 4, seed=1, base_items_per_request=1, bucket_config={"8x8": 1.0},
                              text_only_ratio=0.5)
    share = sum(r.num_images == 0 for r in reqs) / len(reqs)
    assert 0.4 < share < 0.6
    assert {r.num_images for r in reqs} == {0, 1}
    capped = random_mm_requests(10, 10, 4, seed=1, base_items_per_request=5, limit_mm_per_prompt=2,
                                bucket_config={"8x8": 1.0})
    assert {r.num_images for r in capped} == {2}
    with pytest.raises(ConfigError):
        random_mm_requests(1, 10, 4, bucket_config={"eight": 1.0})


def test_png_is_a_valid_image_of_the_pixels() -> None:
    pixels = np.random.default_rng(0).integers(0, 256, (5, 7, 3), dtype=np.uint8)
    png = png_bytes(pixels)
    assert png.startswith(b"\x89PNG\r\n\x1a\n")
    # IDAT holds each row after a filter byte 0.
    start = png.index(b"IDAT") + 4
    raw = zlib.decompressobj().decompress(png[start:])
    assert np.array_equal(np.frombuffer(raw, np.uint8).reshape(5, 22)[:, 1:].reshape(5, 7, 3), pixels)
    pil = pytest.importorskip("PIL.Image")
    img = pil.open(io.BytesIO(png))
    img.load()
    assert img.size == (7, 5) and np.array_equal(np.asarray(img), pixels)


def test_scenario_builds_it_and_the_result_splits_text_only_latency() -> None:
    sc = Scenario.model_validate({"dataset": {"kind": "random_mm", "input_len": 12, "output_len": 4,
                                              "bucket_config": {"16x16": 1.0}, "text_only_ratio": 0.5, "seed": 3},
                                  "num_requests": 6, "endpoint": "chat"})
    reqs = build_requests(sc.dataset, 6)
    assert [r.prompt for r in reqs] == [r.prompt for r in build_requests(sc.dataset, 6)]
    records = [RequestRecord(success=True, prompt_len=12, output_len=2, ttft=0.5 if r.num_images else 0.1,
                             itl=[0.01], latency=0.6, num_images=r.num_images) for r in reqs]
    result = compute_metrics(records, 1.0)
    assert result["num_images"] == [r.num_images for r in reqs]
    assert result["text_only_p99_ttft_ms"] == pytest.approx(100.0)
    assert result["image_p99_ttft_ms"] == pytest.approx(500.0)
    assert result["text_only_requests"] + result["image_requests"] == 6
    assert known_metric("text_only_p99_ttft_ms") and metric_direction("image_mean_ttft_ms") == "lower"
