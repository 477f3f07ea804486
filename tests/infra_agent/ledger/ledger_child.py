"""A second process for the ledger tests.

``python ledger_child.py write DB N``: save experiments 0..N-1 of run ``run-1``,
printing ``saved SEQ`` after each commit (the parent SIGKILLs it part-way).
``python ledger_child.py read DB [N]``: read the ledger repeatedly until N different
states were seen; print them as JSON.
"""

from __future__ import annotations

import json
import sys
import time

from ledger_factories import make_experiment  # this script's folder is sys.path[0]

from infra_agent.ledger import Ledger


def write(db: str, n: int) -> None:
    with Ledger(db) as led:
        for seq in range(n):
            # Large feedback makes each transaction long enough for the kill to land inside one.
            led.save_experiment(make_experiment(seq=seq, n_measurements=40, n_samples=200))
            print(f"saved {seq}", flush=True)


def read(db: str, want: int) -> None:
    """Read until ``want`` different states of run-1's experiment list were seen (15 s at most)."""
    t0 = time.monotonic()
    snapshots: list[list[str]] = []
    with Ledger(db) as led:
        runs = [r.id for r in led.list_runs()]
        while True:
            exps = [e.id for e in led.experiments("run-1")]  # decodes every experiment whole
            if not snapshots or exps != snapshots[-1]:
                snapshots.append(exps)
            if len(snapshots) >= want or time.monotonic() - t0 > 15:
                break
    print(json.dumps({"runs": runs, "snapshots": snapshots, "seconds": time.monotonic() - t0}), flush=True)


if __name__ == "__main__":
    if sys.argv[1] == "write":
        write(sys.argv[2], int(sys.argv[3]))
    else:
        read(sys.argv[2], int(sys.argv[3]) if len(sys.argv) > 3 else 1)
