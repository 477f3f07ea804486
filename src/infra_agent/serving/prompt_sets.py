"""Which prompts a measured window sends: a fresh set per window, so none repeats.

Datasets are seeded, so without this every window of an experiment sends the same
prompts.  A server can then answer a repeated prompt from a cache of its own earlier
answer (the right length, even the right text, at no cost), and a legitimate prefix
cache profits from the repetition too, which real traffic does not offer.  So each
window draws the prompt set its *index* names:

- ``random`` and ``shared_prefix``: the dataset's seed plus ``index * SEED_STRIDE``.
  Index 0 is the dataset's own seed; the stride keeps the sets of scenarios whose
  seeds are 0, 1, 2 ... apart (with ``+ index`` scenario 1's window 0 would send
  scenario 0's window 1).
- ``jsonl`` (a fixed list of prompts): the lines are shuffled once (seed 0, as
  before) and read as a ring, window ``k`` from position ``k * n``; a file of ``L``
  lines gives ``L // n`` windows disjoint prompts, then the ring wraps and prompts
  recur (the record says ``wraps``).

Warm-up requests come from yet another set (``WARMUP_SEED_OFFSET`` further on; for a
JSONL file, the ``warm_n`` lines just before the window's), so the warm-up never
sends one of the timed prompts ahead of them.  The caller gives both sides of an A/B
pair the same index (pairing still cancels the prompt mix) and every later pair, a
re-run window and a later batch a new one (``agent/executors/prompt_sets.py``).

``index=None`` (``infra-agent bench``: one window) and a scenario with
``fresh_prompts_per_window: false`` send the dataset's own set, as before.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

from infra_agent.serving.client import RequestInput
from infra_agent.serving.datasets import Tokenizer, build_requests, jsonl_requests

# A prime: seed s + k * stride never equals another scenario's s' + k' * stride unless
# the two seeds differ by a multiple of it.
SEED_STRIDE = 7919
# Where warm-up prompts are drawn: a prime too, so no warm-up seed is a timed one's.
WARMUP_SEED_OFFSET = 1_000_003


def window_prompts(scenario: Any, warm_n: int, tokenizer: Tokenizer | None,
                   index: int | None) -> tuple[list[RequestInput], list[RequestInput], dict[str, Any]]:
    """(timed requests, warm-up requests, the record of what was drawn) for window ``index``."""
    dataset, n = scenario.dataset, scenario.num_requests
    fresh = index is not None and bool(getattr(scenario, "fresh_prompts_per_window", True))
    if dataset.kind == "jsonl":
        return _jsonl(dataset, n, warm_n, tokenizer, index, fresh)
    offset = index * SEED_STRIDE if fresh and index is not None else 0
    timed = build_requests(dataset, n, tokenizer, seed_offset=offset)
    warm = build_requests(dataset, warm_n, tokenizer, seed_offset=offset + WARMUP_SEED_OFFSET)
    record = {"window": index, "fresh": fresh, "seed": dataset.seed + offset,
              "warmup_seed": dataset.seed + offset + WARMUP_SEED_OFFSET}
    return timed, warm, record


def _jsonl(dataset: Any, n: int, warm_n: int, tokenizer: Tokenizer | None, index: int | None,
           fresh: bool) -> tuple[list[RequestInput], list[RequestInput], dict[str, Any]]:
    path, field = dataset.path, dataset.prompt_field
    if not fresh or index is None:
        timed = jsonl_requests(path, n, dataset.output_len, field, tokenizer, 0)
        warm = jsonl_requests(path, warm_n, dataset.output_len, field, tokenizer, WARMUP_SEED_OFFSET)
        return timed, warm, {"window": index, "fresh": False, "order_seed": 0, "warmup_order_seed": WARMUP_SEED_OFFSET}
    start = index * n
    timed = jsonl_requests(path, n, dataset.output_len, field, tokenizer, 0, start=start)
    warm = jsonl_requests(path, warm_n, dataset.output_len, field, tokenizer, 0, start=start - warm_n)
    lines = _lines(path)
    record = {"window": index, "fresh": True, "order_seed": 0, "lines": lines, "first_line": start % lines,
              # This window's lines were an earlier window's too: the file holds fewer prompts
              # than the windows so far asked for.
              "wraps": start + n > lines,
              # The warm-up's lines are among the window's own: the file is shorter than both.
              "warmup_overlaps": n + warm_n > lines}
    return timed, warm, record


def _lines(path: str | Path) -> int:
    """Prompt lines in the file (jsonl_requests has read and checked it already)."""
    return sum(1 for line in Path(path).read_text().splitlines() if line.strip())
