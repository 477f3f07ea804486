"""Each window's prompt set: no prompt repeats across windows, nor between a warm-up and its window."""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import pytest

from infra_agent.serving.datasets import build_requests
from infra_agent.serving.interleave import interleave_urls
from infra_agent.serving.prompt_sets import SEED_STRIDE, window_prompts
from infra_agent.workspace.models import Scenario


def _scenario(dataset: dict[str, Any], n: int = 6, **extra: Any) -> Scenario:
    return Scenario.model_validate({"dataset": dataset, "num_requests": n, **extra})


def _prompts(reqs: list[Any]) -> set[str]:
    return {json.dumps(r.prompt) for r in reqs}


DATASETS = [
    {"kind": "random", "input_len": 24, "output_len": 4, "range_ratio": 0.5, "seed": 3},
    {"kind": "shared_prefix", "prefix_len": 20, "suffix_len": 6, "output_len": 4, "num_prefixes": 2, "seed": 1},
]


@pytest.mark.parametrize("dataset", DATASETS, ids=lambda d: d["kind"])
def test_windows_draw_disjoint_sets_and_the_warmup_another(dataset: dict[str, Any]) -> None:
    sc = _scenario(dataset)
    timed: list[set[str]] = []
    for k in range(6):
        reqs, warm, record = window_prompts(sc, 3, None, k)
        assert len(reqs) == 6 and len(warm) == 3
        assert record == {"window": k, "fresh": True, "seed": dataset["seed"] + k * SEED_STRIDE,
                          "warmup_seed": record["warmup_seed"]}
        assert not _prompts(warm) & _prompts(reqs), "the warm-up sent one of the window's own prompts"
        timed.append(_prompts(reqs))
        # Both sides of a pair ask for the same index: the same prompts, in the same order.
        again, _, _ = window_prompts(sc, 3, None, k)
        assert [r.prompt for r in again] == [r.prompt for r in reqs]
    for i, a in enumerate(timed):
        for b in timed[i + 1:]:
            assert not a & b, "two windows sent a prompt in common"
    if dataset["kind"] == "shared_prefix":
        # The prefix a cache could keep across windows is new in every window too.
        firsts = [window_prompts(sc, 1, None, k)[0][0].prompt[:20] for k in range(6)]
        assert len(set(firsts)) == 6


def test_the_recorded_seed_reproduces_the_window() -> None:
    sc = _scenario(DATASETS[0])
    reqs, _, record = window_prompts(sc, 1, None, 4)
    # A one-window bench with the recorded seed sends exactly the window's prompts.
    bench = _scenario({**DATASETS[0], "seed": record["seed"]})
    assert [r.prompt for r in window_prompts(bench, 1, None, None)[0]] == [r.prompt for r in reqs]


def test_one_window_and_fixed_prompts_send_the_datasets_own_set() -> None:
    sc = _scenario(DATASETS[0])
    own = [r.prompt for r in build_requests(sc.dataset, 6)]
    reqs, warm, record = window_prompts(sc, 2, None, None)  # infra-agent bench: as before
    assert [r.prompt for r in reqs] == own
    assert [r.prompt for r in warm] == [r.prompt for r in build_requests(sc.dataset, 2, seed_offset=1_000_003)]
    assert record["fresh"] is False and record["seed"] == 3
    assert [r.prompt for r in window_prompts(sc, 2, None, 0)[0]] == own  # window 0 is the dataset's seed
    fixed = _scenario(DATASETS[0], fresh_prompts_per_window=False)
    for k in (1, 5):
        reqs, _, record = window_prompts(fixed, 2, None, k)
        assert [r.prompt for r in reqs] == own
        assert record == {"window": k, "fresh": False, "seed": 3, "warmup_seed": 3 + 1_000_003}


def _jsonl(tmp_path: Path, lines: int) -> Path:
    path = tmp_path / "prompts.jsonl"
    path.write_text("".join(json.dumps({"prompt": f"question number {i}"}) + "\n" for i in range(lines)))
    return path


def test_a_jsonl_file_is_read_as_a_ring_one_slice_per_window(tmp_path: Path) -> None:
    sc = _scenario({"kind": "jsonl", "path": str(_jsonl(tmp_path, 20)), "output_len": 4}, n=4)
    seen: set[str] = set()
    for k in range(5):  # 20 lines, 4 a window: five windows of their own
        reqs, warm, record = window_prompts(sc, 2, None, k)
        assert record["lines"] == 20 and record["first_line"] == 4 * k and not record["wraps"]
        assert not record["warmup_overlaps"] and not _prompts(warm) & _prompts(reqs)
        assert not _prompts(reqs) & seen, f"window {k} repeated a prompt"
        seen |= _prompts(reqs)
    assert len(seen) == 20
    reqs, _, record = window_prompts(sc, 2, None, 5)  # the sixth wraps around, and says so
    assert record["wraps"] and record["first_line"] == 0 and _prompts(reqs) <= seen
    # Window 0 is the order the file was always read in.
    assert [r.prompt for r in window_prompts(sc, 2, None, 0)[0]] == [r.prompt for r in window_prompts(sc, 2, None, None)[0]]


def test_a_jsonl_file_shorter_than_window_and_warmup_says_so(tmp_path: Path) -> None:
    sc = _scenario({"kind": "jsonl", "path": str(_jsonl(tmp_path, 5)), "output_len": 4}, n=4)
    _, _, record = window_prompts(sc, 2, None, 1)
    assert record["warmup_overlaps"] and record["wraps"]
    fixed = _scenario({"kind": "jsonl", "path": str(_jsonl(tmp_path, 5)), "output_len": 4}, n=4,
                      fresh_prompts_per_window=False)
    assert window_prompts(fixed, 2, None, 3)[2] == {"window": 3, "fresh": False, "order_seed": 0,
                                                     "warmup_order_seed": 1_000_003}


def test_interleaved_pairs_share_a_set_and_pairs_differ(fake_server_factory) -> None:  # type: ignore[no-untyped-def]
    a, b = fake_server_factory("--token-delay-ms", "1"), fake_server_factory("--token-delay-ms", "1")
    sc = _scenario({"kind": "random", "input_len": 8, "output_len": 4, "seed": 0}, n=4)
    runs = interleave_urls(a.url, b.url, sc, pairs=3, order="abba")
    assert [r["prompts"]["seed"] for r in runs.a] == [r["prompts"]["seed"] for r in runs.b] \
        == [k * SEED_STRIDE for k in range(3)]
    assert all(r["dataset"]["seed"] == 0 for r in runs.a + runs.b)  # the workload the judge compares is one
