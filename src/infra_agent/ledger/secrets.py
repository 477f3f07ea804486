"""The secrets a workspace's ledger masks besides the environment's: its target's.

The ledger is masked by value like every other channel (``infra_agent.safety``): the
environment's secret-looking values, and, for a ledger inside a workspace
(``<root>/.infra-agent/ledger.db``), the values its target holds: ``target.env`` entries
with a secret name and the password of any ``scheme://user:pass@host`` URL in them,
the value after a secret flag of the launch command, secret headers.  A server's log
tail or an error message that repeats one of them is masked wherever it occurs.
"""

from __future__ import annotations

import logging
from pathlib import Path

from infra_agent.safety import target_secrets

log = logging.getLogger(__name__)

WORKSPACE_FILE = "infra-agent.yaml"


def ledger_workspace_secrets(ledger_path: Path, ledger_dir: str) -> list[str]:
    """The target's secrets of the workspace that holds ``ledger_path``; none for a ledger elsewhere."""
    if ledger_path.parent.name != ledger_dir:
        return []
    file = ledger_path.parent.parent / WORKSPACE_FILE
    if not file.is_file():
        return []
    from infra_agent.workspace import load_workspace

    try:
        ws = load_workspace(file)
    except Exception as exc:  # noqa: BLE001 - a broken workspace file masks the environment's secrets still
        # Its own load reports the problem; here it only means its target's values are not known.
        log.debug("ledger %s: workspace file not loaded for masking: %s", ledger_path, type(exc).__name__)
        return []
    return target_secrets(ws.target)
