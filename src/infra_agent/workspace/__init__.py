"""Workspaces: ``infra-agent.yaml`` loaded into typed, validated models.

Public surface: :func:`load_workspace` and the models it returns.
"""

from __future__ import annotations

from infra_agent.workspace.knobs import (
    DomainError,
    Knob,
    KnobValue,
    parse_assignments,
    render_value,
)
from infra_agent.workspace.loader import (
    WORKSPACE_FILE,
    find_workspace_file,
    load_workspace,
    parse_workspace,
)
from infra_agent.workspace.models import (
    Criterion,
    Dataset,
    EndpointTargetSpec,
    JsonlDataset,
    RandomDataset,
    RandomMMDataset,
    Scenario,
    ServerTargetSpec,
    SharedPrefixDataset,
    Slo,
    Target,
    Workspace,
    metric_direction,
)

__all__ = [
    "WORKSPACE_FILE",
    "Criterion",
    "Dataset",
    "DomainError",
    "EndpointTargetSpec",
    "JsonlDataset",
    "Knob",
    "KnobValue",
    "RandomDataset",
    "RandomMMDataset",
    "Scenario",
    "ServerTargetSpec",
    "SharedPrefixDataset",
    "Slo",
    "Target",
    "Workspace",
    "find_workspace_file",
    "load_workspace",
    "metric_direction",
    "parse_assignments",
    "parse_workspace",
    "render_value",
]
