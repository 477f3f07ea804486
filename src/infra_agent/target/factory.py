"""``open_target``: the running form of a workspace's target, whichever its kind."""

from __future__ import annotations

from collections.abc import Iterator, Mapping
from contextlib import contextmanager
from pathlib import Path

from infra_agent.errors import ConfigError
from infra_agent.target.base import RunningTarget
from infra_agent.target.endpoint import EndpointTarget
from infra_agent.target.server import ServerProcess
from infra_agent.workspace.knobs import KnobValue
from infra_agent.workspace.models import EndpointTargetSpec, ServerTargetSpec, Workspace


@contextmanager
def open_target(
    workspace: Workspace,
    knob_values: Mapping[str, KnobValue] | None,
    log_dir: str | Path,
    *,
    ready_timeout_s: float | None = None,
    owner_token: str | None = None,
) -> Iterator[RunningTarget]:
    """Launch (server) or reach (endpoint) the target; a server is stopped on exit.

    ``knob_values`` is usually ``workspace.resolve_knobs(overrides)``; None means the
    defaults.  ``owner_token`` marks a launched server's environment
    (``INFRA_AGENT_OWNER=<pid>:<token>``) for ``procgroup.kill_owned_groups``; by default
    ``$INFRA_AGENT_OWNER_TOKEN`` or a token of this process.
    """
    values = workspace.resolve_knobs() if knob_values is None else dict(knob_values)
    spec = workspace.target
    file = str(workspace.source) if workspace.source else None
    if isinstance(spec, ServerTargetSpec):
        with ServerProcess(spec, values, log_dir, root=workspace.root, ready_timeout_s=ready_timeout_s, file=file,
                           owner_token=owner_token) as server:
            yield server
    elif isinstance(spec, EndpointTargetSpec):
        # An endpoint is already running: a knob change could not reach it, and
        # silently measuring the unchanged server would be a wrong answer.
        changed = sorted(k for k, v in values.items() if workspace.resolve_knobs().get(k) != v)
        if changed:
            raise ConfigError(file, "target.kind", "a server target to apply knob changes", f"endpoint (knobs changed: {', '.join(changed)})")
        with EndpointTarget(spec, file=file) as endpoint:
            yield endpoint
    else:
        raise AssertionError(f"unhandled target kind {type(spec).__name__}")
