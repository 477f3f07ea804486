"""A tiny code tree (a git repository), a workspace with an endpoint target, a loop state."""

from __future__ import annotations

from pathlib import Path

import pytest

from infra_agent.agent.proposers.base import LoopState
from infra_agent.tools import ToolContext, default_registry

from ..tool_fixtures import baseline, code_root, feedback, state, workspace  # noqa: F401  (fixtures)


@pytest.fixture
def ctx(state: LoopState, code_root: Path) -> ToolContext:
    submitted: list = []
    c = ToolContext(code_root=code_root, workspace=state.workspace, state=state, submit_step=submitted.append,
                    protected=["tests/**", "infra-agent.yaml"])
    c.submitted = submitted  # type: ignore[attr-defined]
    return c


@pytest.fixture
def registry():
    return default_registry()
