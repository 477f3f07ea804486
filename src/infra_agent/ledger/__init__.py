"""The ledger: runs, experiments and their feedback in SQLite (see DESIGN.md, Ledger).

``Ledger.for_workspace(root)`` opens ``<root>/.infra-agent/ledger.db``.  Experiments
are stored whole as JSON, with their measurements, findings and artifacts also as
rows for queries; secrets are scrubbed before anything is written.
"""

from __future__ import annotations

from infra_agent.ledger.costs import ProbeCost
from infra_agent.ledger.errors import LedgerError, SchemaTooNew
from infra_agent.ledger.schema import SCHEMA_VERSION
from infra_agent.ledger.store import Ledger

__all__ = ["SCHEMA_VERSION", "Ledger", "LedgerError", "ProbeCost", "SchemaTooNew"]
