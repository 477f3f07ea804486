"""The ledger's errors: both are ``InfraAgentError``s, so the CLI prints them cleanly."""

from __future__ import annotations

from pathlib import Path

from infra_agent.errors import InfraAgentError


class LedgerError(InfraAgentError):
    """The ledger file cannot be used, or a run/experiment it was asked for is not in it."""


class SchemaTooNew(LedgerError):
    """The ledger was written by a newer infra-agent; reading it could misread or damage it."""

    def __init__(self, path: Path, found: int, supported: int) -> None:
        self.path = path
        self.found = found
        self.supported = supported
        super().__init__(
            f"ledger {path} has schema version {found}, but this infra-agent supports schema version "
            f"{supported} at most; upgrade infra-agent to read it (this file was left untouched)"
        )
