"""A workspace loaded for use: validated, and each check's config checked against its probe.

The workspace loader (:mod:`infra_agent.workspace.loader`) validates the file against the
workspace models; the checks' probe configs can only be validated by the probes, so the
commands that load a workspace to use it load it here.
"""

from __future__ import annotations

from pathlib import Path

from infra_agent.errors import ConfigError
from infra_agent.probes.base import get_probe
from infra_agent.workspace.loader import (
    find_workspace_file,
    node_location,
    parse_workspace,
)
from infra_agent.workspace.models import Workspace


def load_workspace(path: str | Path = ".") -> Workspace:
    """Load and validate a workspace, its checks' probe configs included; every problem raises ``ConfigError``."""
    file = find_workspace_file(path)
    try:
        text = file.read_text(encoding="utf-8")
    except (OSError, UnicodeDecodeError) as exc:
        raise ConfigError(str(file), None, "a readable UTF-8 file", str(exc)) from None
    workspace = parse_workspace(text, file)
    check_probe_configs(workspace, file, text)
    return workspace


def check_probe_configs(workspace: Workspace, file: Path, text: str) -> None:
    """Each check's config against its probe's typed config, rendered with the knob defaults.

    The probe module is imported only when the workspace declares checks.  It lives with the
    probes, which know their configs; the workspace layer below them does not import them.
    """
    if not workspace.checks:
        return
    defaults = {k: knob.default for k, knob in workspace.knobs.items() if knob.default is not None}
    for i, check in enumerate(workspace.checks):
        try:
            probe = get_probe(check.probe)
        except ConfigError as exc:
            raise ConfigError(node_location(file, text, ("checks", i, "probe")), f"checks.{i}.probe", exc.expected, check.probe) from None
        if set(check.placeholder_names()) - set(defaults):
            continue  # a knob without a default: checked when the run gives it a value
        probe.parse_config(check.render(defaults), where=str(file), text=text, prefix=("checks", i, "config"))
