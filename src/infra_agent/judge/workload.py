"""Whether two sets of runs ran the same workload: ``workload_mismatch``.

A ratio of two sides means nothing when they sent different requests (another model,
request count, rate or dataset), so the result headers are compared field by field.
"""

from __future__ import annotations

import json
import math
from collections.abc import Mapping, Sequence
from typing import Any

# Header keys of a result that define its workload (``dataset`` is compared key by key).
WORKLOAD_KEYS = ("model_id", "endpoint", "num_prompts", "max_concurrency", "request_rate", "burstiness", "dataset")
_ABSENT = "(absent)"


def _workload(run: Mapping[str, Any]) -> dict[str, str]:
    out: dict[str, str] = {}
    for key in WORKLOAD_KEYS:
        if key not in run:
            continue
        value = run[key]
        items = [(f"{key}.{k}", v) for k, v in value.items()] if key == "dataset" and isinstance(value, Mapping) else [(key, value)]
        for name, v in items:
            if isinstance(v, float) and math.isinf(v):
                v = "inf"  # the result files write an infinite rate as "inf"
            out[name] = json.dumps(v, sort_keys=True, default=str)
    return out


def workload_mismatch(a_runs: Sequence[Mapping[str, Any]], b_runs: Sequence[Mapping[str, Any]]) -> list[str]:
    """Where the runs of A and B did not run the same workload, one line per field.

    Compares the result headers (model, endpoint, request count, concurrency, rate,
    burstiness) and the dataset (kind, lengths, seed, ...) of every run that did not fail
    outright: ``["num_prompts: A 16, B 32", "dataset.seed: A 0, B 1"]``.  A field that
    only one side records, or that varies between one side's runs, is a difference too.
    Empty when they match, or when a side has no run to read a workload from.
    """
    a = [_workload(r) for r in a_runs if r.get("ok", True) is not False]
    b = [_workload(r) for r in b_runs if r.get("ok", True) is not False]
    if not a or not b:
        return []
    names = list(dict.fromkeys(k for w in a + b for k in w))
    out = []
    for name in names:
        va = list(dict.fromkeys(w.get(name, _ABSENT) for w in a))
        vb = list(dict.fromkeys(w.get(name, _ABSENT) for w in b))
        if va == vb and len(va) == 1:
            continue
        out.append(f"{name}: A {_values(va, 'A')}, B {_values(vb, 'B')}")
    return out


def _values(values: list[str], side: str) -> str:
    if len(values) == 1:
        return values[0]
    return " or ".join(values) + f" (differs between {side}'s runs)"


__all__ = ["WORKLOAD_KEYS", "workload_mismatch"]
