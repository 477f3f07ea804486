"""A run's status as shown to a user or a model: ``stale`` for a run whose owner is gone.

The ledger keeps what the run last wrote; a run killed with SIGKILL (or whose machine
crashed) never wrote its end, so its record still says ``running``.  Every view of the
runs (``infra-agent ls``, the MCP ``list_runs`` tool) asks this one function, so they agree.
"""

from __future__ import annotations

import socket

from infra_agent.agent.runner import live_owner
from infra_agent.ledger import Ledger
from infra_agent.records import RunRecord


def is_stale(ledger: Ledger, run: RunRecord) -> bool:
    """A run recorded as ``running`` whose owner process on this machine is gone (killed, crashed).

    The owner's pid, host and start time are in the ledger; a run owned by another host cannot
    be checked from here and keeps its status.  ``infra-agent resume`` picks a stale run up."""
    if run.status != "running":
        return False
    owner = ledger.get_state(run.id, "owner") or {}
    if owner.get("host") not in (None, socket.gethostname()):
        return False
    return live_owner(ledger, run.id) is None


def shown_status(ledger: Ledger, run: RunRecord) -> str:
    """The run's recorded status, or ``stale`` where ``is_stale`` says so."""
    return "stale" if is_stale(ledger, run) else run.status


def first_line(message: str | None, width: int = 160) -> str:
    """One line of a run's message: a failure's message can carry a server's log tail."""
    line = (message or "").strip().splitlines()[0].strip() if (message or "").strip() else "-"
    return line if len(line) <= width else line[: width - 1] + "…"
