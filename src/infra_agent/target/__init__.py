"""Targets at run time: launched servers and already-running endpoints."""

from __future__ import annotations

from infra_agent.target.base import RunningTarget
from infra_agent.target.endpoint import EndpointTarget
from infra_agent.target.factory import open_target
from infra_agent.target.launch import LaunchPlan, needs_shell, plan_launch
from infra_agent.target.ports import LOOPBACK, free_port
from infra_agent.target.procgroup import (
    find_owned_groups,
    group_alive,
    group_members,
    kill_owned_groups,
)
from infra_agent.target.server import ServerProcess

__all__ = [
    "LOOPBACK",
    "EndpointTarget",
    "LaunchPlan",
    "RunningTarget",
    "ServerProcess",
    "find_owned_groups",
    "free_port",
    "group_alive",
    "group_members",
    "kill_owned_groups",
    "needs_shell",
    "open_target",
    "plan_launch",
]
