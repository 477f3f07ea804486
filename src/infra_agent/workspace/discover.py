"""Build workspace knobs from a target's own knob listing.

A serving stack that publishes its launch flags as data (``refstack knobs --json``:
name, flag, type, domain (with the search space's scale, typical range and resource),
default, components, help) needs no hand-written knob
section: this module turns that listing into ``infra-agent.yaml`` knob entries and a
launch template whose placeholders are exactly those knobs.  Nothing here knows
refstack; any target with such a listing works.
"""

from __future__ import annotations

import json
import shlex
import subprocess
from collections.abc import Iterable, Sequence
from typing import Any

from infra_agent.errors import TargetError

# Launch flags the lifecycle owns: the port is chosen free on loopback at start.
_OWNED_BY_LIFECYCLE = frozenset({"port", "host"})
_SEARCH_SPACE_KEYS = ("scale", "typical", "resource", "per_process")


def read_knob_listing(command: Sequence[str], timeout_s: float = 60.0) -> list[dict[str, Any]]:
    """Run ``command`` (e.g. ``refstack knobs --json``) and parse its JSON list."""
    try:
        proc = subprocess.run(list(command), capture_output=True, text=True, timeout=timeout_s, check=False)
    except (OSError, subprocess.TimeoutExpired) as exc:
        raise TargetError(f"could not run knob listing {shlex.join(command)!r}: {exc}") from exc
    if proc.returncode != 0:
        raise TargetError(
            f"knob listing {shlex.join(command)!r} exited with {proc.returncode}: {proc.stderr.strip()[-500:]}"
        )
    try:
        listing = json.loads(proc.stdout)
    except json.JSONDecodeError as exc:
        raise TargetError(f"knob listing {shlex.join(command)!r} did not print JSON: {exc}") from exc
    if not isinstance(listing, list) or not all(isinstance(k, dict) and "name" in k for k in listing):
        raise TargetError(f"knob listing {shlex.join(command)!r}: expected a JSON list of objects with 'name'")
    return listing


def knob_entry(item: dict[str, Any]) -> dict[str, Any]:
    """One listing item -> the ``knobs.<name>`` mapping of ``infra-agent.yaml``."""
    domain = item.get("domain") or {}
    kind = item["type"]
    entry: dict[str, Any] = {"type": kind}
    if kind == "bool":
        pass  # a bool's domain is implied; the listing may spell it as choices
    elif "choices" in domain:
        entry["choices"] = list(domain["choices"])
    for bound in ("min", "max"):
        if bound in domain and kind in ("int", "float"):
            entry[bound] = domain[bound]
    if kind in ("int", "float"):
        # The search space, as the listing declares it (refstack: inside ``domain``; another
        # stack may put it beside): scale, typical range, and what the knob consumes.
        for key in _SEARCH_SPACE_KEYS:
            value = domain.get(key, item.get(key))
            if value is not None:
                entry[key] = list(value) if key == "typical" else value
    if item.get("changes_outputs") is True:
        entry["changes_outputs"] = True
    if item.get("default") is not None:
        entry["default"] = item["default"]
    entry["components"] = list(item.get("components") or [])
    if item.get("help"):
        entry["help"] = item["help"]
    return entry


def workspace_knobs(
    listing: Iterable[dict[str, Any]], fixed: dict[str, Any] | None = None
) -> tuple[dict[str, dict[str, Any]], list[str]]:
    """Knob entries and the launch-flag fragment (``--flag {name}`` ...) for a listing.

    ``fixed`` pins flags to a value in the command instead of exposing them as knobs
    (the demo pins the model preset).  Every knob is rendered ``--flag {name}``, so
    flags must take a value (``--trace true``); a listing item that is a bare switch
    says ``"takes_value": false`` and is left out, as a knob and from the template.
    """
    fixed = dict(fixed or {})
    knobs: dict[str, dict[str, Any]] = {}
    flags: list[str] = []
    for item in listing:
        name = item["name"]
        flag = item.get("flag") or "--" + name.replace("_", "-")
        if name in _OWNED_BY_LIFECYCLE:
            continue
        if name in fixed:
            flags += [flag, str(fixed.pop(name))]
            continue
        if item.get("takes_value", True) is False:
            continue
        knobs[name] = knob_entry(item)
        flags += [flag, "{" + name + "}"]
    if fixed:
        raise TargetError(f"cannot pin {sorted(fixed)}: not in the target's knob listing")
    return knobs, flags
