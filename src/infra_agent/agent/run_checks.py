"""Checks a run makes before anything runs: its scenarios, the target's program, the LLM endpoint.

A mistake found here leaves nothing in the ledger (agent/runner.py ``preflight``): no
baseline waits minutes for a program that is not installed, or for a key an endpoint
refuses.
"""

from __future__ import annotations

import os
import shlex
import shutil
from pathlib import Path

from infra_agent.errors import ConfigError
from infra_agent.workspace.models import ServerTargetSpec, Workspace


def check_scenarios(ws: Workspace, names: list[str] | None) -> None:
    known = sorted(ws.scenarios)
    for name in names or []:
        if name not in ws.scenarios:
            raise ConfigError("--scenario", None, f"one of the scenarios of {ws.source or ws.root} ({', '.join(known) or 'none'})",
                              name)


def check_target_command(ws: Workspace) -> None:
    """A server target's program must exist before a baseline waits for it to start.

    Only the first word of a command that runs without a shell is checked (a shell
    command, or a first word with a placeholder, is left to the launch)."""
    spec = ws.target
    if not isinstance(spec, ServerTargetSpec):  # the only kind that launches a program
        return
    from infra_agent.target.launch import needs_shell

    if isinstance(spec.command, list):
        program = spec.command[0]
    elif needs_shell(spec.command):
        return
    else:
        try:
            words = shlex.split(spec.command)
        except ValueError:
            return
        if not words:
            return
        program = words[0]
    if "{" in program or (spec.cwd and "{" in spec.cwd):
        return
    cwd = ws.root if spec.cwd is None else ws.root / spec.cwd
    where = str(ws.source or ws.root)
    if "/" in program:
        path = Path(program) if Path(program).is_absolute() else cwd / program
        if not path.is_file():
            raise ConfigError(where, "target.command", f"a program that exists (relative to {cwd})", program)
        if not os.access(path, os.X_OK):
            raise ConfigError(where, "target.command", f"an executable program ({path} is not executable: chmod +x, "
                              "or start the command with its interpreter)", program)
        return
    search = spec.env.get("PATH") if "PATH" in spec.env and "{" not in spec.env["PATH"] else os.environ.get("PATH", "")
    if shutil.which(program, path=search) is None:
        raise ConfigError(where, "target.command", "a program found on PATH (is it installed, and is its environment active?)",
                          program)


def check_llm_endpoint(base_url: str, timeout_s: float = 10.0) -> None:
    """Fail before the baseline, not after it, when the LLM endpoint cannot be reached or refuses the key.

    ``GET {base_url}/models``; a status other than 401/403 is left to the chat calls (some
    endpoints do not list models)."""
    import httpx

    from infra_agent.agent.proposers.llm_client import (
        KEY_ENV_VARS,
        LLMError,
        is_loopback,
        resolve_key,
    )

    base = base_url.rstrip("/")
    key, source = resolve_key(None, base)
    try:
        with httpx.Client(timeout=timeout_s, trust_env=not is_loopback(base)) as client:
            resp = client.get(base + "/models", headers={"Authorization": f"Bearer {key}"})
            if resp.status_code == 404 and not base.endswith("/v1"):
                alt = client.get(base + "/v1/models", headers={"Authorization": f"Bearer {key}"})
                if alt.status_code == 200:
                    raise LLMError(f"the LLM endpoint at {base} (--base-url) answered HTTP 404 for /models, and "
                                   f"{base}/v1/models answers: use --base-url {base}/v1")
    except httpx.TimeoutException:
        raise LLMError(f"the LLM endpoint at {base} (--base-url) did not answer within {timeout_s:g} s: "
                       "is the server running, and is the URL right?") from None
    except httpx.HTTPError as exc:
        reason = str(exc.__cause__ or exc) or type(exc).__name__
        raise LLMError(f"cannot reach the LLM endpoint at {base} (--base-url): {reason}: "
                       "is the server running, and is the URL right?") from None
    if resp.status_code in (401, 403):
        raise LLMError(f"the LLM endpoint at {base} (--base-url) refused the API key (HTTP {resp.status_code}); "
                       f"the key came from {source}: check {KEY_ENV_VARS[0]} (or {KEY_ENV_VARS[1]})")


__all__ = ["check_llm_endpoint", "check_scenarios", "check_target_command"]
